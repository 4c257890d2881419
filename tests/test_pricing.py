"""Start-up pricing of both plans: the route policy's cost models are seeded from
timed decode passes, without a shape's one-time set-up, and the KV accounting is
left as it was."""
import pytest

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.request import DeterminismParams, Mode, SamplingParams
from gateeng.engine import pricing, route_costs
from gateeng.engine.pricing import PRICE_ROWS, REPEATS, price_plans
from gateeng.engine.route import RoutePolicy
from gateeng.step import PlanKind
from tiny import tiny_loaded

STEADY = {PlanKind.FAST: (0.010, 0.001), PlanKind.INVARIANT: (0.010, 0.002)}   # seconds: base, per row
SET_UP = 0.200   # what a shape's first pass costs on top
STALL = 0.100    # a host's stall, on each shape's second pass


def fake_timer(steady: dict, calls: list):
    def time_pass(kind, rows):
        before = sum((k, r) == (kind, rows) for k, r, _ in calls)
        base, per_row = steady[kind]
        seconds = base + per_row * rows + {0: SET_UP, 2: STALL}.get(before, 0.0)
        calls.append((kind, rows, seconds))
        return seconds
    return time_pass


def test_pricing_fits_the_steady_cost_of_both_plans_without_set_up_or_stalls():
    policy, calls = RoutePolicy(group_rows=0), []
    observed = price_plans(fake_timer(STEADY, calls))
    for measured in observed:
        policy.observe_pass(*measured)
    assert len(calls) == len(PRICE_ROWS) * 2 * (1 + REPEATS)
    assert len(observed) == len(PRICE_ROWS) * 2
    assert all(seconds < STALL for _, _, seconds in observed)
    for kind, model in ((PlanKind.FAST, policy.fast), (PlanKind.INVARIANT, policy.invariant)):
        base, per_row = STEADY[kind]
        for rows in (1, 20, 32):
            assert model.cost(rows) == pytest.approx(base + per_row * rows, rel=0.05)


def test_a_priced_policy_keeps_a_verified_minority_speculative_where_the_fast_plan_is_cheaper():
    """The lock-in pricing prevents. Torch-ops figures: a 20-row step takes 110 ms on
    the fast plan and 138 ms on the invariant one. Priced from traffic's first fast
    passes (set-up included), the fast plan looks dear; two VERIFIED decodes among 18
    OFF ones then go direct with the OFF rows riding along, the fast plan stops
    running, and its price is never corrected."""
    steady = {PlanKind.FAST: (0.040, 0.0035), PlanKind.INVARIANT: (0.128, 0.0005)}
    unpriced = RoutePolicy(group_rows=0, replay_delay=8)
    unpriced.observe_pass("fast", 1, 0.200)
    unpriced.observe_pass("fast", 2, 0.216)
    for _ in range(3):
        unpriced.observe_pass("invariant", 20, 0.138)
    priced = RoutePolicy(group_rows=0, replay_delay=8)
    for measured in price_plans(fake_timer(steady, [])):
        priced.observe_pass(*measured)
    assert priced.fast.cost(20) < priced.invariant.cost(20) < unpriced.fast.cost(20)
    step = dict(fast_rows=20, inv_rows=0, direct_rows=[1, 1], budget=100, off_rows=(1,) * 18)
    assert unpriced.choose(**step) == [True, True]
    assert priced.choose(**step) == [False, False]


@pytest.fixture
def timed(tmp_path, monkeypatch) -> list:
    """The (plan, rows) of every decode pass an engine times at start-up, with no route
    costs kept from before."""
    monkeypatch.setattr(route_costs, "cache_root", lambda: tmp_path)
    calls, timer = [], pricing.decode_pass_timer

    def counting_timer(*args, **kwargs):
        time_pass = timer(*args, **kwargs)
        return lambda kind, rows: calls.append((kind.value, rows)) or time_pass(kind, rows)
    monkeypatch.setattr(pricing, "decode_pass_timer", counting_timer)
    return calls


def engine_with(**overrides):
    cfg = EngineConfig(**{"dtype": "float32", "num_kv_blocks": 64, **overrides})
    return Engine(cfg, tiny_loaded())


def test_the_engine_prices_both_plans_at_start_up_and_leaves_the_kv_cache_as_it_was(timed):
    e = engine_with()
    # Whether the tiny model's sub-millisecond timings pass refusal depends on the
    # host's noise; that passes are timed at each row count does not.
    assert sorted(set(timed)) == sorted((kind, rows) for kind in ("fast", "invariant") for rows in PRICE_ROWS)
    assert e.core.route.fast.seen in (0, len(PRICE_ROWS))
    assert e.core.blocks.num_free == e.core.blocks.num_blocks and not e.core.blocks.cache
    e.core.blocks.check_integrity()
    assert all(b.ref_count == 0 for b in e.core.blocks.blocks)
    out = e.generate("hello there", SamplingParams(max_tokens=4), DeterminismParams(Mode.VERIFIED))
    assert len(out.token_ids) == 4
    e.shutdown()


@pytest.mark.parametrize("overrides", [{"verified_route": "direct"}, {"plan": "invariant"}])
def test_engines_that_never_choose_a_route_do_not_price(overrides, timed):
    e = engine_with(**overrides)
    assert not timed and e.core.route.fast.seen == 0
    e.shutdown()


def test_a_small_cache_prices_fewer_rows(timed):
    e = engine_with(num_kv_blocks=7 + 4)   # 7 shared blocks of 16 for 128 keys, 4 rows
    assert {rows for _, rows in timed} == {1, 4} and e.core.route.fast.cost(1) > 0
    assert e.core.blocks.num_free == e.core.blocks.num_blocks
    e.shutdown()
