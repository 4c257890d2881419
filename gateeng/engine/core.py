"""EngineCore: the synchronous engine. `add_request`, `abort` and `step` are its
whole working surface; one thread at a time drives it (the threaded Engine in
engine.py, or a bench stepping it by hand). `new_request` and `register` may be
called from any thread: they read only what is fixed at start-up and the handle
table, which a lock guards.

Wiring: the served parts, assembled in one place (engine/assembly.py: the model,
its KV cache, both plans in the runner, the self-check, the route's prices and the
Reproducibility record; a weight swap assembles them again), the scheduler over
their blocks and route policy, the verification stage and the output processor. The step reads as the data flow: schedule -> run both
plans -> gate, verify, commit / rollback -> scheduler update -> measure, record
-> emit.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import secrets
import threading
import time
from typing import Optional, Sequence, Union

import torch

from gateeng import __version__, cpus
from gateeng.config import INVARIANT, EngineConfig, kv_blocks, validate_threshold, validate_window
from gateeng.engine import assembly, weights
from gateeng.engine.detokenizer import IncrementalText
from gateeng.engine.errors import DeterminismUnavailable, QueueFull
from gateeng.engine.output_processor import OutputProcessor, RequestHandle
from gateeng.engine.records import Counts, PrefixLookup, RequestTimes, SeqRecord, StepRecord
from gateeng.engine.scheduler import Scheduler
from gateeng.engine.stopping import StopChecker
from gateeng.engine.verification import VerificationStage, discard_speculation
from gateeng.heap import trim_heap
from gateeng.logs import log
from gateeng.model.chat import encode_prompt
from gateeng.model import shard_read
from gateeng.model.loader import LoadedModel, load
from gateeng.outputs import Completion
from gateeng.plans import packing
from gateeng.request import DeterminismParams, DeterminismStats, Mode, Request, SamplingParams
from gateeng.step import PlanKind, ScheduledSeq, StepPlan


def resolve_max_model_len(cfg: EngineConfig, mc) -> int:
    """The context length: --max-model-len, checked against the model's limit and
    the KV cache, or (0) the largest both allow. Capping at a sliding window keeps
    full attention exact for such models (every key stays inside the window)."""
    limit = mc.max_position if mc.sliding_window is None else min(mc.max_position, mc.sliding_window)
    why = "max_position_embeddings" if limit == mc.max_position else "its sliding window"
    blocks = kv_blocks(cfg)
    kv_tokens = blocks * cfg.block_size
    if not cfg.max_model_len:
        return min(limit, kv_tokens)
    if cfg.max_model_len > limit:
        raise ValueError(f"--max-model-len {cfg.max_model_len} is above the model's limit {limit} ({why})")
    if cfg.max_model_len > kv_tokens:
        raise ValueError(f"--max-model-len {cfg.max_model_len} does not fit the KV cache ({blocks} "
                         f"blocks of {cfg.block_size} = {kv_tokens} positions): raise --kv-blocks or lower it")
    return cfg.max_model_len


class Observer:
    """Hooks for metrics, called on the driving thread with plain records and values
    (never live engine state). The default does nothing."""

    def on_step(self, record: StepRecord) -> None: ...
    def on_counts(self, counts: Counts) -> None: ...
    def on_gate_config(self, margin_threshold: float, max_window: int) -> None: ...
    def on_first_token(self, mode: Mode, seconds: float) -> None: ...
    def on_tokens(self, mode: Mode, count: int, seconds_per_token: float) -> None: ...
    def on_retraction(self, mode: Mode) -> None: ...
    # A request finished; called before its caller gets the Completion, so what the
    # caller holds is already counted.
    def on_finish(self, completion: Completion, times: RequestTimes) -> None: ...
    # A weight update applied or refused (called on the updating thread).
    def on_weight_update(self, applied: bool, seconds: float, weight_version: int) -> None: ...


class EngineCore:
    def __init__(self, config: Optional[EngineConfig] = None, loaded: Optional[LoadedModel] = None,
                 observer: Optional[Observer] = None, ranks=None):
        """`ranks`: tensor-parallel ranks 1..N-1 that read their own shards of cfg.model
        (fleet.ranks, tp_processes.start_ranks): this process then reads only its own
        too, never the whole model."""
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        # Compute threads: --threads, else what the affinity mask and the CPU quota allow
        # (gateeng.cpus), fewer between steps while neighbours hold cores (`_neighbours`);
        # at tensor-parallel sizes above 1 each rank's share (tp_processes).
        self._neighbours: Optional[cpus.Neighbours] = None
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
            log(f"{cfg.num_threads} compute threads (--threads)")
        elif cfg.device == "cpu" and cfg.tensor_parallel_size == 1:
            cpu = cpus.budget()
            torch.set_num_threads(cpu.threads)
            log(f"compute threads: {cpu.describe()}"
                + ("; fewer while neighbours hold cores" if cpu.threads > 1 else ""))
            self._neighbours = cpus.Neighbours(cpu.threads)
        if ranks is not None:
            self.loaded = loaded = shard_read.unloaded(cfg.model, cfg.dequantize)
        self.loaded = loaded or load(cfg.model, cfg.dtype, cfg.device, dequantize=cfg.dequantize)
        if ranks is None and packing.quantized(self.loaded.model) and cfg.device != "cpu":
            raise ValueError("quantized weights are served on CPU: load the model with dequantize=True "
                             "(--dequantize)")
        self.tokenizer = self.loaded.tokenizer
        mc = self.model_config = self.loaded.config
        self.max_model_len = resolve_max_model_len(cfg, mc)
        eos = set(mc.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.stop = StopChecker(eos, self.max_model_len, text_of=self._text_of)
        served = assembly.assemble(cfg, self.loaded, self.max_model_len, owned=loaded is None, ranks=ranks)
        self.tp_group = served.tp_group   # the tensor-parallel group (engine.tp_processes), at sizes > 1
        self.blocks, self.route = served.blocks, served.route
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.route,
                                   cfg.max_verify_delay, cfg.prefill_chunk)
        self.verification = VerificationStage(self.stop, cfg.router_margin_threshold)
        self.margin_threshold = cfg.margin_threshold
        self.max_window = cfg.max_window
        self.version = __version__
        self.weight_version = 0   # +1 per applied weight update (apply_weight_update)
        self._weight_update: Optional[weights.Prepared] = None   # built aside, waiting for its step boundary
        self._weight_deadline = 0.0
        self._weight_next = 0
        self.observer = observer or Observer()
        self.outputs = OutputProcessor(self.observer, served.reproducibility)
        self._serve(served)
        self.counts = Counts()   # replaced (never mutated) by the driving thread
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        # OpenMP keeps a worker pool per thread that ran parallel work; two pools
        # together outnumber the cores, and then every parallel region waits for its
        # workers to wake (cpu_ops.cpp). So the thread that built the engine lets its
        # pool go now, and the driving thread its own when idle (`idle`).
        self.release_threads()
        trim_heap()   # what loading and packing freed goes back to the OS

    def _serve(self, served: assembly.Served) -> None:
        """Serve from `served` (engine.assembly) from the next step on; what the
        requests' checks, the step and the fronts read of it, as plain attributes."""
        self.served = served
        self.loaded, self.model, self.kv, self.runner = served.loaded, served.model, served.kv, served.runner
        plans = served.plans
        self.invariant_plan, self.fast_matmul = plans.invariant, plans.fast_matmul
        self.verified_unavailable, self.release_threads = plans.unavailable, plans.release_threads
        self.selfcheck = served.selfcheck
        self.reproducibility = self.outputs.reproducibility = served.reproducibility

    # ---- requests (any thread) ---------------------------------------------------
    def new_request(self, prompt: Union[str, Sequence[int]], params: Optional[SamplingParams] = None,
                    determinism: Optional[DeterminismParams] = None, request_id: Optional[str] = None,
                    chat: bool = False) -> Request:
        """Check and tokenize one request. Raises ValueError for bad input and
        DeterminismUnavailable for VERIFIED where the self-check failed."""
        params, det = params or SamplingParams(), determinism or DeterminismParams()
        params.validate()
        det.validate()
        ids = self.encode(prompt, chat)
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt is empty: send at least one token or a non-empty text")
        bad = [t for t in ids if not (0 <= int(t) < vocab)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the context holds {self.max_model_len}: "
                             f"shorten the prompt")
        # resolve_max_model_len keeps the context within the KV cache, so every admitted
        # request fits it (Scheduler.fits) and is never dropped for lack of blocks.
        mode = Mode.REFERENCE if self.config.plan == INVARIANT else det.mode
        if mode is Mode.VERIFIED and self.verified_unavailable:
            raise DeterminismUnavailable("VERIFIED is unavailable on this machine: " + self.verified_unavailable)
        if mode is Mode.VERIFIED and not self.selfcheck.passed:
            raise DeterminismUnavailable("VERIFIED is unavailable on this machine: " + self.selfcheck.describe())
        window = det.max_window or self.max_window
        if window + 1 > self.config.max_num_batched_tokens:
            raise ValueError(f"max_window {window} must be below the step token budget "
                             f"{self.config.max_num_batched_tokens}")
        det = DeterminismParams(mode, det.margin_threshold, det.max_window, det.stream_policy)
        seed = params.seed
        if seed is None:
            seed = secrets.randbits(63) if not params.greedy else 0
        rid = request_id or f"req-{next(self._ids)}-{secrets.token_hex(4)}"
        tau = det.margin_threshold if det.margin_threshold is not None else self.margin_threshold
        return Request(rid, [int(t) for t in ids], params, det, arrival=time.monotonic(),
                       tau=tau, window=window, seed=seed)

    def register(self, requests: list, sinks: Optional[list] = None) -> list:
        """A handle per request, all or none: QueueFull past the queue bound,
        ValueError for a request id already in flight. Events go to the handle's
        queue, or to its sink (called on the driving thread, so it must not block)."""
        with self._lock:
            if len(self._handles) + len(requests) > self.config.max_queue + self.config.max_num_seqs:
                raise QueueFull(f"{len(self._handles)} requests in flight; the queue holds at most "
                                f"{self.config.max_queue} waiting: retry later")
            for r in requests:
                if r.request_id in self._handles:
                    raise ValueError(f"request_id {r.request_id!r} is already in flight")
            handles = []
            for r, sink in zip(requests, sinks or [None] * len(requests)):
                h = self._handles[r.request_id] = RequestHandle(r.request_id, IncrementalText(self._decode),
                                                                sink=sink, last_emit=r.arrival)
                handles.append(h)
        return handles

    def knows(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._handles

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    def in_flight(self) -> list:
        with self._lock:
            return list(self._handles)

    def encode(self, prompt, chat: bool = False) -> list:
        return encode_prompt(self.tokenizer, prompt, chat)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text_of(self, request_id: str):
        """The stop checker's view of a request's output text (its handle's)."""
        h = self._handles.get(request_id)
        return h.text if h is not None else None

    # ---- the driving thread ---------------------------------------------------------
    def add_request(self, request: Request, sink=None) -> RequestHandle:
        """Register and schedule one request (new_request makes it)."""
        handle = self.register([request], [sink])[0]
        self.schedule(request)
        return handle

    def schedule(self, request: Request) -> None:
        """Queue a registered request for the next steps."""
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        """Finish the request now (ABORT), freeing its KV blocks; its handle gets the
        Completion."""
        self.scheduler.abort(request_id)
        self._collect_finished()

    def publish_counts(self) -> None:
        """Tell the observer the queue and KV state now (after adds and aborts)."""
        self.counts = self._counts()
        self.observer.on_counts(self.counts)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def prefilled(self) -> bool:
        """Every request is admitted and past its prompt: the next steps are decodes."""
        sch = self.scheduler
        return not sch.waiting and all(r.num_computed >= r.num_prompt for r in sch.running)

    def idle(self, after_work: bool = False) -> None:
        """Between steps with nothing to do: check the KV accounting, let threads go,
        and, on the first idle call `after_work`, hand what the busy spell freed back
        to the OS."""
        self.blocks.check_integrity()
        self.release_threads()
        if after_work:
            trim_heap()

    def step(self) -> None:
        """One engine step: the data flow of the README's "How it works", in order."""
        self._fit_threads()
        plan = self.scheduler.schedule()                  # fast rows + invariant rows (prefill, replays, direct)
        outputs = self.runner.run(plan)                   # run both plans, sample, margins
        outcomes = self.verification.apply(plan, outputs)     # gate, verify compare, commit / rollback
        self.scheduler.update(outcomes)                   # KV blocks, finishes
        mismatches, counted = self.verification.drain()
        self._measure(plan, counted)                      # the route policy's cost model
        self.observer.on_step(self._record(plan, outputs, mismatches, counted))   # a record for metrics
        self._emit(plan)                                  # stream what the policy allows

    def _fit_threads(self) -> None:
        """The compute threads for this step (gateeng.cpus.Neighbours). torch's thread
        count is per calling thread under OpenMP, so the driving thread sets its own."""
        if self._neighbours is None:
            return
        n = self._neighbours.threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
            log(f"compute threads: {n} of {self._neighbours.budget} "
                f"({'neighbours hold cores' if n < self._neighbours.budget else 'the cores are free again'})")

    def fail_all(self, exc: BaseException) -> None:
        """Every request in flight ends with `exc` (the step loop died)."""
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for h in handles:
            h.failure = exc
            h.put(exc)
            h.done.set()

    def close(self) -> None:
        """Release what outlives a step: the tensor-parallel workers (a no-op at size 1)."""
        if self.tp_group is not None:
            self.tp_group.close()

    # ---- weights in place (the driving thread; weights.prepare built them aside) -----
    def begin_weight_update(self, prepared: weights.Prepared, weight_version: Optional[int] = None) -> None:
        """Hold admission: the running requests finish on the weights they started
        on, for up to config.weight_update_wait seconds (weight_update_due). The
        swap serves `weight_version` (a fleet's number, so every replica names the
        same weights alike), by default the next one."""
        self._weight_update = prepared
        self._weight_next = self.weight_version + 1 if weight_version is None else weight_version
        self._weight_deadline = time.monotonic() + self.config.weight_update_wait
        self.scheduler.admitting = False

    def weight_update_due(self) -> bool:
        """A pending update may be applied now: nothing runs, or the wait is over."""
        return self._weight_update is not None and (not self.scheduler.running
                                                    or time.monotonic() >= self._weight_deadline)

    def apply_weight_update(self) -> int:
        """Between two steps: end every request whose answer holds anything the old
        weights computed (those still running, and preempted ones with output or
        prompt logprobs; one preempted before either starts over), then swap the
        model and its plans in, drop the prefix cache (the KV cache's shapes stay)
        and admit again. No answer mixes two weight versions: those ended keep
        their old Reproducibility record, every later one gets the new
        fingerprint. Returns the number of requests ended."""
        prepared, self._weight_update = self._weight_update, None
        sch = self.scheduler
        ended = list(sch.running) + [r for r in sch.waiting if r.output_ids or r.prompt_logprobs]
        for req in ended:
            discard_speculation(req)   # a VERIFIED answer ends on its verified tokens
            req.finish_detail = weights.ENDED
            sch.abort(req.request_id)
        self._collect_finished()
        self.blocks.drop_prefix_cache()
        if self.tp_group is not None:   # every rank swaps in the shard it built (engine.tp_weights)
            self.tp_group.commit_weights()
        # The same shapes, dtype and kernels as before: the KV cache, the self-check
        # (which ran on the weights' shapes), the route's prices and the group rows hold.
        self._serve(assembly.assemble(self.config, dataclasses.replace(self.loaded, model=prepared.model,
                                                                      fingerprint=prepared.fingerprint),
                                      self.max_model_len, model=prepared.model, plans=prepared.plans,
                                      before=self.served))
        self.weight_version = self._weight_next
        self.reproducibility = self.outputs.reproducibility = dataclasses.replace(
            self.reproducibility, weight_version=self.weight_version)
        sch.admitting = True
        self.publish_counts()
        return len(ended)

    # ---- settings -----------------------------------------------------------------
    def set_margin_threshold(self, tau: float) -> None:
        """Engine default tau for requests submitted from now on."""
        self.margin_threshold = validate_threshold(tau)
        self.observer.on_gate_config(self.margin_threshold, self.max_window)

    def set_max_window(self, window: int) -> None:
        """Engine default W for requests submitted from now on."""
        self.max_window = validate_window(window)
        self.observer.on_gate_config(self.margin_threshold, self.max_window)

    def set_observer(self, observer: Observer) -> None:
        self.observer = self.outputs.observer = observer
        observer.on_gate_config(self.margin_threshold, self.max_window)
        observer.on_counts(self.counts)

    @property
    def fast_plan(self):
        return self.served.plans.fast

    def replace_fast_plan(self, plan) -> None:
        """Run another fast plan from the next step on (benches and tests that
        measure one; the invariant plan, and so the reference, stay)."""
        self._serve(assembly.assemble(self.config, self.loaded, self.max_model_len, model=self.model,
                                      plans=dataclasses.replace(self.served.plans, fast=plan), before=self.served))

    def teacher_forced(self, prompts: Sequence[Sequence[int]], forced: Sequence[Sequence[int]],
                       kind: PlanKind = PlanKind.FAST) -> list:
        """Greedy choices of plan `kind` along given tokens, as the runner runs a step:
        each prompt is prefilled on the invariant plan (as a VERIFIED request's is),
        then forced[i] is fed to sequence i one decode step at a time, every sequence
        in the same pass. Returns per step (tokens, margins, router margins: a mixture
        of experts' smallest router margin, else inf), one entry per sequence:
        step t's predict the token after forced[i][t]. The forced lists have one
        length. The sequences are throwaway: their KV blocks come from the free list
        and go back unregistered, so the KV accounting is as before (a cached prefix
        whose blocks they took is dropped from the prefix cache). Call it between
        steps, on the driving thread."""
        if len(prompts) != len(forced) or len({len(f) for f in forced}) > 1:
            raise ValueError("teacher_forced takes one forced token list per prompt, all of one length")
        reqs, borrowed, steps = [], [], []
        try:
            for i, (prompt, tokens) in enumerate(zip(prompts, forced)):
                req = Request(f"forced-{i}", [int(t) for t in prompt], SamplingParams(), DeterminismParams())
                for _ in range(self.blocks.blocks_needed(len(prompt) + len(tokens))):
                    borrowed.append(self.blocks.allocate())
                    req.block_table.append(borrowed[-1])
                reqs.append(req)
            self.runner.run(StepPlan([ScheduledSeq.plan(r, 0, len(r.tokens), PlanKind.INVARIANT) for r in reqs]))
            for t in range(len(forced[0]) if forced else 0):
                for req, tokens in zip(reqs, forced):
                    req.tokens.append(int(tokens[t]))
                out = self.runner.run(StepPlan([ScheduledSeq.plan(r, len(r.tokens) - 1, len(r.tokens), kind)
                                                for r in reqs]))
                steps.append(([out[r.request_id].tokens[0] for r in reqs],
                              [out[r.request_id].margins[0] for r in reqs],
                              [(out[r.request_id].router_margins or (math.inf,))[0] for r in reqs]))
            return steps
        finally:
            for block in borrowed:
                self.blocks.release(block)

    # ---- step parts ------------------------------------------------------------------
    def _measure(self, plan: StepPlan, counted: DeterminismStats) -> None:
        """Feed the route policy the decode-phase pass costs it compares. Passes with a
        prefill chunk are left out: their attention grows with the chunk, not the rows."""
        for kind, seconds in self.runner.last_seconds.items():
            seqs = plan.of_kind(kind)
            if all(s.replay or s.num_tokens == 1 for s in seqs):
                self.route.observe_pass(kind.value, sum(s.num_tokens for s in seqs), seconds)
        self.route.observe_speculation(counted.decode_steps, counted.triggers)

    def _record(self, plan: StepPlan, outputs: dict, mismatches: tuple,
                counted: DeterminismStats) -> StepRecord:
        seqs = []
        for seq in plan.seqs:
            req = seq.request
            out = outputs.get(req.request_id)
            margin = out.margins[-1] if out is not None and out.margins and seq.sample_rows else None
            seqs.append(SeqRecord(req.request_id, req.mode, seq.kind.value, seq.replay, seq.decode, margin,
                                  seq.route))
        sch = self.scheduler
        lookups = tuple(PrefixLookup(r.mode, r.num_prompt, r.num_cached_tokens) for r in sch.take_admitted()
                        if sch.looks_up(r))
        self.counts = self._counts()
        return StepRecord(tuple(seqs), counted, mismatches,
                          {k.value: v for k, v in self.runner.last_seconds.items()}, self.counts, lookups)

    def _counts(self) -> Counts:
        sch = self.scheduler
        return Counts(len(sch.running), len(sch.waiting), self.blocks.usage, sch.num_preemptions)

    def _emit(self, plan: StepPlan) -> None:
        for seq in plan.seqs:
            req = seq.request
            h = self._handles.get(req.request_id)
            if h is not None and not req.finished:
                self.outputs.emit(req, h)
        self._collect_finished()

    def _collect_finished(self) -> None:
        for req in self.scheduler.finished:
            self._finish(req)
        self.scheduler.finished.clear()

    def _finish(self, req: Request) -> None:
        with self._lock:
            h = self._handles.pop(req.request_id, None)
        if h is None:
            return
        c = h.completion = self.outputs.finish(req, h)
        self.observer.on_finish(c, RequestTimes.between(req.arrival, req.first_scheduled_time,
                                                        req.first_token_time, time.monotonic()))
        h.put(c)
        h.done.set()
