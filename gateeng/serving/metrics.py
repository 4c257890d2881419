"""Prometheus metrics (prefix gateeng_), fed by the engine's Observer hooks.

Every hook receives plain records (gateeng.records) built on the engine thread;
nothing here reads the scheduler, the block manager or the runner. Verifier
counters are deltas of the per-request DeterminismStats carried in the step
records, so the exported counters and the per-request reports cannot disagree.
Labels stay low-cardinality: determinism, reason, finish_reason.

Decode steps carry their route: a VERIFIED decode is `speculative` (the fast
plan, which the gate looks at) or `direct` (the invariant plan at once: nothing
for the gate to decide); other decodes carry the plan they ran on. The trigger
rate is over the speculative steps, so where the route sends every VERIFIED
decode direct it has no denominator: deploy/rules.yml (and the README) then
answer `{gate="all_direct"} 0` instead of NaN.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from gateeng.config import DIRECT, SPECULATIVE
from gateeng.engine.client import Engine
from gateeng.engine.core import Observer
from gateeng.engine.gate import REASONS
from gateeng.engine.records import MISMATCH_REASONS, Counts, StepRecord
from gateeng.request import Mode

LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Fine around the useful tau range (0.05-1: where the flips of a bf16 model sit),
# so the histogram tells an operator what a tau change would trigger.
MARGINS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
DETERMINISM = tuple(m.value for m in Mode)
# The (determinism, route) pairs a decode step can have: VERIFIED by route, the
# others by the plan they ran on (an OFF request may fill a spare invariant row).
DECODE_ROUTES = ((Mode.OFF.value, "fast"), (Mode.OFF.value, "invariant"), (Mode.REFERENCE.value, "invariant"),
                 (Mode.VERIFIED.value, SPECULATIVE), (Mode.VERIFIED.value, DIRECT))
# DeterminismStats field -> (counter attribute, label values)
COUNTED = {
    "decode_steps": ("decode_steps", (Mode.VERIFIED.value, SPECULATIVE)),
    "direct_steps": ("decode_steps", (Mode.VERIFIED.value, DIRECT)),
    **{f"triggers_{r}": ("triggers", (r,)) for r in REASONS},
    **{f"mismatches_{r}": ("mismatches", (r,)) for r in MISMATCH_REASONS},
    "verify_passes": ("passes", ()),
    "replayed_tokens": ("replayed", ()),
    "rolled_back_tokens": ("rolled_back", ()),
}


class Metrics(Observer):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        ProcessCollector(registry=r)
        self.decode_steps = Counter("gateeng_decode_steps", "Decode steps (one sampled token each) by route: "
                                    "VERIFIED ones speculative (fast plan, the gate looks at them) or direct "
                                    "(invariant plan, no gate needed); others the plan they ran on",
                                    ["determinism", "route"], registry=r)
        self.triggers = Counter("gateeng_verifier_triggers", "Verifier triggers by reason", ["reason"], registry=r)
        self.passes = Counter("gateeng_verifier_passes", "Verify replays run", registry=r)
        self.replayed = Counter("gateeng_verifier_replayed_tokens", "Positions replayed on the invariant plan",
                                registry=r)
        self.mismatches = Counter("gateeng_verifier_mismatches",
                                  "Replays that found a wrong speculated token, by the trigger that caught it "
                                  "(window, finish or direct: the margin test missed a flip)", ["reason"],
                                  registry=r)
        self.rolled_back = Counter("gateeng_rolled_back_tokens", "Speculated tokens dropped by rollbacks",
                                   registry=r)
        self.retractions = Counter("gateeng_stream_retractions", "Rollback events sent to EAGER streams",
                                   registry=r)
        self.margin = Histogram("gateeng_margin", "Top-1 minus top-2 score of VERIFIED fast-path tokens",
                                buckets=MARGINS, registry=r)
        self.mismatch_margin = Histogram("gateeng_mismatch_margin",
                                         "Fast-path margin of the first wrong token of each mismatch",
                                         buckets=MARGINS, registry=r)
        self.pass_seconds = Histogram("gateeng_verifier_pass_duration_seconds",
                                      "Wall time of invariant-plan passes that included a verify replay",
                                      buckets=LAT, registry=r)
        self.threshold = Gauge("gateeng_margin_threshold", "Engine default margin threshold (tau)", registry=r)
        self.window = Gauge("gateeng_max_window", "Engine default max window (W)", registry=r)
        self.running = Gauge("gateeng_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("gateeng_requests_waiting", "Requests waiting for admission", registry=r)
        self.queue_capacity = Gauge("gateeng_queue_capacity", "Requests allowed to wait (--max-queue)", registry=r)
        self.kv_usage = Gauge("gateeng_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.prompt_tokens = Counter("gateeng_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.gen_tokens = Counter("gateeng_generation_tokens", "Output tokens of finished requests",
                                  ["determinism"], registry=r)
        self.success = Counter("gateeng_request_success", "Finished requests by finish reason",
                               ["finish_reason"], registry=r)
        self.ttft = Histogram("gateeng_time_to_first_token_seconds", "Arrival to first streamed token",
                              ["determinism"], buckets=LAT, registry=r)
        self.itl = Histogram("gateeng_inter_token_latency_seconds", "Time between streamed tokens",
                             ["determinism"], buckets=LAT, registry=r)
        self.e2e = Histogram("gateeng_e2e_request_latency_seconds", "Arrival to completion",
                             ["determinism"], buckets=LAT, registry=r)
        self.overrides = Counter("gateeng_gate_overrides", "Requests that set their own gate setting "
                                 "(margin_threshold or max_window) instead of the server default", ["setting"],
                                 registry=r)
        self.errors = Counter("gateeng_rpc_errors", "Calls answered with an error status, by gRPC status code",
                              ["code"], registry=r)
        self.preemptions = Counter("gateeng_preemptions", "Requests preempted (recompute)", registry=r)
        self.weight_updates = Counter("gateeng_weight_updates", "Weight updates (UpdateWeights, "
                                      "Engine.update_weights): applied, or refused with nothing changed",
                                      ["result"], registry=r)
        self.weight_update_seconds = Gauge("gateeng_weight_update_seconds",
                                           "Duration of the last applied weight update, from the call to the "
                                           "swap (the wait for running requests included)", registry=r)
        self.weight_version = Gauge("gateeng_weight_version", "Weight version served: 0 at start, +1 per "
                                    "applied weight update", registry=r)
        self.build_info = Gauge("gateeng_build_info", "Build and run configuration",
                                ["version", "plan", "dtype", "device", "self_check"], registry=r)
        # Every label value exists from the start, so ratios and rates have both sides at once.
        for setting in ("margin_threshold", "max_window"):
            self.overrides.labels(setting)
        for result in ("applied", "refused"):
            self.weight_updates.labels(result)
        for reason in REASONS:
            self.triggers.labels(reason)
        for reason in MISMATCH_REASONS:
            self.mismatches.labels(reason)
        for det, route in DECODE_ROUTES:
            self.decode_steps.labels(det, route)
        for det in DETERMINISM:
            self.gen_tokens.labels(det)
            self.ttft.labels(det)
            self.itl.labels(det)
            self.e2e.labels(det)
        self._preemptions = 0

    def attach(self, engine: Engine) -> None:
        """Subscribe to an engine (called once, before it serves)."""
        cfg = engine.config
        self.build_info.labels(engine.version, cfg.plan, cfg.dtype, cfg.device,
                               "passed" if engine.selfcheck.passed else "failed").set(1)
        self.queue_capacity.set(cfg.max_queue)
        self.weight_version.set(engine.weight_version)
        engine.set_observer(self)

    def count_overrides(self, det) -> None:
        """A request was admitted with these DeterminismParams (any thread)."""
        if det.margin_threshold is not None:
            self.overrides.labels("margin_threshold").inc()
        if det.max_window is not None:
            self.overrides.labels("max_window").inc()

    # ---- Observer hooks (engine thread; on_weight_update on the updating one) ---
    def on_step(self, record: StepRecord) -> None:
        for seq in record.seqs:
            if not seq.decode:
                continue
            if seq.mode is Mode.VERIFIED:
                if seq.kind == "fast" and seq.margin is not None:
                    self.margin.observe(_clamp(seq.margin))
            else:   # VERIFIED decode steps come from the step's counts below, like the reports
                self.decode_steps.labels(seq.mode.value, seq.kind).inc()
        counted = record.counted
        for name, (attr, labels) in COUNTED.items():
            n = getattr(counted, name)
            if n:
                counter = getattr(self, attr)
                (counter.labels(*labels) if labels else counter).inc(n)
        for _, margin in record.mismatches:
            self.mismatch_margin.observe(_clamp(margin))
        if any(seq.replay for seq in record.seqs):
            self.pass_seconds.observe(record.plan_seconds.get("invariant", 0.0))
        self.on_counts(record.counts)

    def on_counts(self, counts: Counts) -> None:
        self.running.set(counts.running)
        self.waiting.set(counts.waiting)
        self.kv_usage.set(counts.kv_usage)
        if counts.preemptions > self._preemptions:
            self.preemptions.inc(counts.preemptions - self._preemptions)
            self._preemptions = counts.preemptions

    def on_gate_config(self, margin_threshold: float, max_window: int) -> None:
        self.threshold.set(margin_threshold)
        self.window.set(max_window)

    def on_first_token(self, mode: Mode, seconds: float) -> None:
        self.ttft.labels(mode.value).observe(seconds)

    def on_tokens(self, mode: Mode, count: int, seconds_per_token: float) -> None:
        h = self.itl.labels(mode.value)
        for _ in range(count):
            h.observe(seconds_per_token)

    def on_retraction(self, mode: Mode) -> None:
        self.retractions.inc()

    def on_weight_update(self, applied: bool, seconds: float, weight_version: int) -> None:
        self.weight_updates.labels("applied" if applied else "refused").inc()
        if applied:
            self.weight_update_seconds.set(seconds)
        self.weight_version.set(weight_version)

    def on_finish(self, completion, seconds: float) -> None:
        self.prompt_tokens.inc(completion.prompt_tokens)
        self.gen_tokens.labels(completion.mode.value).inc(completion.completion_tokens)
        self.success.labels(completion.finish_reason.value).inc()
        self.e2e.labels(completion.mode.value).observe(seconds)


def _clamp(margin: float) -> float:
    # NaN margins (a NaN logit) count as 0: they always trigger the gate.
    return 0.0 if margin != margin else max(0.0, min(margin, 1e6))
