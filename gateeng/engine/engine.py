"""Engine: the threaded client over EngineCore, and the request API the fronts,
tools and tests use (submit, generate, stream, abort, shutdown).

One thread, the engine thread, drives the core: it is the only one that touches
the scheduler. Other threads check and tokenize their requests themselves
(EngineCore.new_request), take handles (EngineCore.register), and hand the rest
to the engine thread through an inbox.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Optional, Sequence, Union

from gateeng.config import EngineConfig
from gateeng.engine import tp_weights, weights
from gateeng.engine.aio import Submitted, stream_request
from gateeng.engine.core import EngineCore, Observer
from gateeng.engine.errors import EngineDead, QueueFull, WeightUpdateUnavailable
from gateeng.engine.output_processor import RequestHandle
from gateeng.heap import trim_heap
from gateeng.logs import log
from gateeng.model.loader import LoadedModel
from gateeng.plans import packing
from gateeng.request import DeterminismParams, SamplingParams


class Engine:
    def __init__(self, config: Optional[EngineConfig] = None, loaded: Optional[LoadedModel] = None,
                 observer: Optional[Observer] = None, ranks=None):
        self.core = EngineCore(config, loaded, observer, ranks)
        self.failure: Optional[BaseException] = None   # set if the step loop died
        self.on_death: list = []   # callables(exc), called on the engine thread when it dies, before its requests fail
        self.accepting = True
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._weights_lock = threading.Lock()   # one weight update at a time
        self._weights_applied: Optional[tuple] = None   # (set once swapped in, [requests ended])
        if self.core.tp_group is not None:   # a worker's death ends the engine, even while it idles
            self.core.tp_group.on_death.append(self._fail_from_outside)

    # What the fronts and tools read of the engine: fixed at start-up, or replaced
    # (never mutated) by the engine thread.
    config = property(lambda self: self.core.config)
    loaded = property(lambda self: self.core.loaded)
    model = property(lambda self: self.core.model)
    tokenizer = property(lambda self: self.core.tokenizer)
    model_config = property(lambda self: self.core.model_config)
    max_model_len = property(lambda self: self.core.max_model_len)
    stop = property(lambda self: self.core.stop)
    selfcheck = property(lambda self: self.core.selfcheck)
    reproducibility = property(lambda self: self.core.reproducibility)
    version = property(lambda self: self.core.version)
    invariant_plan = property(lambda self: self.core.invariant_plan)
    fast_matmul = property(lambda self: self.core.fast_matmul)
    counts = property(lambda self: self.core.counts)
    weight_version = property(lambda self: self.core.weight_version)
    margin_threshold = property(lambda self: self.core.margin_threshold)
    max_window = property(lambda self: self.core.max_window)

    # ---- public API ----------------------------------------------------------
    def submit(self, prompt: Union[str, Sequence[int]], params: Optional[SamplingParams] = None,
               determinism: Optional[DeterminismParams] = None, request_id: Optional[str] = None,
               chat: bool = False, sink=None) -> RequestHandle:
        """Validate and enqueue one request. Its events go to the handle's queue, or
        to `sink(event)` (called on the engine thread, so it must not block)."""
        return self.submit_many([prompt], params, determinism, [request_id], chat, [sink])[0]

    def submit_many(self, prompts, params=None, determinism=None, request_ids=None, chat=False, sinks=None):
        """Validate and enqueue requests atomically (they join the same step)."""
        if self.failure is not None:
            raise EngineDead(f"the engine loop stopped on an error: {self.failure!r}")
        if not self.accepting:
            raise QueueFull("the engine is shutting down and accepts no new requests")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        det_list = determinism if isinstance(determinism, list) else [determinism] * len(prompts)
        ids = request_ids or [None] * len(prompts)
        reqs = [self.core.new_request(p, sp, dp, rid, chat)
                for p, sp, dp, rid in zip(prompts, params_list, det_list, ids)]
        handles = self.core.register(reqs, sinks)
        self._inbox.put(("add", reqs))
        self._ensure_thread()
        return handles

    def generate(self, prompts, params=None, determinism=None, chat: bool = False) -> list:
        """Blocking: run all prompts (batched together) and return their Completions."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict)))
        handles = self.submit_many([prompts] if single else list(prompts), params, determinism, chat=chat)
        results = [h.result() for h in handles]
        return results[0] if single else results

    async def stream(self, prompt, params=None, determinism=None, request_id=None, chat=False):
        """Async iterator of Chunk / Rollback events, ending with the Completion.
        Events reach the event loop without blocking it; cancelling the iterator
        aborts the request."""
        async for ev in stream_request(self, None, prompt, params, determinism, request_id, chat):
            if not isinstance(ev, Submitted):
                yield ev

    def abort(self, request_id: str) -> bool:
        known = self.core.knows(request_id)
        if known:
            self._inbox.put(("abort", request_id))
            self._wake.set()
        return known

    def encode(self, prompt, chat: bool = False) -> list:
        return self.core.encode(prompt, chat)

    def set_margin_threshold(self, tau: float) -> None:
        """Engine default tau for requests submitted from now on."""
        self.core.set_margin_threshold(tau)

    def set_max_window(self, window: int) -> None:
        """Engine default W for requests submitted from now on."""
        self.core.set_max_window(window)

    def set_observer(self, observer: Observer) -> None:
        self.core.set_observer(observer)

    def update_weights(self, path, weight_version: Optional[int] = None) -> weights.WeightUpdate:
        """Serve the checkpoint in directory `path` from the next step boundary on.

        On this (the calling) thread: read it as `--model` does (the tokenizer stays
        this engine's), check every tensor against the served model and build the
        new model with its packed weights aside (engine/weights.py); a failure
        raises WeightsRefused naming the tensor or file, and nothing changes. Then
        the engine thread admits no new request, lets the running ones finish on
        the old weights for up to config.weight_update_wait seconds, ends those
        still running and any preempted one that produced output (finish_reason
        abort, finish_detail "ended by a weight update"), swaps the weights in,
        drops the prefix cache and admits again. Returns once the swap is done.
        The new weights are `weight_version` (by default the next number). At
        tensor-parallel sizes > 1 every rank reads and builds its own shard aside,
        and all swap together at that boundary or none does (engine/tp_weights.py).
        WeightUpdateUnavailable: CUDA, or a GGUF served as stored (nothing changes)."""
        with self._weights_lock:
            t0 = time.perf_counter()
            return self._swap(self._prepare(path, t0), path, t0, weight_version)

    def prepare_weights(self, path, paths: Optional[list] = None) -> weights.Prepared:
        """update_weights' first half: read, check and build the checkpoint aside;
        nothing served changes. A fleet prepares on every replica before any swaps,
        so a checkpoint one replica refuses reaches none. `paths`: at tensor-parallel
        sizes > 1, each rank's own copy of `path`, rank 0's first (ranks on other
        nodes); else every rank reads `path`. What is not swapped in goes to
        discard_weights."""
        with self._weights_lock:
            return self._prepare(path, time.perf_counter(), paths)

    def discard_weights(self, prepared: Optional[weights.Prepared]) -> None:
        """Drop what prepare_weights built, on every tensor-parallel rank too."""
        if prepared is not None and self.core.tp_group is not None:
            self.core.tp_group.discard_weights()

    def swap_weights(self, prepared: weights.Prepared, weight_version: Optional[int] = None,
                     source: str = "a prepared checkpoint") -> weights.WeightUpdate:
        """update_weights' second half, for what prepare_weights built."""
        with self._weights_lock:
            return self._swap(prepared, source, time.perf_counter(), weight_version)

    def _prepare(self, path, t0: float, paths: Optional[list] = None) -> weights.Prepared:
        try:
            if self.failure is not None:
                raise EngineDead(f"the engine loop stopped on an error: {self.failure!r}")
            if not self.accepting:
                raise WeightUpdateUnavailable("the engine is shutting down")
            weights.refuse_unless_supported(self.config, packing.quantized(self.core.model))
            group = self.core.tp_group
            if group is None:
                prepared = weights.prepare(self.config, self.model_config, path)
            else:
                prepared = tp_weights.prepare(self.config, self.model_config, path, group,
                                              self.core.model.tp.layout, paths)
        except Exception as exc:   # refused (WeightsRefused, WeightUpdateUnavailable) or failed: nothing changed
            log(f"weight update from {path} refused: {exc}")
            self.core.observer.on_weight_update(False, time.perf_counter() - t0, self.weight_version)
            raise
        return prepared

    def _swap(self, prepared: weights.Prepared, path, t0: float, weight_version: Optional[int]):
        built = time.perf_counter()
        done, ended = threading.Event(), []
        self._weights_applied = (done, ended)
        self._inbox.put(("weights", (prepared, weight_version)))
        self._ensure_thread()
        while not done.wait(0.05):
            if self.failure is not None or self._stopping:
                raise EngineDead("the engine stopped before the new weights were swapped in")
        seconds = time.perf_counter() - t0
        result = weights.WeightUpdate(self.loaded.fingerprint, self.weight_version, seconds, ended[0])
        log(f"weights from {path} in place: version {result.weight_version}, fingerprint "
            f"{result.model_fingerprint[:16]}, {seconds:.2f} s (read and checked {prepared.read_seconds:.2f} s, "
            f"built, packed and fingerprinted {prepared.build_seconds:.2f} s, to the step boundary "
            f"{seconds - (built - t0):.2f} s); {result.requests_ended} requests ended")
        del prepared
        trim_heap()   # the old weights' memory goes back to the OS
        self.core.observer.on_weight_update(True, seconds, result.weight_version)
        return result

    @property
    def num_in_flight(self) -> int:
        return self.core.num_in_flight

    def shutdown(self, drain_seconds: float = 0.0) -> None:
        """Stop admitting; let in-flight requests finish for up to drain_seconds; stop."""
        self.accepting = False
        deadline = time.monotonic() + drain_seconds
        while self.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        for rid in self.core.in_flight():
            self.abort(rid)
        deadline = time.monotonic() + 5
        while self.num_in_flight and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(0.02)
        self._stopping = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=5)
        self.core.close()

    # ---- the engine thread ---------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._loop, name="gateeng-engine", daemon=True)
                    self._thread.start()
        self._wake.set()

    def _fail_from_outside(self, exc: BaseException) -> None:
        """Something the engine depends on failed outside its thread (a tensor-parallel
        worker died): the engine thread ends as if its step had raised `exc`."""
        self._inbox.put(("fail", exc))
        self._ensure_thread()

    def _loop(self) -> None:
        core = self.core
        stepped = False   # since the last idle call
        while not self._stopping:
            try:
                self._drain_inbox()
                if core.weight_update_due():   # a step boundary
                    done, ended = self._weights_applied
                    ended.append(core.apply_weight_update())
                    done.set()
                if core.has_work():
                    core.step()
                    stepped = True
                    continue
            except Exception as exc:   # a bug must not hang every caller
                self.failure = exc
                self.accepting = False
                # on_death runs before the requests are failed: a fleet replica exits
                # there, so its front sees the replica die and re-runs them, where a
                # request failed first could reach the client as the engine's error.
                for callback in list(self.on_death):
                    callback(exc)
                core.fail_all(exc)
                raise
            core.idle(after_work=stepped)
            stepped = False
            self._wake.wait(timeout=0.5)
            self._wake.clear()

    def _drain_inbox(self) -> None:
        drained = False
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if op == "add":
                for r in arg:
                    self.core.schedule(r)
            elif op == "abort":
                self.core.abort(arg)
            elif op == "weights":
                self.core.begin_weight_update(*arg)
            elif op == "fail":
                raise arg
            drained = True
        if drained:
            self.core.publish_counts()
