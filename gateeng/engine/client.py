"""The engine: one step loop that runs schedule -> fast plan -> gate -> verify ->
commit/rollback -> emit, and the request API around it (submit, generate, stream,
abort). The step loop runs on one thread, which is the only one that touches the
scheduler; other threads talk to it through an inbox.
"""
from __future__ import annotations

import itertools
import queue
import secrets
import threading
import time
from typing import Optional, Sequence, Union

import torch

from gateeng import __version__, reproducibility
from gateeng.plans import cpu_linear
from gateeng.plans import cpu_ops
from gateeng.engine import pricing
from gateeng.model import chat as chat_template
from gateeng.engine.block_manager import BlockManager
from gateeng.config import EngineConfig, validate_threshold, validate_window
from gateeng.model.loader import DTYPES, LoadedModel, load, log
from gateeng.plans.sampler import sample as sample_rows
from gateeng.model.llama import KVCache
from gateeng.engine.detokenizer import IncrementalText
from gateeng.engine.output_processor import OutputProcessor, RequestHandle
from gateeng.outputs import Completion
from gateeng.plans.cpu import FastPlan, InvariantPlan, default_invariant_rows
from gateeng.engine.records import Counts, SeqRecord, StepRecord
from gateeng.request import DeterminismParams, DeterminismStats, Mode, Request, SamplingParams
from gateeng.engine.route import RoutePolicy
from gateeng.plans.runner import ModelRunner
from gateeng.engine.scheduler import Scheduler, StepPlan
from gateeng.engine.verification import VerificationStage
from gateeng.plans.selfcheck import run_selfcheck
from gateeng.engine.stopping import StopChecker


# One tokenization at a time: a fast tokenizer's encode with split_special_tokens
# switches a flag on the shared Rust tokenizer for the call, so encodes running in
# parallel threads (the servers submit from a thread pool) turned other prompts'
# control tokens into text, about one prompt in eight under concurrency 8.
_ENCODE_LOCK = threading.Lock()


def encode_prompt(tokenizer, prompt, chat: bool = False) -> list:
    """Token ids for a text (through the chat template as one user message when
    `chat`), a list of chat messages ({"role", "content"} dicts), or an id list.
    Safe to call from several threads."""
    with _ENCODE_LOCK:
        return _encode(tokenizer, prompt, chat)


def _encode(tokenizer, prompt, chat: bool) -> list:
    if isinstance(prompt, str):
        if not prompt:
            return []
        if chat:
            return chat_template.render(tokenizer, [{"role": "user", "content": prompt}])
        return tokenizer.encode(prompt, add_special_tokens=False)
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        return chat_template.render(tokenizer, prompt)
    return prompt


def resolve_max_model_len(cfg: EngineConfig, mc) -> int:
    """The context length: --max-model-len, checked against the model's limit and
    the KV cache, or (0) the largest both allow. Capping at a sliding window keeps
    full attention exact for such models (every key stays inside the window)."""
    limit = mc.max_position if mc.sliding_window is None else min(mc.max_position, mc.sliding_window)
    why = "max_position_embeddings" if limit == mc.max_position else "its sliding window"
    kv_tokens = cfg.num_kv_blocks * cfg.block_size
    if not cfg.max_model_len:
        return min(limit, kv_tokens)
    if cfg.max_model_len > limit:
        raise ValueError(f"--max-model-len {cfg.max_model_len} is above the model's limit {limit} ({why})")
    if cfg.max_model_len > kv_tokens:
        raise ValueError(f"--max-model-len {cfg.max_model_len} does not fit the KV cache ({cfg.num_kv_blocks} "
                         f"blocks of {cfg.block_size} = {kv_tokens} positions): raise --kv-blocks or lower it")
    return cfg.max_model_len


class QueueFull(RuntimeError):
    """Too many requests waiting; the caller should back off and retry."""


class EngineDead(RuntimeError):
    """The step loop stopped on an error; the engine serves nothing more."""


class DeterminismUnavailable(RuntimeError):
    """VERIFIED was asked for but the invariant plan failed its self-check here."""


class Observer:
    """Hooks for metrics, called on the engine thread with plain records and values
    (never live engine state). The default does nothing."""

    def on_step(self, record: StepRecord) -> None: ...
    def on_counts(self, counts: Counts) -> None: ...
    def on_gate_config(self, margin_threshold: float, max_window: int) -> None: ...
    def on_first_token(self, mode: Mode, seconds: float) -> None: ...
    def on_tokens(self, mode: Mode, count: int, seconds_per_token: float) -> None: ...
    def on_retraction(self, mode: Mode) -> None: ...
    def on_finish(self, completion: Completion, seconds: float) -> None: ...


class Engine:
    def __init__(self, config: Optional[EngineConfig] = None, loaded: Optional[LoadedModel] = None,
                 observer: Optional[Observer] = None):
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.loaded = loaded or load(cfg.model, cfg.dtype, cfg.device)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        mc = self.model_config = self.loaded.config
        self.max_model_len = resolve_max_model_len(cfg, mc)
        self.kv = KVCache(mc, cfg.num_kv_blocks, cfg.block_size, DTYPES[cfg.dtype], cfg.device)
        self.blocks = BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        eos = set(mc.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.stop = StopChecker(eos, self.max_model_len)
        kernels = cpu_ops.load() if cfg.cpu_kernels and cfg.device == "cpu" else None
        if cfg.pack_fast_weights and cfg.device == "cpu":
            self.model.pack_weights(kernels)
        fast, self.invariant_plan, sample = self._plans(cfg, mc, kernels)
        self.fast_matmul = self._fast_matmul(cfg) if cfg.device == "cpu" else "torch matmuls (cuBLAS)"
        if cfg.device == "cpu":
            log(f"fast plan: {self.fast_matmul}, {'C++ kernels' if kernels is not None else 'torch ops'} "
                f"for norms, RoPE, SiLU and attention; invariant plan {self.invariant_plan.describe(cfg.dtype)}")
        self.route = RoutePolicy(cfg.verified_route, group_rows=self.invariant_plan.group_rows,
                                 replay_delay=cfg.max_verify_delay)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.route,
                                   cfg.max_verify_delay, cfg.prefill_chunk)
        self.verification = VerificationStage(self.stop)
        self.runner = ModelRunner(self.model, self.kv, fast, self.invariant_plan, sample)
        self.selfcheck = run_selfcheck(self.invariant_plan, mc.hidden_size, mc.num_heads, mc.num_kv_heads,
                                       mc.head_dim, DTYPES[cfg.dtype], cfg.block_size, device=cfg.device,
                                       weights=self._layer_weights())
        if cfg.plan == "fast" and cfg.verified_route == "adaptive" and self.selfcheck.passed:
            self._price_plans(cfg)
        self.margin_threshold = cfg.margin_threshold
        self.max_window = cfg.max_window
        self.version = __version__
        self.reproducibility = reproducibility.build(
            engine_version=self.version, model_fingerprint=self.loaded.fingerprint, dtype=cfg.dtype,
            device=cfg.device, kernel_plan=f"{cfg.plan}; {self.invariant_plan.describe(cfg.dtype)}",
            self_check_passed=self.selfcheck.passed, self_check=self.selfcheck.describe())
        self.observer = observer or Observer()
        self.outputs = OutputProcessor(self.observer, self.reproducibility)
        self.failure: Optional[BaseException] = None   # set if the step loop died
        self.on_death: list = []   # callables(exc), called on the engine thread when it dies
        self.counts = Counts()   # replaced (never mutated) by the engine thread
        self._handles: dict[str, RequestHandle] = {}
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.accepting = True
        # OpenMP keeps a worker pool per thread that ran parallel work; two pools
        # together outnumber the cores, and then every parallel region waits for its
        # workers to wake (cpu_ops.cpp). The steps run on the engine thread, so this
        # thread lets its pool go now, and the engine thread its own when idle.
        self._release_threads = kernels.release_idle_threads if kernels is not None else (lambda: None)
        self._release_threads()

    def _price_plans(self, cfg: EngineConfig) -> None:
        """Seed the route policy's cost models with timed decode passes of both plans
        (pricing.py says why traffic alone is not enough)."""
        context = min(pricing.CONTEXT, self.max_model_len)
        limit = min(cfg.max_num_seqs, pricing.rows_that_fit(self.blocks, context))
        rows = sorted({min(r, limit) for r in pricing.PRICE_ROWS})
        t0 = time.perf_counter()
        pricing.price_plans(self.route.observe_pass, pricing.decode_pass_timer(self.runner, self.blocks, context),
                            rows)
        log(f"route costs from decode passes at row counts {'/'.join(map(str, rows))}, {context} keys "
            f"({time.perf_counter() - t0:.1f} s): {self.route.describe()}")

    def _layer_weights(self) -> list:
        """The matrices the invariant plan multiplies by: one layer's (every layer has
        the same shapes) and the float32 lm_head used for sampled rows."""
        layer = self.model.layers[0]
        return [layer.qkv, layer.o, layer.gate_up, layer.down, self.model.lm_head_f32]

    def _fast_matmul(self, cfg: EngineConfig) -> str:
        m = self.model
        if not m.packed or not cfg.pack_fast_weights:
            return "plain weights"
        kernel = cpu_linear.ROWWISE_MATMULS.get(m.invariant_matmul)
        if kernel is None:
            return "oneDNN packed weights"
        if m.fast_rowwise_max_rows is None:
            return f"{kernel} packed weights (the faster kernel at every probed row count)"
        return f"{kernel} packed weights up to {m.fast_rowwise_max_rows} rows, another kernel above"

    def _plans(self, cfg: EngineConfig, mc, kernels):
        """(fast plan, invariant plan, sampler) for the device: torch and the C++
        kernels on CPU; flashinfer + Triton kernels on CUDA."""
        if cfg.device != "cuda":
            rows = cfg.invariant_rows or default_invariant_rows(reproducibility.cpu_model_and_isa()[1])
            m = self.model
            inv_packed, matmul = m.invariant_packed, m.invariant_matmul
            if not cfg.pack_fast_weights or (matmul in cpu_linear.ROWWISE_MATMULS and kernels is None):
                inv_packed, matmul = {}, "torch_mm"   # the row-invariant matmul is one of the kernels
            return (FastPlan(cfg.fast_logit_noise, m.packed if cfg.pack_fast_weights else {}, kernels),
                    InvariantPlan(rows, cfg.attention_split, inv_packed, kernels, cfg.block_size, matmul),
                    sample_rows)
        from gateeng.plans.gpu import FlashInferFastPlan, TritonInvariantPlan, gpu_sample
        try:
            fast = FlashInferFastPlan(mc.num_heads, mc.num_kv_heads, mc.head_dim, DTYPES[cfg.dtype], cfg.device,
                                      cfg.fast_logit_noise)
        except ImportError:
            log("flashinfer is not installed (pip install 'gateeng[cuda]'): fast path uses torch attention")
            fast = FastPlan(cfg.fast_logit_noise)
        return fast, TritonInvariantPlan(cfg.attention_split), gpu_sample

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
        reqs = [self._make_request(p, sp or SamplingParams(), dp or DeterminismParams(), rid, chat)
                for p, sp, dp, rid in zip(prompts, params_list, det_list, ids)]
        handles = []
        with self._lock:
            if len(self._handles) + len(reqs) > self.config.max_queue + self.config.max_num_seqs:
                raise QueueFull(f"{len(self._handles)} requests in flight; the queue holds at most "
                                f"{self.config.max_queue} waiting: retry later")
            for r in reqs:
                if r.request_id in self._handles:
                    raise ValueError(f"request_id {r.request_id!r} is already in flight")
            for r, sink in zip(reqs, sinks or [None] * len(reqs)):
                h = RequestHandle(r.request_id, sink=sink, last_emit=r.arrival)
                self._handles[r.request_id] = h
                handles.append(h)
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
        from gateeng.engine.aio import Submitted, stream_request   # aio builds on this module
        async for ev in stream_request(self, None, prompt, params, determinism, request_id, chat):
            if not isinstance(ev, Submitted):
                yield ev

    def abort(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._handles
        if known:
            self._inbox.put(("abort", request_id))
            self._wake.set()
        return known

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
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    def shutdown(self, drain_seconds: float = 0.0) -> None:
        """Stop admitting; let in-flight requests finish for up to drain_seconds; stop."""
        self.accepting = False
        deadline = time.monotonic() + drain_seconds
        while self.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            pending = list(self._handles)
        for rid in pending:
            self.abort(rid)
        deadline = time.monotonic() + 5
        while self.num_in_flight and time.monotonic() < deadline and self._thread and self._thread.is_alive():
            time.sleep(0.02)
        self._stopping = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=5)

    # ---- the step loop ---------------------------------------------------------
    def step(self) -> None:
        """One engine step: the data flow of the README's "How it works", in order."""
        plan = self.scheduler.schedule()                  # fast rows + invariant rows (prefill, replays, direct)
        outputs = self.runner.run(plan)                   # run both plans, sample, margins
        outcomes = self.verification.apply(plan, outputs)     # gate, verify compare, commit / rollback
        self.scheduler.update(outcomes)                   # KV blocks, finishes
        mismatches, counted = self.verification.drain()
        self._measure(plan, counted)                      # the route policy's cost model
        self.observer.on_step(self._record(plan, outputs, mismatches, counted))   # a record for metrics
        self._emit(plan)                                  # stream what the policy allows

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
        self.counts = self._counts()
        return StepRecord(tuple(seqs), counted, mismatches,
                          {k.value: v for k, v in self.runner.last_seconds.items()}, self.counts)

    def _counts(self) -> Counts:
        sch = self.scheduler
        return Counts(len(sch.running), len(sch.waiting), self.blocks.usage, sch.num_preemptions)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._loop, name="gateeng-engine", daemon=True)
                    self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if self.scheduler.has_work():
                try:
                    self.step()
                except Exception as exc:   # a bug must not hang every caller
                    self.failure = exc
                    self.accepting = False
                    self._fail_all(exc)
                    for callback in list(self.on_death):
                        callback(exc)
                    raise
            else:
                self.blocks.check_integrity()
                self._release_threads()
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
                    self.scheduler.add(r)
            elif op == "abort":
                self.scheduler.abort(arg)
            drained = True
        if drained:
            self.counts = self._counts()
            self.observer.on_counts(self.counts)
        self._collect_finished()

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
        for h in handles:
            h.put(exc)
            h.done.set()

    # ---- requests ----------------------------------------------------------------
    def _make_request(self, prompt, params: SamplingParams, det: DeterminismParams,
                      request_id: Optional[str], chat: bool) -> Request:
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
        mode = Mode.REFERENCE if self.config.plan == "invariant" else det.mode
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
                       tau=tau, window=window, seed=seed, text=IncrementalText(self._decode))

    def encode(self, prompt, chat: bool = False) -> list:
        return encode_prompt(self.tokenizer, prompt, chat)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- output ------------------------------------------------------------------
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
        h.put(c)
        h.done.set()
        self.observer.on_finish(c, time.monotonic() - req.arrival)
