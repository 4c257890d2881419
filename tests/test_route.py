"""The VERIFIED route policy (pure) and the scheduler on every route (fake runner)."""
import random

import pytest

from fakes import FakeRunner, reference_output
from gateeng.engine.route import CostModel, GroupCost, RoutePolicy
from gateeng.request import Mode
from gateeng.step import PlanKind
from test_scheduler import PROMPT, make_request, make_scheduler, run_all


def trained(group_rows=16, fast=(0.045, 0.0019), per_group=0.065, trigger_rate=0.15):
    """A policy whose cost models have seen passes of a known cost (defaults: as
    measured for SmolLM2 on an AVX-512 BF16 CPU)."""
    p = RoutePolicy("adaptive", group_rows=group_rows, trigger_rate=trigger_rate)
    for rows in (1, 4, 8, 16, 20, 32, 48, 64) * 20:
        p.observe_pass("fast", rows, fast[0] + fast[1] * rows)
        p.observe_pass("invariant", rows, per_group * -(-rows // group_rows))
    return p


def test_group_cost_learns_the_cost_of_a_group():
    g = GroupCost(0.01, group_rows=16)
    for rows in (3, 20, 40, 16) * 10:
        g.observe(rows, 0.06 * -(-rows // 16))
    assert g.cost(0) == 0.0 and g.cost(17) == pytest.approx(0.12, rel=0.01)


def test_cost_model_learns_a_linear_cost():
    m = CostModel(0.02, 0.001)
    for rows in (1, 5, 9, 30, 2, 17) * 30:
        m.observe(rows, 0.03 + 0.002 * rows)
    assert m.cost(0) == 0.0
    assert m.cost(10) == pytest.approx(0.05, rel=0.05) and m.cost(40) == pytest.approx(0.11, rel=0.05)


def test_one_stalled_pass_barely_moves_a_trained_cost_model_but_a_real_change_comes_through():
    m = CostModel(0.02, 0.001)
    for i in range(200):
        rows = 20 - (i % 3 == 0)
        m.observe(rows, 0.012 + 0.0008 * rows)
    m.observe(20, 0.080)   # a host stall: 80 ms where 28 ms is usual
    assert m.cost(20) == pytest.approx(0.028, rel=0.05) and m.theta[1] < 0.0015
    for _ in range(30):
        m.observe(20, 0.040)
    assert m.cost(20) == pytest.approx(0.040, rel=0.15)


@pytest.mark.parametrize("seed", range(5))
def test_online_refinement_never_leaves_a_negative_base_or_per_row_cost(seed):
    """Traffic on a shared host: stalls, passes that get cheaper with rows, long runs of
    one row count. Whatever comes, both parameters stay >= 0 after every pass."""
    rng = random.Random(seed)
    for model in (CostModel(0.02, 0.001), CostModel(0.0, 0.0)):
        for i in range(400):
            phase = i // 100
            rows = 20 if phase == 1 else rng.choice((1, 2, 4, 8, 16, 32, 64))
            seconds = 0.012 + 0.0008 * rows
            if phase == 2:
                seconds = 0.060 - 0.0009 * rows   # reversed: more rows, fewer seconds
            if rng.random() < 0.05:
                seconds *= rng.choice((4, 10, 0.1))   # a stall, or a pass timed across a clock step
            model.observe(rows, seconds)
            assert model.theta[0] >= 0 and model.theta[1] >= 0, (i, model.describe())


def test_passes_that_get_cheaper_with_rows_leave_a_flat_cost_not_a_falling_one():
    m = CostModel(0.02, 0.001)
    for _ in range(100):
        m.observe(1, 0.030)
        m.observe(32, 0.010)   # least squares alone: 30.6 ms - 0.65 ms per row
    assert m.theta[1] == 0 and m.cost(1) == m.cost(64)
    assert 0.010 <= m.cost(32) <= 0.030


def test_a_lone_verified_decode_stays_speculative():
    # 19 OFF rows + 1 VERIFIED on the fast plan, no invariant pass this step: going
    # direct would add a whole invariant pass for one row.
    assert trained().choose(20, 0, [1], budget=100) == [False]


def test_a_step_with_an_invariant_pass_takes_decodes_along():
    # A replay of 3 rows already pays for a 16-row group: the decodes fill it.
    assert trained().choose(20, 3, [1, 4], budget=100) == [True, True]


def test_an_all_verified_batch_goes_direct():
    # Without the fast pass the step is one invariant pass and no replays follow.
    assert trained().choose(24, 0, [1] * 24, budget=100) == [True] * 24


def test_a_verified_minority_stays_speculative():
    # Three direct decodes would open a 16-row group for 3 rows; speculating, their
    # tokens are replayed later several to a row group.
    assert trained().choose(20, 0, [1, 1, 1], budget=100) == [False] * 3


def test_fixed_modes_and_the_token_budget():
    assert RoutePolicy("speculative").choose(8, 0, [1, 2], budget=100) == [False, False]
    assert RoutePolicy("direct").choose(8, 0, [1, 2], budget=100) == [True, True]
    # A direct decode with k unverified tokens needs k more rows than its fast row.
    assert RoutePolicy("direct").choose(8, 0, [5, 1, 30], budget=10) == [True, True, False]
    with pytest.raises(ValueError, match="adaptive, speculative, direct"):
        RoutePolicy("fastest")


class Switching(RoutePolicy):
    """Test policy: a random route per decode, so requests switch mid-way."""

    def __init__(self, seed):
        super().__init__("adaptive")
        self.rng = random.Random(seed)

    def choose(self, fast_rows, inv_rows, direct_rows, budget, waiting_rows=(), off_rows=()):
        out = []
        for rows in direct_rows:
            go = self.rng.random() < 0.5 and rows - 1 <= budget
            budget -= (rows - 1) if go else 0
            out.append(go)
        return out


@pytest.mark.parametrize("delay", [0, 3])
@pytest.mark.parametrize("route", ["speculative", "direct", "adaptive", "switching"])
def test_every_route_gives_the_reference_even_with_wrong_fast_tokens(route, delay):
    # The fast path is wrong at several positions, confidently (only W catches those)
    # and at a low margin (the margin replay may wait `delay` steps).
    script = {(rid, i): (47, m) for rid in ("a", "b", "c") for i, m in ((2, 10.0), (5, 0.1), (6, 10.0), (9, 0.1))}
    sched = make_scheduler(route=Switching(7) if route == "switching" else route, delay=delay)
    for rid in ("a", "b", "c"):
        sched.add(make_request(rid, PROMPT + [ord(rid)], max_tokens=14, window=4))
    done = run_all(sched, FakeRunner(script))
    for rid, req in done.items():
        assert req.output_ids == reference_output(PROMPT + [ord(rid)], 14, rid=rid)
        st = req.stats
        if route == "speculative":
            assert st.direct_steps == 0 and st.mismatches > 0
        elif route == "direct":
            assert st.decode_steps == 0 and st.direct_steps == 13   # out[0] comes from the prefill
        elif route == "switching":
            assert st.decode_steps > 0 and st.direct_steps > 0     # switched in the middle
        assert st.mismatches == sum(getattr(st, f"mismatches_{r}")
                                    for r in ("margin", "window", "finish", "direct"))


def test_off_decodes_fill_an_invariant_pass_or_drop_the_fast_pass():
    p = trained(group_rows=32)
    assert p.off_to_move(20, 0, (1,) * 20) == 0          # no invariant pass: nothing to ride along
    assert p.off_to_move(10, 10, (1,) * 10) == 10        # they fit the 32-row group's padding: no fast pass
    assert p.off_to_move(40, 10, (1,) * 30) == 22        # fill the padding; a second group costs more
    assert p.off_to_move(60, 10, (1,) * 20 + (3, 37)) == 20   # the chunks would open two more groups
    assert RoutePolicy("speculative", group_rows=32).off_to_move(20, 10, (1,) * 10) == 0   # fixed routes: never


@pytest.mark.parametrize("group_rows", [8, 0])
def test_off_requests_riding_on_invariant_passes_still_finish_and_verified_is_the_reference(group_rows):
    sched = make_scheduler(route=trained(group_rows=8) if group_rows else ungrouped(), delay=2)
    decodes, prefills = [], []
    for rid in ("v1", "v2"):
        sched.add(make_request(rid, PROMPT + [ord(rid[1])], max_tokens=10, window=3))
    for rid in ("o1", "o2", "o3"):
        sched.add(make_request(rid, PROMPT + [ord(rid[1]) + 5], max_tokens=10, mode=Mode.OFF))

    def on_step(s, plan):
        for x in plan.seqs:
            if x.request.mode is Mode.OFF:
                (decodes if x.decode else prefills).append(x.kind)

    done = run_all(sched, FakeRunner({("v1", 3): (47, 0.05)}), on_step=on_step)
    assert PlanKind.INVARIANT in decodes                      # OFF decodes did ride along
    if not group_rows:   # both plans cost alike: the OFF prompts join the VERIFIED prefill's pass
        assert set(prefills) == {PlanKind.INVARIANT}
    for rid, req in done.items():
        assert req.output_ids == reference_output(req.prompt_ids, 10, rid=rid)


def test_a_long_off_prefill_chunk_keeps_its_attention_on_the_fast_plan():
    sched = make_scheduler(route=ungrouped(), budget=256, num_blocks=128)
    sched.add(make_request("v", PROMPT + [1], max_tokens=6, window=3))
    sched.add(make_request("short", PROMPT + [2], max_tokens=6, mode=Mode.OFF))
    sched.add(make_request("long", list(range(1, 131)), max_tokens=6, mode=Mode.OFF))   # 130 x 130 > 128 x 128
    prefill_kind = {}

    def on_step(s, plan):
        for x in plan.seqs:
            if x.request.mode is Mode.OFF and x.num_tokens > 1:
                prefill_kind[x.request.request_id] = x.kind

    done = run_all(sched, FakeRunner({}), on_step=on_step)
    # Moving both would drop the fast pass, and the cost model (fitted on decodes) would
    # take it; the long chunk stays, so the short one has no pass to save either.
    assert prefill_kind == {"short": PlanKind.FAST, "long": PlanKind.FAST}
    for rid, req in done.items():
        assert req.output_ids == reference_output(req.prompt_ids, 6, rid=rid)


def test_an_unmeasured_invariant_group_is_priced_as_a_fast_pass_of_its_rows():
    p = RoutePolicy("adaptive", group_rows=32)
    assert p.invariant.cost(20) == p.fast.cost(32) and p.invariant.cost(40) == 2 * p.fast.cost(32)
    p.observe_pass("invariant", 20, 0.5)   # the first measurement replaces the guess
    assert p.invariant.cost(20) == 0.5
    p.observe_pass("invariant", 20, 1.0)
    assert p.invariant.cost(20) == pytest.approx(0.6)


def ungrouped(fast=(0.012, 0.0008), invariant=(0.012, 0.0008)):
    """A policy for an invariant plan without row groups, trained on known costs."""
    p = RoutePolicy("adaptive", group_rows=0)
    for rows in (1, 4, 8, 16, 20, 32, 48, 64) * 20:
        p.observe_pass("fast", rows, fast[0] + fast[1] * rows)
        p.observe_pass("invariant", rows, invariant[0] + invariant[1] * rows)
    return p


def test_an_ungrouped_invariant_plan_is_priced_per_pass_and_row():
    p = RoutePolicy("adaptive", group_rows=0)
    assert p.invariant.cost(7) == pytest.approx(p.fast.cost(7))   # the prior: a fast pass of as many rows
    p = ungrouped(invariant=(0.02, 0.001))
    assert p.invariant.cost(10) == pytest.approx(0.03, rel=0.05) and p.invariant.room(10) == 0


def test_when_both_plans_cost_alike_verified_goes_direct_and_off_rides_along():
    p = ungrouped()
    # One pass instead of two: the VERIFIED decodes go direct, and every OFF decode joins them.
    assert p.choose(20, 0, [1, 1], budget=100, off_rows=(1,) * 18) == [True, True]
    assert p.off_to_move(18, 2, (1,) * 18) == 18
    # Without VERIFIED rows there is no invariant pass to join.
    assert p.off_to_move(20, 0, (1,) * 20) == 0


def test_an_off_prefill_chunk_rides_along_too_so_verified_decodes_still_go_direct():
    p = ungrouped()
    # 12 OFF decodes and a 16-row OFF prefill chunk: moving them all leaves one pass.
    off = (1,) * 12 + (16,)
    assert p.choose(30, 0, [1, 1], budget=100, off_rows=off) == [True, True]
    assert p.off_to_move(28, 2, off) == 13
    # A first step that prefills both classes runs as one invariant pass.
    assert p.off_to_move(588, 72, (35, 45, 62) * 4 + (20,)) == 13


def test_a_dear_ungrouped_invariant_plan_keeps_a_verified_minority_speculative():
    p = ungrouped(invariant=(0.06, 0.004))
    assert p.choose(20, 0, [1], budget=100, off_rows=(1,) * 19) == [False]
