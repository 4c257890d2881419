"""Weights in place at tensor-parallel sizes > 1: every rank builds its own shard of
the new checkpoint aside, and either all of them switch together or none does.

Two phases over the group (engine.tp_processes' messages PREPARE, STATUS, COMMIT and
DISCARD). The driver (rank 0) first checks the checkpoint against the served model
from its config.json and its files' headers (engine.weights: every name, shape and
dtype), then announces PREPARE: every rank, the driver too, reads only its own shard
of the checkpoint by byte ranges (model.shard_read, each value checked finite in
bf16), checks that it splits as the shard it serves, and builds its shard model and
plans aside; a worker does so on a thread of its own while it keeps serving the old
weights. The driver then asks every rank's state (STATUS) until each is ready or
refused. Any refusal or error, on any rank: DISCARD everywhere, WeightsRefused naming
the rank and why, and nothing served changed. All ready: the driver's Prepared goes
to the engine, whose step boundary (EngineCore.apply_weight_update) announces COMMIT,
and every rank swaps in what it built before the next call reaches it. A Prepared
that is not swapped in is discarded (Engine.discard_weights).

The fingerprint is the one a single server computes over the same checkpoint
(model.shard_read.fingerprint streams every tensor through the hash), so an
answer's record names the same weights at every size.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from gateeng.config import EngineConfig, ModelConfig
from gateeng.engine import weights
from gateeng.engine.errors import WeightsRefused
from gateeng.model import families, shard, shard_read
from gateeng.model.loader import DTYPES, Checkpoint, weight_files
from gateeng.plans import factory, reference_ops, sharded

READY = ""   # a rank's state once its shard is built; None while it builds; else why it refused


def shard_plans(cfg: EngineConfig, model) -> factory.Plans:
    """A rank's plans for its shard model. ValueError where the reference, which alone
    sums a row-parallel projection as one device does, cannot run it."""
    plans = factory.build(cfg, model, model.cfg, DTYPES[cfg.dtype], owned=True)
    if plans.unavailable or not hasattr(plans.invariant, "linear_partial"):
        raise ValueError("tensor parallelism needs the reference (gateeng-ref-1) on this machine: "
                         + (plans.unavailable or "its kernels did not build"))
    return plans


def prepare_rank(cfg: EngineConfig, path, layout: shard.ShardLayout) -> tuple:
    """(the rank's new shard model, its plans) from the checkpoint directory `path`,
    read by byte ranges, for the rank `layout` describes (the one it serves).
    WeightsRefused where a tensor cannot be read, a value is not finite in bf16, or
    the checkpoint would split otherwise."""
    try:
        got = shard_read.read_shard(path, layout.size, layout.rank, finite=True)
    except Exception as exc:   # safetensors' errors, OSError, ValueError naming the tensor
        raise WeightsRefused(str(exc) or type(exc).__name__) from None
    if got.layout != layout:
        raise WeightsRefused(f"{path} splits over the ranks otherwise than the served model")
    model = shard.build_shard(got.config, got.layout, got.tensors, got.stored_types, reference_ops.load())
    del got
    plans = shard_plans(cfg, model)
    plans.release_threads()   # this thread's OpenMP pool; the serving thread has its own
    return model, plans


class Aside:
    """A worker rank's new shard, built on a thread of its own (PREPARE) while the rank
    serves, until COMMIT takes it or DISCARD drops it."""

    def __init__(self):
        self._job: Optional[dict] = None

    def prepare(self, cfg: EngineConfig, path, layout: shard.ShardLayout) -> None:
        self._job = job = {"state": None}

        def build():
            try:
                job["built"] = prepare_rank(cfg, path, layout)
                job["state"] = READY
            except Exception as exc:   # a refusal, or any error: the driver discards everywhere
                job["state"] = str(exc) or type(exc).__name__
        threading.Thread(target=build, name="gateeng-weights-aside", daemon=True).start()

    def state(self) -> Optional[str]:
        """READY, None while building, else why the rank refused."""
        return "no checkpoint is being prepared" if self._job is None else self._job["state"]

    def take(self) -> tuple:
        """(model, plans) built, no longer held here."""
        job, self._job = self._job, None
        if job is None or job["state"] != READY:
            raise RuntimeError("COMMIT announced, but this rank holds no prepared checkpoint")
        return job.pop("built")

    def discard(self) -> None:
        self._job = None   # a build still running is dropped when it ends


def prepare(cfg: EngineConfig, served: ModelConfig, path, group, layout: shard.ShardLayout,
            paths: Optional[list] = None) -> weights.Prepared:
    """The checkpoint in directory `path` built aside on every rank of `group`
    (tp_processes.Group), the driver's shard (`layout`) here (see the module doc).
    `paths`: each rank's own copy of it, rank 0's first, where the ranks do not share
    this file system (a fleet's ranks on other nodes); else every rank reads `path`.
    Raises WeightsRefused; nothing served changes."""
    t0 = time.perf_counter()
    new, files = weights.checked_files(served, path)
    weights.check_headers(files, served, DTYPES[cfg.dtype])
    read_seconds = time.perf_counter() - t0
    group.prepare_weights(tuple(str(p) for p in paths) if paths else (str(path),) * group.size)
    try:
        fingerprint: list = []
        hashing = threading.Thread(target=_fingerprint, args=(path, fingerprint), name="gateeng-fingerprint",
                                   daemon=True)
        hashing.start()
        refusals = []
        try:
            model, plans = prepare_rank(cfg, path, layout)
            _check_tied(path, served)
        except Exception as exc:
            refusals.append(f"rank 0: {exc}")
        states = group.weights_states()
        refusals += [f"rank {rank}: {why}" for rank, why in enumerate(states, 1) if why != READY]
        hashing.join()
        if not refusals and isinstance(fingerprint[0], BaseException):
            refusals.append(f"fingerprinting {path}: {fingerprint[0]}")
        if refusals:
            raise WeightsRefused("; ".join(refusals))
    except BaseException:
        group.discard_weights()
        raise
    return weights.Prepared(model, sharded.announcing(plans, group.command), fingerprint[0], read_seconds,
                            time.perf_counter() - t0 - read_seconds)


def _fingerprint(path, out: list) -> None:
    try:
        out.append(shard_read.fingerprint(path))
    except Exception as exc:   # the reads' errors: the update is refused
        out.append(exc)


def _check_tied(path, served: ModelConfig) -> None:
    """A tied lm_head stored in the checkpoint holds the embedding's values, as at size 1
    (engine.weights); the lm_head served is the embedding."""
    block = families.of(served).block
    tied, embed = block.lm_head.hf[0], block.embed.hf[0]
    if not served.tie_word_embeddings:
        return
    ckpt = Checkpoint(weight_files(path))
    if tied in ckpt and not torch.equal(ckpt[tied].to(torch.bfloat16), ckpt[embed].to(torch.bfloat16)):
        raise WeightsRefused(weights.tied_differs(served))
