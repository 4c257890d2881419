"""Tensor parallelism's processes: the engine's process is rank 0, the driver, and
runs its own shard; ranks 1..N-1 are worker processes that torch.multiprocessing
starts, each running its shard for every call the driver announces. All N join
one torch.distributed group (gloo on CPU) whose timeout bounds every collective.

The scheduler, the verification stage, the token choice and the outputs stay in
the driver. What crosses the group: each forward's Rows and each logits call's
hidden states (broadcast_object_list from rank 0), the row-parallel sums and the
vocabulary-parallel logits (plans.collectives). Nothing else: no home-made
transport.

Start-up: the driver shards the model (model.shard) and builds its own plans
first, so the C++ kernels are compiled once; then it starts the workers, handing
each its shard's tensors through shared memory. A worker builds its plans and
KV cache, reports on the group's TCPStore that it is up, and joins the group.

Fail closed: a worker that exits is seen at once through its process sentinel
(`on_death` callbacks: the engine then fails every request); one that hangs makes
the next collective time out; a collective that fails raises
TensorParallelFailure. While the driver is idle it sends a heartbeat every third
of the timeout, so a worker waiting for its next call never times out, and a
worker whose driver died or hung leaves within one timeout.
"""
from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gateeng.config import EngineConfig, kv_blocks
from gateeng.logs import log
from gateeng.model import shard
from gateeng.model.llama import KVCache
from gateeng.model.loader import DTYPES
from gateeng.plans import factory, sharded
from gateeng.step import Kind

HOST = "127.0.0.1"
STARTUP_SECONDS = 300   # for every worker to import, build its plans and report (a cold start compiles)
PING, STOP = "ping", "stop"


class TensorParallelFailure(RuntimeError):
    """A rank died, hung past the group's timeout, or a collective failed."""


def refusal(cfg: EngineConfig) -> Optional[str]:
    """Why this engine configuration cannot run tensor-parallel, before any model
    is read (the model's shape is checked by model.shard.layout)."""
    if cfg.tensor_parallel_size == 1:
        return None
    if cfg.device != "cpu":
        return ("tensor parallelism runs on CPU (gloo) only: on CUDA the reference has no row-parallel "
                "kernels yet, and VERIFIED would not keep its bits")
    if cfg.dtype != "bfloat16":
        return ("tensor parallelism needs a bf16 model: only the reference (gateeng-ref-1) keeps VERIFIED "
                "bits equal at every size")
    if cfg.fast_logit_noise:
        return "the test-only fast-path logit noise is not supported with tensor parallelism"
    return None


def threads_per_rank(cfg: EngineConfig) -> int:
    """--threads where given, else the cores this process may run on shared out over
    the ranks (not torch's current setting, which an earlier engine may have changed)."""
    return cfg.num_threads or max(1, len(os.sched_getaffinity(0)) // cfg.tensor_parallel_size)


class Group:
    """The driver's side of the group: starts the workers, announces calls
    (`command`), sends heartbeats, watches the workers, and closes the group."""

    def __init__(self, cfg: EngineConfig, model, timeout: float):
        self.size = cfg.tensor_parallel_size
        self.timeout = timeout
        self.on_death: list = []   # callables(exc), called on the watcher thread when a worker dies
        self.failure: Optional[BaseException] = None
        self._lock = threading.Lock()   # one announced call, with its collectives, at a time
        self._last = time.monotonic()
        self._closing = threading.Event()
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore(HOST, 0, self.size, True, timedelta(seconds=STARTUP_SECONDS),
                                    wait_for_workers=False)
        threads = threads_per_rank(cfg)
        self.workers = []
        for rank in range(1, self.size):
            lay = shard.layout(model.cfg, self.size, rank)
            tensors = shard.shard_tensors(model, lay)
            p = ctx.Process(target=_worker_main, name=f"gateeng-tp{rank}", daemon=True,
                            args=(rank, self._store.port, timeout, cfg, model.cfg, lay, tensors, threads))
            p.start()
            self.workers.append(p)
            del tensors
        self._await_workers()
        dist.init_process_group("gloo", store=self._store, rank=0, world_size=self.size,
                                timeout=timedelta(seconds=timeout))
        threading.Thread(target=self._watch, name="gateeng-tp-watch", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="gateeng-tp-heartbeat", daemon=True).start()

    def _await_workers(self) -> None:
        keys = [f"up/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self._store.check(keys):
            dead = [p for p in self.workers if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                self._kill()
                why = (f"{dead[0].name} exited with code {dead[0].exitcode} during start-up" if dead else
                       f"the workers did not start within {STARTUP_SECONDS} s")
                raise TensorParallelFailure(f"tensor-parallel start-up failed: {why}")
            time.sleep(0.05)

    @contextlib.contextmanager
    def command(self, message):
        """Announce `message` to every worker and hold the group while the caller
        runs the collectives that go with it."""
        with self._lock:
            if self.failure is not None:
                raise TensorParallelFailure(f"the tensor-parallel group has failed: {self.failure}")
            try:
                dist.broadcast_object_list([message], src=0)
                yield
            except RuntimeError as exc:   # gloo's errors: a closed peer, a timeout
                self.failure = self.failure or exc
                raise TensorParallelFailure(f"a tensor-parallel collective failed ({self._states()}): {exc}") from exc
            finally:
                self._last = time.monotonic()

    def _states(self) -> str:
        for p in self.workers:   # a rank that just died is reaped, so that its exit code shows
            p.join(timeout=0.5)
        return ", ".join(f"{p.name} {'alive' if p.exitcode is None else f'exited {p.exitcode}'}"
                         for p in self.workers)

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: p for p in self.workers}
        dead = by_sentinel[multiprocessing.connection.wait(list(by_sentinel))[0]]
        if self._closing.is_set():
            return
        dead.join(timeout=1)   # reaped, so that its exit code is known
        exc = TensorParallelFailure(f"tensor-parallel worker {dead.name} (pid {dead.pid}) exited with code "
                                    f"{dead.exitcode}")
        self.failure = self.failure or exc
        log(f"{exc}: the engine fails every request")
        for callback in list(self.on_death):
            callback(exc)

    def _heartbeat(self) -> None:
        period = self.timeout / 3
        while not self._closing.wait(period / 4):
            if time.monotonic() - self._last < period or self.failure is not None:
                continue
            with contextlib.suppress(TensorParallelFailure):
                with self.command((PING,)):
                    pass

    def close(self) -> None:
        """Stop the workers (a clean stop where the group still works) and leave the group."""
        if self._closing.is_set():
            return
        if self.failure is None:
            with contextlib.suppress(TensorParallelFailure):
                with self.command((STOP,)):
                    pass
        self._closing.set()
        for p in self.workers:
            p.join(timeout=5)
        self._kill()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _kill(self) -> None:
        self._closing.set()
        for p in self.workers:
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)


def start(cfg: EngineConfig, model, timeout: float):
    """(the driver's shard model, its Plans with both plans announcing to the
    group, the Group) for `model` at cfg.tensor_parallel_size."""
    why = refusal(cfg)
    if why:
        raise ValueError(why)
    if dist.is_initialized():   # the group is torch.distributed's default one
        raise ValueError("this process already runs a tensor-parallel engine: shut it down first (one "
                         "torch.distributed group per process)")
    torch.set_num_threads(threads_per_rank(cfg))
    lay = shard.layout(model.cfg, cfg.tensor_parallel_size, 0)
    mine = shard.build_shard(model.cfg, lay, shard.shard_tensors(model, lay))
    plans = factory.build(cfg, mine, mine.cfg, DTYPES[cfg.dtype], owned=True)
    if plans.unavailable or not hasattr(plans.invariant, "linear_partial"):
        raise ValueError("tensor parallelism needs the reference (gateeng-ref-1) on this machine: "
                         + (plans.unavailable or "its kernels did not build"))
    group = Group(cfg, model, timeout)
    plans = replace(plans, fast=sharded.ShardedPlan(plans.fast, Kind.FAST, group.command),
                    invariant=sharded.ShardedPlan(plans.invariant, Kind.INVARIANT, group.command))
    attention = "split by head" if lay.attention_split else "whole on every rank (its heads do not split evenly)"
    log(f"tensor parallel: {group.size} ranks on gloo, threads per rank: {threads_per_rank(cfg)}; "
        f"attention {attention}; the MLP, o and the lm_head split")
    return mine, plans, group


def _worker_main(rank: int, port: int, timeout: float, cfg: EngineConfig, model_cfg, lay, tensors,
                 threads: int) -> None:
    """A worker rank: build the shard's plans and KV cache, join the group, then run
    every announced call until the driver says stop (or the group fails)."""
    torch.set_num_threads(threads)
    # Out of the shared memory the driver handed over (which cannot be resized), so that
    # the plain weights the plans do not need can be freed as at size 1.
    model = shard.build_shard(model_cfg, lay, {name: t.clone() for name, t in tensors.items()})
    del tensors
    dtype = DTYPES[cfg.dtype]
    built = factory.build(cfg, model, model.cfg, dtype, owned=True)
    plans = {Kind.FAST: built.fast, Kind.INVARIANT: built.invariant}
    kv = KVCache(model.cfg, kv_blocks(cfg), cfg.block_size, dtype, cfg.device)
    store = dist.TCPStore(HOST, port, cfg.tensor_parallel_size, False, timedelta(seconds=STARTUP_SECONDS))
    store.set(f"up/{rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.tensor_parallel_size,
                            timeout=timedelta(seconds=timeout))
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
        if message[0] == STOP:
            break
        if message[0] != PING:
            sharded.run(message, plans, model, kv)
    dist.destroy_process_group()
