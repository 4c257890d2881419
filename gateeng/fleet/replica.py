"""EngineReplica: one Engine in a Ray actor, as the fleet's front drives it.

The actor owns its engine, its Prometheus registry (serving.metrics, read by the
front on each scrape) and at most one staged checkpoint. Requests arrive as token
ids (the front tokenizes, for its routing) and leave as the engine's own events,
each Completion's record naming this replica. Ray restarts a replica that dies
(max_restarts); it comes back on the model it was started with, and the front
brings it to the fleet's weights before it routes a request to it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from prometheus_client import generate_latest

from gateeng.config import EngineConfig, ModelConfig
from gateeng.engine.aio import stream_request
from gateeng.engine.engine import Engine
from gateeng.engine.records import Counts
from gateeng.fleet.ranks import peak_rss, write_checkpoint
from gateeng.outputs import Completion
from gateeng.reproducibility import Reproducibility
from gateeng.serving.gateway import model_name
from gateeng.serving.metrics import Metrics


@dataclass(frozen=True)
class Facts:
    """What the front serves from, as a replica reports it (all picklable)."""
    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    eos: frozenset
    tokenizer: object
    version: str
    selfcheck: object
    reproducibility: Reproducibility
    source: str


@dataclass(frozen=True)
class State:
    """A replica's weights and occupancy, polled by the front."""
    weight_version: int
    fingerprint: str
    counts: Counts


class EngineReplica:
    def __init__(self, config: EngineConfig, name: str, served_model_name: Optional[str], ranks=None):
        """`ranks`: its tensor-parallel ranks 1..N-1 (fleet.ranks.RayRanks), else None."""
        self.name = name
        self.engine = Engine(config, ranks=ranks)
        if self.engine.core.tp_group is not None:
            # A rank that dies fails the engine: the replica then exits, so that Ray
            # restarts it with new ranks, and the front re-runs its requests elsewhere.
            self.engine.on_death.append(lambda exc: os._exit(1))
        self.metrics = Metrics()
        self.metrics.attach(self.engine, served_model_name or model_name(self.engine.loaded.source))
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateeng-replica")
        self._staged = None   # a checkpoint prepared aside (Engine.prepare_weights), until committed

    def facts(self) -> Facts:
        e = self.engine
        return Facts(e.config, e.model_config, e.max_model_len, frozenset(e.stop.eos), e.tokenizer, e.version,
                     e.selfcheck, e.reproducibility, e.loaded.source)

    def state(self) -> State:
        return State(self.engine.weight_version, self.engine.loaded.fingerprint, self.engine.counts)

    async def stream(self, ids: list, sampling, determinism, request_id: str):
        """The request's events: Submitted once the engine took it (or its refusal,
        raised), then Chunk / Rollback, then the Completion."""
        async for ev in stream_request(self.engine, self.pool, ids, sampling, determinism, request_id):
            if isinstance(ev, Completion):
                ev.reproducibility = dataclasses.replace(ev.reproducibility, replica=self.name)
            yield ev

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def set_gate(self, margin_threshold: Optional[float], max_window: Optional[int]) -> None:
        if margin_threshold is not None:
            self.engine.set_margin_threshold(margin_threshold)
        if max_window is not None:
            self.engine.set_max_window(max_window)

    def metrics_text(self) -> bytes:
        return generate_latest(self.metrics.registry)

    async def stage_weights(self, checkpoint: list) -> str:
        """Prepare a checkpoint aside; returns its fingerprint. `checkpoint`: [the
        object-store reference of its files ({file name: bytes}), put there once by
        the front], in a list so that Ray hands over the reference and this replica
        and each of its tensor-parallel ranks fetch the bytes to their own node.
        Raises what Engine.prepare_weights raises, and nothing served changes."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._stage, checkpoint[0])

    def _stage(self, ref) -> str:
        import ray
        self.discard_weights()
        group = self.engine.core.tp_group
        ranks = group.workers if group is not None else []   # each reads its shard from its own node's copy
        where, theirs = write_checkpoint(ray.get(ref)), []
        try:
            theirs = ray.get([rank.actor.receive_checkpoint.remote(ref) for rank in ranks])
            self._staged = self.engine.prepare_weights(where, [where] + theirs if ranks else None)
        finally:
            shutil.rmtree(where, ignore_errors=True)
            ray.get([rank.actor.remove_checkpoint.remote(path) for rank, path in zip(ranks, theirs)])
        return self._staged.fingerprint

    async def commit_weights(self, weight_version: int, source: str):
        """Swap the staged checkpoint in as `weight_version` (Engine.swap_weights)."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError(f"replica {self.name}: no checkpoint is staged")
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, lambda: self.engine.swap_weights(staged, weight_version, source))

    def peak_rss(self) -> list:
        """Every rank's peak resident memory in bytes (/proc's VmHWM), rank 0's first."""
        import ray
        group = self.engine.core.tp_group
        workers = group.workers if group is not None else []
        return [peak_rss()] + ray.get([w.actor.peak_rss.remote() for w in workers])

    def discard_weights(self) -> None:
        staged, self._staged = self._staged, None
        self.engine.discard_weights(staged)
