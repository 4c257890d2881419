"""Metrics from step records, on the tiny model: every series moves with the
traffic that should move it, the verifier counters add up to the reports, the
request phases add up to the e2e latency and the prefix-cache counters to the
answers' cached tokens."""
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fakes import FakeRunner
from gateeng.config import EngineConfig
from gateeng.engine.block_manager import BlockManager
from gateeng.engine.engine import Engine
from gateeng.engine.records import RequestTimes
from gateeng.engine.route import RoutePolicy
from gateeng.engine.scheduler import Scheduler
from gateeng.engine.stopping import StopChecker
from gateeng.engine.verification import VerificationStage
from gateeng.serving.metrics import MARGINS, Metrics
from gateeng.request import DeterminismParams, Mode, Request, SamplingParams
from tiny import tiny_loaded

VERIFIED = DeterminismParams(Mode.VERIFIED)
SMALL = dict(dtype="float32", num_kv_blocks=64, max_model_len=128, block_size=4, attention_split=8,
             invariant_rows=8, max_num_batched_tokens=64, verified_route="speculative")


def value(m: Metrics, name: str, **labels) -> float:
    v = m.value(name, **labels)
    return 0.0 if v is None else v


class Recording(Metrics):
    """Metrics that also keep each finished request's times, by request id."""

    def __init__(self):
        super().__init__()
        self.times = {}

    def on_finish(self, completion, times):
        super().on_finish(completion, times)
        self.times[completion.request_id] = times


@pytest.fixture(scope="module")
def served():
    cfg = EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=128, block_size=4, attention_split=8,
                       invariant_rows=8, max_num_batched_tokens=64, fast_logit_noise=1.0,
                       verified_route="speculative")   # the gate and its counters at work
    engine = Engine(cfg, loaded=tiny_loaded("float32"))
    metrics = Metrics()
    metrics.attach(engine, "tiny")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[i + 1, i + 2, i + 3] for i in range(8)]
    res = engine.generate(prompts, params, [VERIFIED if i % 2 else None for i in range(8)])
    yield engine, metrics, res
    engine.shutdown()


def test_off_and_verified_decode_steps_and_margins_are_counted(served):
    _, m, res = served
    verified = [r for r in res if r.mode is Mode.VERIFIED]
    # OFF: one decode step per token after the first (which the prefill samples).
    assert value(m, "gateeng_decode_steps_total", determinism="off", route="fast") == 4 * (12 - 1)
    assert value(m, "gateeng_decode_steps_total", determinism="verified", route="speculative") == sum(
        r.stats.decode_steps for r in verified) > 0
    assert value(m, "gateeng_decode_steps_total", determinism="verified", route="direct") == sum(
        r.stats.direct_steps for r in verified)
    assert value(m, "gateeng_margin_count") == sum(r.stats.decode_steps for r in verified)


def test_verifier_counters_equal_the_reports(served):
    _, m, res = served
    stats = [r.stats for r in res if r.mode is Mode.VERIFIED]
    for reason in ("margin", "window", "finish"):
        assert value(m, "gateeng_verifier_triggers_total", reason=reason) == sum(
            getattr(s, f"triggers_{reason}") for s in stats)
        assert value(m, "gateeng_verifier_mismatches_total", reason=reason) == sum(
            getattr(s, f"mismatches_{reason}") for s in stats)
    mismatches = sum(s.mismatches for s in stats)
    assert mismatches > 0   # the logit noise makes the fast path wrong
    assert value(m, "gateeng_mismatch_margin_count") == mismatches
    assert value(m, "gateeng_verifier_passes_total") == sum(s.verify_passes for s in stats)
    assert value(m, "gateeng_rolled_back_tokens_total") == sum(s.rolled_back_tokens for s in stats)


def test_gauges_return_to_idle_and_gate_config_is_tracked(served):
    engine, m, _ = served
    assert value(m, "gateeng_requests_running") == 0 and value(m, "gateeng_requests_waiting") == 0
    assert value(m, "gateeng_kv_cache_usage_ratio") == engine.core.blocks.usage
    engine.set_margin_threshold(0.7)
    engine.set_max_window(9)
    assert value(m, "gateeng_margin_threshold") == 0.7 and value(m, "gateeng_max_window") == 9
    text = generate_latest(m.registry).decode()
    assert "process_cpu_seconds_total" in text and "process_resident_memory_bytes" in text


def test_margin_buckets_bracket_the_default_tau():
    tau = EngineConfig().margin_threshold
    below = [b for b in MARGINS if b < tau]
    above = [b for b in MARGINS if b > tau]
    assert tau in MARGINS and len(below) >= 3 and len(above) >= 6
    assert min(above) <= 1.5 * tau and max(b for b in below) >= tau / 2


def test_every_series_carries_the_model_name(served):
    _, m, _ = served
    families = [f for f in text_string_to_metric_families(generate_latest(m.registry).decode())
                if f.name.startswith("gateeng_")]
    # Only the error codes (none yet) have no series before their first use.
    assert [f.name for f in families if not f.samples] == ["gateeng_rpc_errors"]
    assert len(families) > 30
    for sample in (s for f in families for s in f.samples):
        assert sample.labels.get("model_name") == "tiny", sample


def test_token_histograms_and_phases_add_up_to_the_requests_run():
    """Two OFF requests and one VERIFIED on a batch of one: the token histograms hold
    the requests' own lengths; per request, queue + prefill + decode is the e2e
    latency and queue + prefill the time to first token; a request that waited for
    the one running ahead of it queued at least as long as that one took after
    admission."""
    engine = Engine(EngineConfig(**SMALL, max_num_seqs=1), loaded=tiny_loaded("float32"))
    m = Recording()
    m.attach(engine, "tiny")
    prompts = [list(range(1, 14)), [7, 8, 9], [20, 21, 22, 23, 24]]
    res = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 9, 4)],
                          [None, None, VERIFIED])
    engine.shutdown()
    off = [r for r in res if r.mode is Mode.OFF]
    assert [r.completion_tokens for r in res] == [6, 9, 4]
    # Prompt and output lengths: sums, counts and the bucket each length falls in.
    assert value(m, "gateeng_request_prompt_tokens_sum", determinism="off") == 13 + 3
    assert value(m, "gateeng_request_prompt_tokens_count", determinism="off") == 2
    assert value(m, "gateeng_request_prompt_tokens_bucket", determinism="off", le="10.0") == 1   # the 3
    assert value(m, "gateeng_request_prompt_tokens_bucket", determinism="off", le="20.0") == 2   # and the 13
    assert value(m, "gateeng_request_prompt_tokens_sum", determinism="verified") == 5
    assert value(m, "gateeng_request_generation_tokens_sum", determinism="off") == 6 + 9
    assert value(m, "gateeng_request_generation_tokens_bucket", determinism="off", le="5.0") == 0
    assert value(m, "gateeng_request_generation_tokens_bucket", determinism="off", le="10.0") == 2
    assert value(m, "gateeng_request_generation_tokens_sum", determinism="verified") == 4
    assert value(m, "gateeng_prompt_tokens_total") == 13 + 3 + 5
    # Phases, per request, on the engine's clock.
    times = [m.times[r.request_id] for r in res]
    for t in times:
        assert t.queue > 0 and t.prefill > 0 and t.decode > 0
        assert t.queue + t.prefill + t.decode == pytest.approx(t.e2e, rel=1e-9, abs=1e-12)
    first, second, third = times
    assert second.queue >= first.prefill + first.decode
    assert third.queue >= second.prefill + second.decode
    # ... and the histograms are those times.
    for det, ts in (("off", times[:2]), ("verified", times[2:])):
        for name, attr in (("queue", "queue"), ("prefill", "prefill"), ("decode", "decode")):
            assert value(m, f"gateeng_request_{name}_time_seconds_count", determinism=det) == len(ts)
            assert value(m, f"gateeng_request_{name}_time_seconds_sum", determinism=det) == pytest.approx(
                sum(getattr(t, attr) for t in ts), rel=1e-9)
        phases = sum(value(m, f"gateeng_request_{name}_time_seconds_sum", determinism=det)
                     for name in ("queue", "prefill", "decode"))
        assert phases == pytest.approx(value(m, "gateeng_e2e_request_latency_seconds_sum", determinism=det),
                                       rel=1e-9)
        ttft = value(m, "gateeng_time_to_first_token_seconds_sum", determinism=det)
        assert ttft == pytest.approx(sum(t.queue + t.prefill for t in ts), rel=1e-9)
    assert len(off) == 2


def test_prefix_cache_counters_are_the_answers_cached_tokens():
    """One prompt, run one request at a time: the cache is cold, then warm for OFF;
    VERIFIED reuses only blocks the invariant plan wrote, so its first run misses
    the fast-plan blocks; a request asking for prompt logprobs does not look up."""
    engine = Engine(EngineConfig(**SMALL), loaded=tiny_loaded("float32"))
    m = Metrics()
    m.attach(engine, "tiny")
    prompt = list(range(1, 14))   # 3 full blocks of 4 before the last token
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    runs = [engine.generate(prompt, params, det) for det in (None, None, VERIFIED, VERIFIED)]
    with_logprobs = engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1))
    engine.shutdown()
    assert [r.cached_tokens for r in runs] == [0, 12, 0, 12]
    assert with_logprobs.cached_tokens == 0 and len(with_logprobs.prompt_logprobs) == 12
    for det in ("off", "verified"):
        looked_up = [r for r in runs if r.mode.value == det]
        assert value(m, "gateeng_prefix_cache_queries_total", determinism=det) == 2 * 13
        assert value(m, "gateeng_prefix_cache_hits_total", determinism=det) == sum(
            r.cached_tokens for r in looked_up) == 12
    assert value(m, "gateeng_prefix_cache_queries_total", determinism="reference") == 0


def test_admission_is_stamped_once_on_the_schedulers_clock():
    """Under KV pressure requests are preempted and admitted again: each is stamped
    and listed for the prefix-cache counters on its first admission only, with the
    clock's value at that step."""
    now = [0.0]
    sched = Scheduler(BlockManager(12, 4), 8, 16, RoutePolicy("speculative"), clock=lambda: now[0])
    stage = VerificationStage(StopChecker({255}, max_model_len=1000))
    for i in range(8):
        mode = Mode.VERIFIED if i % 2 else Mode.OFF
        sched.add(Request(f"r{i}", [i + 1, 2, 3, 4, 5, i], SamplingParams(max_tokens=10),
                          DeterminismParams(mode), tau=1.0, window=3))
    runner, admitted, first_seen = FakeRunner(), [], {}
    while sched.has_work():
        now[0] += 1.0
        plan = sched.schedule()
        for seq in plan.seqs:
            first_seen.setdefault(seq.request.request_id, now[0])
        admitted += [(r.request_id, r.first_scheduled_time) for r in sched.take_admitted()]
        sched.update(stage.apply(plan, runner.run(plan)))
    assert sched.num_preemptions > 0
    assert sorted(admitted) == sorted(first_seen.items()) and len(admitted) == 8


@pytest.mark.parametrize("scheduled, first_token, want", [
    (None, None, (10.0, 10.0, None, None)),      # aborted while waiting: all queue
    (3.0, None, (10.0, 3.0, 7.0, None)),         # admitted, no token sent
    (3.0, 4.5, (10.0, 3.0, 1.5, 5.5)),
])
def test_request_times_split_arrival_to_finish(scheduled, first_token, want):
    assert RequestTimes.between(100.0, scheduled and 100.0 + scheduled, first_token and 100.0 + first_token,
                                110.0) == RequestTimes(*want)
