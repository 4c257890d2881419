"""Metrics from step records, on the tiny model: every series moves with the
traffic that should move it, and the verifier counters add up to the reports."""
import pytest
from prometheus_client import generate_latest

from gateeng.config import EngineConfig
from gateeng.engine.client import Engine
from gateeng.serving.metrics import MARGINS, Metrics
from gateeng.request import DeterminismParams, Mode, SamplingParams
from tiny import tiny_loaded

VERIFIED = DeterminismParams(Mode.VERIFIED)


def value(m: Metrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


@pytest.fixture(scope="module")
def served():
    cfg = EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=128, block_size=4, attention_split=8,
                       invariant_rows=8, max_num_batched_tokens=64, fast_logit_noise=1.0,
                       verified_route="speculative")   # the gate and its counters at work
    engine = Engine(cfg, loaded=tiny_loaded("float32"))
    metrics = Metrics()
    metrics.attach(engine)
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
