"""Prometheus metrics (prefix gateeng_), fed by the engine's Observer hooks.

Verifier counters are derived from the per-request DeterminismStats as deltas
after each step, so the exported counters and the per-request reports can never
disagree. Labels stay low-cardinality: determinism, reason, finish_reason.
Trigger rate (PromQL; each side summed, since the labels differ):
  sum(rate(gateeng_verifier_triggers_total[5m]))
    / sum(rate(gateeng_decode_steps_total{determinism="verified"}[5m]))
"""
from __future__ import annotations


from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateeng.engine import Engine, Observer
from gateeng.request import DeterminismStats, Mode
from gateeng.scheduler import Kind

LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MARGINS = (0.0, 0.03125, 0.0625, 0.125, 0.25, 0.5, 1, 2, 4, 8, 16)
FIELDS = ("triggers_margin", "triggers_window", "triggers_finish", "verify_passes", "replayed_tokens",
          "mismatches", "rolled_back_tokens", "decode_steps")


class Metrics(Observer):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.decode_steps = Counter("gateeng_decode_steps", "Decode steps (one sampled token each)",
                                    ["determinism"], registry=r)
        self.triggers = Counter("gateeng_verifier_triggers", "Verifier triggers by reason", ["reason"], registry=r)
        self.passes = Counter("gateeng_verifier_passes", "Verify replays run", registry=r)
        self.replayed = Counter("gateeng_verifier_replayed_tokens", "Positions replayed on the invariant plan",
                                registry=r)
        self.mismatches = Counter("gateeng_verifier_mismatches", "Replays that found a wrong speculated token",
                                  registry=r)
        self.rolled_back = Counter("gateeng_rolled_back_tokens", "Speculated tokens dropped by rollbacks",
                                   registry=r)
        self.retractions = Counter("gateeng_stream_retractions", "Rollback events sent to EAGER streams",
                                   registry=r)
        self.margin = Histogram("gateeng_margin", "Top-1 minus top-2 score of VERIFIED fast-path tokens",
                                buckets=MARGINS, registry=r)
        self.pass_seconds = Histogram("gateeng_verifier_pass_duration_seconds",
                                      "Wall time of invariant-plan passes that included a verify replay",
                                      buckets=LAT, registry=r)
        self.threshold = Gauge("gateeng_margin_threshold", "Engine default margin threshold (tau)", registry=r)
        self.running = Gauge("gateeng_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("gateeng_requests_waiting", "Requests waiting for admission", registry=r)
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
        self.preemptions = Counter("gateeng_preemptions", "Requests preempted (recompute)", registry=r)
        self.build_info = Gauge("gateeng_build_info", "Build and run configuration",
                                ["version", "plan", "dtype", "device", "self_check"], registry=r)
        for reason in ("margin", "window", "finish"):
            self.triggers.labels(reason)
        for det in ("off", "verified", "reference"):
            self.decode_steps.labels(det)
            self.gen_tokens.labels(det)
        self._seen: dict[str, dict] = {}
        self._preemptions = 0

    def attach(self, engine: Engine) -> None:
        engine.observer = self
        cfg = engine.config
        self.build_info.labels(engine.version, cfg.plan, cfg.dtype, cfg.device,
                               "passed" if engine.selfcheck.passed else "failed").set(1)
        self.threshold.set_function(lambda: engine.margin_threshold)
        self.running.set_function(lambda: len(engine.scheduler.running))
        self.waiting.set_function(lambda: len(engine.scheduler.waiting))
        self.kv_usage.set_function(lambda: engine.blocks.usage)

    # ---- Observer hooks (engine thread) ---------------------------------------
    def on_step(self, engine, plan, outputs, seconds: float) -> None:
        replay = False
        for seq in plan.seqs:
            req = seq.request
            replay |= seq.replay
            if req.mode is Mode.VERIFIED:
                if seq.kind is Kind.FAST and seq.sample_rows:
                    self.margin.observe(max(0.0, min(outputs[req.request_id].margins[-1], 1e6)))
                if not req.finished:   # a finished request's last delta was taken in on_finish
                    self._stats_delta(req.request_id, req.stats)
            elif seq.sample_rows and not seq.replay and seq.start >= req.num_prompt:
                self.decode_steps.labels(req.mode.value).inc()
        if replay:
            self.pass_seconds.observe(engine.runner.last_seconds.get(Kind.INVARIANT, 0.0))
        n = engine.scheduler.num_preemptions
        if n > self._preemptions:
            self.preemptions.inc(n - self._preemptions)
            self._preemptions = n

    def _stats_delta(self, rid: str, stats: DeterminismStats) -> None:
        now = {f: getattr(stats, f) for f in FIELDS}
        before = self._seen.get(rid, dict.fromkeys(FIELDS, 0))
        d = {f: now[f] - before[f] for f in FIELDS}
        self._seen[rid] = now
        self.decode_steps.labels("verified").inc(d["decode_steps"])
        for reason in ("margin", "window", "finish"):
            self.triggers.labels(reason).inc(d[f"triggers_{reason}"])
        self.passes.inc(d["verify_passes"])
        self.replayed.inc(d["replayed_tokens"])
        self.mismatches.inc(d["mismatches"])
        self.rolled_back.inc(d["rolled_back_tokens"])

    def on_first_token(self, req, seconds: float) -> None:
        self.ttft.labels(req.mode.value).observe(seconds)

    def on_tokens(self, req, count: int, seconds_per_token: float) -> None:
        h = self.itl.labels(req.mode.value)
        for _ in range(count):
            h.observe(seconds_per_token)

    def on_retraction(self, req) -> None:
        self.retractions.inc()

    def on_finish(self, req, completion, seconds: float) -> None:
        if req.mode is Mode.VERIFIED:
            self._stats_delta(req.request_id, req.stats)
        self._seen.pop(req.request_id, None)
        self.prompt_tokens.inc(req.num_prompt)
        self.gen_tokens.labels(req.mode.value).inc(completion.completion_tokens)
        self.success.labels(completion.finish_reason.value).inc()
        self.e2e.labels(req.mode.value).observe(seconds)
