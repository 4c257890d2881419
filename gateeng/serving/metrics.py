"""Prometheus metrics (prefix gateeng_), fed by the engine's Observer hooks.

Every hook receives plain records (gateeng.records) built on the engine thread;
nothing here reads the scheduler, the block manager or the runner. Verifier
counters are deltas of the per-request DeterminismStats carried in the step
records, so the exported counters and the per-request reports cannot disagree.
Labels stay low-cardinality: model_name (one per server), determinism, reason,
finish_reason.

Decode steps carry their route: a VERIFIED decode is `speculative` (the fast
plan, which the gate looks at) or `direct` (the invariant plan at once: nothing
for the gate to decide); other decodes carry the plan they ran on. The trigger
rate is over the speculative steps, so where the route sends every VERIFIED
decode direct it has no denominator: deploy/rules.yml (and the README) then
answer `{gate="all_direct"} 0` instead of NaN.

Every series carries `model_name`, the served model's name (vLLM's label), set once
the engine is loaded (attach); the recording rules keep it, so replicas of one model
add up and two models never mix. A refusal counted while the model still loads
carries an empty name, which Prometheus reads as no label.

A finished request's phases come from the engine's clock on the driving thread
(records.RequestTimes): queue (arrival to first admission), prefill (to the first
token sent) and decode (to the finish) add up to its e2e latency. The prefix-cache
counters count tokens, as vLLM's do, on each request's first admission.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from gateeng.config import DIRECT, FAST, INVARIANT, SPECULATIVE
from gateeng.engine.engine import Engine
from gateeng.engine.core import Observer
from gateeng.engine.records import Counts, RequestTimes, StepRecord
from gateeng.request import MISMATCH_FIELDS, TRIGGER_FIELDS, Mode

LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Prompt and output lengths: 1-2-5 steps up to a million tokens, past any context served.
TOKENS = tuple(m * 10 ** e for e in range(7) for m in (1, 2, 5) if m * 10 ** e <= 10 ** 6)
# Fine around the useful tau range (0.05-1: where the flips of a bf16 model sit),
# so the histogram tells an operator what a tau change would trigger.
MARGINS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
DETERMINISM = tuple(m.value for m in Mode)
# The (determinism, route) pairs a decode step can have: VERIFIED by route, the
# others by the plan they ran on (an OFF request may fill a spare invariant row).
DECODE_ROUTES = ((Mode.OFF.value, FAST), (Mode.OFF.value, INVARIANT), (Mode.REFERENCE.value, INVARIANT),
                 (Mode.VERIFIED.value, SPECULATIVE), (Mode.VERIFIED.value, DIRECT))
# DeterminismStats field -> (counter attribute, label values)
COUNTED = {
    "decode_steps": ("decode_steps", (Mode.VERIFIED.value, SPECULATIVE)),
    "direct_steps": ("decode_steps", (Mode.VERIFIED.value, DIRECT)),
    **{field: ("triggers", (r.value,)) for r, field in TRIGGER_FIELDS.items()},
    **{field: ("mismatches", (r.value,)) for r, field in MISMATCH_FIELDS.items()},
    "verify_passes": ("passes", ()),
    "replayed_tokens": ("replayed", ()),
    "rolled_back_tokens": ("rolled_back", ()),
}


class Metrics(Observer):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        ProcessCollector(registry=r)
        self.model_name = ""   # attach sets it, before any engine hook can run
        m = ("model_name",)
        self.decode_steps = Counter("gateeng_decode_steps", "Decode steps (one sampled token each) by route: "
                                    "VERIFIED ones speculative (fast plan, the gate looks at them) or direct "
                                    "(invariant plan, no gate needed); others the plan they ran on",
                                    [*m, "determinism", "route"], registry=r)
        self.triggers = Counter("gateeng_verifier_triggers", "Verifier triggers by reason", [*m, "reason"],
                                registry=r)
        self.passes = Counter("gateeng_verifier_passes", "Verify replays run", m, registry=r)
        self.replayed = Counter("gateeng_verifier_replayed_tokens", "Positions replayed on the invariant plan",
                                m, registry=r)
        self.mismatches = Counter("gateeng_verifier_mismatches",
                                  "Replays that found a wrong speculated token, by the trigger that caught it "
                                  "(window, finish or direct: the margin test missed a flip)", [*m, "reason"],
                                  registry=r)
        self.rolled_back = Counter("gateeng_rolled_back_tokens", "Speculated tokens dropped by rollbacks",
                                   m, registry=r)
        self.retractions = Counter("gateeng_stream_retractions", "Rollback events sent to EAGER streams",
                                   m, registry=r)
        self.margin = Histogram("gateeng_margin", "Top-1 minus top-2 score of VERIFIED fast-path tokens",
                                m, buckets=MARGINS, registry=r)
        self.mismatch_margin = Histogram("gateeng_mismatch_margin",
                                         "Fast-path margin of the first wrong token of each mismatch",
                                         m, buckets=MARGINS, registry=r)
        self.pass_seconds = Histogram("gateeng_verifier_pass_duration_seconds",
                                      "Wall time of invariant-plan passes that included a verify replay",
                                      m, buckets=LAT, registry=r)
        self.threshold = Gauge("gateeng_margin_threshold", "Engine default margin threshold (tau)", m, registry=r)
        self.window = Gauge("gateeng_max_window", "Engine default max window (W)", m, registry=r)
        self.running = Gauge("gateeng_requests_running", "Requests in the running batch", m, registry=r)
        self.waiting = Gauge("gateeng_requests_waiting", "Requests waiting for admission", m, registry=r)
        self.queue_capacity = Gauge("gateeng_queue_capacity", "Requests allowed to wait (--max-queue)", m,
                                    registry=r)
        self.kv_usage = Gauge("gateeng_kv_cache_usage_ratio", "Fraction of KV blocks in use", m, registry=r)
        self.prefix_queries = Counter("gateeng_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache, on each request's first admission", [*m, "determinism"],
                                      registry=r)
        self.prefix_hits = Counter("gateeng_prefix_cache_hits", "Prompt tokens served from the prefix cache "
                                   "(VERIFIED requests reuse only blocks the invariant plan wrote)",
                                   [*m, "determinism"], registry=r)
        self.prompt_tokens = Counter("gateeng_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.gen_tokens = Counter("gateeng_generation_tokens", "Output tokens of finished requests",
                                  [*m, "determinism"], registry=r)
        self.request_prompt_tokens = Histogram("gateeng_request_prompt_tokens", "Prompt length of finished "
                                               "requests, in tokens", [*m, "determinism"], buckets=TOKENS,
                                               registry=r)
        self.request_gen_tokens = Histogram("gateeng_request_generation_tokens", "Output length of finished "
                                            "requests, in tokens", [*m, "determinism"], buckets=TOKENS,
                                            registry=r)
        self.success = Counter("gateeng_request_success", "Finished requests by finish reason",
                               [*m, "finish_reason"], registry=r)
        self.ttft = Histogram("gateeng_time_to_first_token_seconds", "Arrival to first streamed token",
                              [*m, "determinism"], buckets=LAT, registry=r)
        self.itl = Histogram("gateeng_inter_token_latency_seconds", "Time between streamed tokens",
                             [*m, "determinism"], buckets=LAT, registry=r)
        self.e2e = Histogram("gateeng_e2e_request_latency_seconds", "Arrival to completion",
                             [*m, "determinism"], buckets=LAT, registry=r)
        self.queue_time = Histogram("gateeng_request_queue_time_seconds", "Arrival to first admission into "
                                    "the running batch (to the finish, for a request never admitted)",
                                    [*m, "determinism"], buckets=LAT, registry=r)
        self.prefill_time = Histogram("gateeng_request_prefill_time_seconds", "First admission to first "
                                      "token sent (to the finish, for a request that sent none)",
                                      [*m, "determinism"], buckets=LAT, registry=r)
        self.decode_time = Histogram("gateeng_request_decode_time_seconds", "First token sent to completion",
                                     [*m, "determinism"], buckets=LAT, registry=r)
        self.overrides = Counter("gateeng_gate_overrides", "Requests that set their own gate setting "
                                 "(margin_threshold or max_window) instead of the server default",
                                 [*m, "setting"], registry=r)
        self.errors = Counter("gateeng_rpc_errors", "Calls answered with an error status, by gRPC status code",
                              [*m, "code"], registry=r)
        self.preemptions = Counter("gateeng_preemptions", "Requests preempted (recompute)", m, registry=r)
        self.weight_updates = Counter("gateeng_weight_updates", "Weight updates (UpdateWeights, "
                                      "Engine.update_weights): applied, or refused with nothing changed",
                                      [*m, "result"], registry=r)
        self.weight_update_seconds = Gauge("gateeng_weight_update_seconds",
                                           "Duration of the last applied weight update, from the call to the "
                                           "swap (the wait for running requests included)", m, registry=r)
        self.weight_version = Gauge("gateeng_weight_version", "Weight version served: 0 at start, +1 per "
                                    "applied weight update", m, registry=r)
        self.build_info = Gauge("gateeng_build_info", "Build and run configuration",
                                [*m, "version", "plan", "dtype", "device", "self_check"], registry=r)
        self._preemptions = 0

    def attach(self, engine: Engine, model_name: str) -> None:
        """Subscribe to an engine serving `model_name` (called once, before it serves)."""
        self.model_name = model_name
        cfg = engine.config
        self._of(self.build_info, engine.version, cfg.plan, cfg.dtype, cfg.device,
                 "passed" if engine.selfcheck.passed else "failed").set(1)
        self._of(self.queue_capacity).set(cfg.max_queue)
        self._of(self.weight_version).set(engine.weight_version)
        # Every label value exists from the start, so ratios and rates have both sides at once.
        for metric in (self.passes, self.replayed, self.rolled_back, self.retractions, self.margin,
                       self.mismatch_margin, self.pass_seconds, self.prompt_tokens, self.preemptions,
                       self.weight_update_seconds):
            self._of(metric)
        for setting in ("margin_threshold", "max_window"):
            self._of(self.overrides, setting)
        for result in ("applied", "refused"):
            self._of(self.weight_updates, result)
        for reason in TRIGGER_FIELDS:
            self._of(self.triggers, reason.value)
        for reason in MISMATCH_FIELDS:
            self._of(self.mismatches, reason.value)
        for det, route in DECODE_ROUTES:
            self._of(self.decode_steps, det, route)
        for det in DETERMINISM:
            for metric in (self.gen_tokens, self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time,
                           self.decode_time, self.request_prompt_tokens, self.request_gen_tokens,
                           self.prefix_queries, self.prefix_hits):
                self._of(metric, det)
        engine.set_observer(self)

    def _of(self, metric, *labels):
        """The series of `metric` for the served model and `labels`."""
        return metric.labels(self.model_name, *labels)

    def value(self, name: str, **labels):
        """The current value of sample `name` with `labels` for the served model, or None."""
        return self.registry.get_sample_value(name, {"model_name": self.model_name, **labels})

    def count_overrides(self, det) -> None:
        """A request was admitted with these DeterminismParams (any thread)."""
        if det.margin_threshold is not None:
            self._of(self.overrides, "margin_threshold").inc()
        if det.max_window is not None:
            self._of(self.overrides, "max_window").inc()

    def count_error(self, code: str) -> None:
        """A call answered with an error status (any thread)."""
        self._of(self.errors, code).inc()

    # ---- Observer hooks (engine thread; on_weight_update on the updating one) ---
    def on_step(self, record: StepRecord) -> None:
        for seq in record.seqs:
            if not seq.decode:
                continue
            if seq.mode is Mode.VERIFIED:
                if seq.kind == FAST and seq.margin is not None:
                    self._of(self.margin).observe(_clamp(seq.margin))
            else:   # VERIFIED decode steps come from the step's counts below, like the reports
                self._of(self.decode_steps, seq.mode.value, seq.kind).inc()
        counted = record.counted
        for name, (attr, labels) in COUNTED.items():
            n = getattr(counted, name)
            if n:
                self._of(getattr(self, attr), *labels).inc(n)
        for _, margin in record.mismatches:
            self._of(self.mismatch_margin).observe(_clamp(margin))
        if any(seq.replay for seq in record.seqs):
            self._of(self.pass_seconds).observe(record.plan_seconds.get(INVARIANT, 0.0))
        for lookup in record.lookups:
            self._of(self.prefix_queries, lookup.mode.value).inc(lookup.queried)
            self._of(self.prefix_hits, lookup.mode.value).inc(lookup.hit)
        self.on_counts(record.counts)

    def on_counts(self, counts: Counts) -> None:
        self._of(self.running).set(counts.running)
        self._of(self.waiting).set(counts.waiting)
        self._of(self.kv_usage).set(counts.kv_usage)
        if counts.preemptions > self._preemptions:
            self._of(self.preemptions).inc(counts.preemptions - self._preemptions)
            self._preemptions = counts.preemptions

    def on_gate_config(self, margin_threshold: float, max_window: int) -> None:
        self._of(self.threshold).set(margin_threshold)
        self._of(self.window).set(max_window)

    def on_first_token(self, mode: Mode, seconds: float) -> None:
        self._of(self.ttft, mode.value).observe(seconds)

    def on_tokens(self, mode: Mode, count: int, seconds_per_token: float) -> None:
        h = self._of(self.itl, mode.value)
        for _ in range(count):
            h.observe(seconds_per_token)

    def on_retraction(self, mode: Mode) -> None:
        self._of(self.retractions).inc()

    def on_weight_update(self, applied: bool, seconds: float, weight_version: int) -> None:
        self._of(self.weight_updates, "applied" if applied else "refused").inc()
        if applied:
            self._of(self.weight_update_seconds).set(seconds)
        self._of(self.weight_version).set(weight_version)

    def on_finish(self, completion, times: RequestTimes) -> None:
        det = completion.mode.value
        self._of(self.prompt_tokens).inc(completion.prompt_tokens)
        self._of(self.gen_tokens, det).inc(completion.completion_tokens)
        self._of(self.success, completion.finish_reason.value).inc()
        self._of(self.request_prompt_tokens, det).observe(completion.prompt_tokens)
        self._of(self.request_gen_tokens, det).observe(completion.completion_tokens)
        self._of(self.e2e, det).observe(times.e2e)
        self._of(self.queue_time, det).observe(times.queue)
        if times.prefill is not None:
            self._of(self.prefill_time, det).observe(times.prefill)
        if times.decode is not None:
            self._of(self.decode_time, det).observe(times.decode)


def _clamp(margin: float) -> float:
    # NaN margins (a NaN logit) count as 0: they always trigger the gate.
    return 0.0 if margin != margin else max(0.0, min(margin, 1e6))
