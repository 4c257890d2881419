"""Scheduler, gate and commit/rollback with a scripted fake runner (no model)."""
import random

import pytest

from fakes import EOS, FakeRunner, reference_output
from gateeng.engine.block_manager import BlockManager
from gateeng.request import (DeterminismParams, DeterminismStats, FinishReason, Mode, Request, SamplingParams,
                             StreamPolicy)
from gateeng.engine.route import RoutePolicy
from gateeng.engine.scheduler import Scheduler
from gateeng.step import PlanKind
from gateeng.engine.stopping import StopChecker
from gateeng.engine.verification import VerificationStage


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, route="speculative", delay=0):
    """A scheduler and its verification stage (as `sched.stage`, for `update`)."""
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_seqs, budget, RoutePolicy(route) if isinstance(route, str) else route, delay)
    sched.stage = VerificationStage(StopChecker({EOS}, max_model_len=1000))
    return sched


def update(sched, plan, outputs):
    sched.update(sched.stage.apply(plan, outputs))


def make_request(rid, prompt, max_tokens=12, mode=Mode.VERIFIED, tau=1.0, window=4,
                 policy=StreamPolicy.VERIFIED_ONLY):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens),
                   DeterminismParams(mode, stream_policy=policy), tau=tau, window=window)


def run_all(sched, runner, max_steps=2000, on_step=None):
    done = []
    for _ in range(max_steps):
        if not sched.has_work():
            break
        plan = sched.schedule()
        update(sched, plan, runner.run(plan))
        done += sched.finished
        sched.finished.clear()
        sched.blocks.check_integrity()
        if on_step:
            on_step(sched, plan)
    assert not sched.has_work(), "did not finish"
    assert sched.blocks.num_free == sched.blocks.num_blocks
    return {r.request_id: r for r in done}


PROMPT = [3, 1, 4, 1, 5, 9, 2]


@pytest.mark.parametrize("wrong_at, rolled_back", [(1, 4), (2, 3), (4, 1)],
                         ids=["first", "middle", "last"])
def test_mismatch_in_window_rolls_back_to_reference(wrong_at, rolled_back):
    # Output 0 comes from the invariant prefill; 1..4 are speculated; W=4 triggers at 4.
    runner = FakeRunner(script={("r", wrong_at): (47, 10.0)})
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, window=4))
    req = run_all(sched, runner)["r"]
    assert req.output_ids == reference_output(PROMPT, 12)
    assert req.stats.mismatches == 1
    assert req.stats.rolled_back_tokens == rolled_back
    assert req.stats.triggers_window >= 1


def test_all_accepted_gives_free_next_token():
    runner = FakeRunner()
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, max_tokens=6, window=4))
    req = run_all(sched, runner)["r"]
    assert req.output_ids == reference_output(PROMPT, 6)
    # prefill gives out[0]; fast gives 1..4; the replay confirms them and gives out[5].
    assert req.stats.decode_steps == 4 and req.stats.verify_passes == 1
    assert req.stats.replayed_tokens == 5 and req.stats.mismatches == 0


def test_low_margin_triggers_margin_reason_and_ties_always_trigger():
    runner = FakeRunner(script={("r", 2): (truth_at(2), 0.1), ("r", 3): (truth_at(3), 0.0)})
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, max_tokens=8, tau=0.0, window=100))
    req = run_all(sched, runner)["r"]
    assert req.output_ids == reference_output(PROMPT, 8)
    assert req.stats.triggers_margin == 1          # the tie; 0.1 >= tau=0 does not trigger
    assert req.stats.mismatches == 0


def truth_at(i):
    return reference_output(PROMPT, i + 1)[i]


def test_eos_appears_at_rollback():
    override = {("r", 3): EOS}
    runner = FakeRunner(invariant_override=override)
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, max_tokens=12, window=4))
    req = run_all(sched, runner)["r"]
    assert req.output_ids == reference_output(PROMPT, 12, override)
    assert req.output_ids[-1] == EOS and req.finish_reason is FinishReason.EOS
    assert req.stats.mismatches == 1


def test_eos_vanishes_at_rollback():
    runner = FakeRunner(script={("r", 2): (EOS, 10.0)})
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, max_tokens=10, window=4))
    req = run_all(sched, runner)["r"]
    assert req.output_ids == reference_output(PROMPT, 10)
    assert EOS not in req.output_ids and req.finish_reason is FinishReason.LENGTH
    assert req.stats.triggers_finish == 2 and req.stats.mismatches == 1   # the EOS, then max_tokens


def test_max_tokens_is_verified_before_finishing():
    runner = FakeRunner(script={("r", 5): (46, 10.0)})
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, max_tokens=6, window=100))
    req = run_all(sched, runner)["r"]
    assert req.output_ids == reference_output(PROMPT, 6)
    assert len(req.output_ids) == 6 and req.stats.triggers_finish >= 1


@pytest.mark.parametrize("window", [1, 2, 5])
@pytest.mark.parametrize("delay", [0, 10])
def test_window_caps_unverified_tokens(window, delay):
    # With every token below tau the margin replay would wait `delay` steps; W still caps.
    seen = []
    sched = make_scheduler(delay=delay)
    sched.add(make_request("r", PROMPT, max_tokens=20, window=window, tau=100.0 if delay else 1.0))
    done = run_all(sched, FakeRunner(), on_step=lambda s, p: seen.extend(r.num_unverified for r in s.running))
    assert max(seen) <= window
    assert done["r"].output_ids == reference_output(PROMPT, 20)


def test_a_margin_replay_waits_at_most_the_delay_and_joins_an_invariant_pass():
    """r's fast token 2 is a low-margin flip: its replay waits up to 3 steps, speculating
    on; when s arrives its invariant prefill is a pass r's replay joins at once."""
    sched = make_scheduler(delay=3)
    sched.add(make_request("r", PROMPT, max_tokens=30, window=100))
    runner = FakeRunner(script={("r", 2): (47, 0.05)})
    waits = []
    for _ in range(7):
        plan = sched.schedule()
        (seq,) = [s for s in plan.seqs if s.request.request_id == "r"]
        waits.append((seq.request.pending_age, seq.replay))
        update(sched, plan, runner.run(plan))
    # Step 1 prefills, 2 and 3 decode (the flip, triggered), 4-6 speculate on, 7 replays.
    assert waits == [(0, False)] * 4 + [(1, False), (2, False), (3, True)]
    sched.add(make_request("s", PROMPT + [8], max_tokens=4, window=100))
    for _ in range(3):
        plan = sched.schedule()
        update(sched, plan, runner.run(plan))
    r = [q for q in sched.running if q.request_id == "r"][0]
    assert r.stats.mismatches == 1 and r.stats.mismatches_margin == 1
    # A new margin flip while s prefills: r's replay rides along in the same step.
    runner.script[("r", len(r.output_ids))] = (47, 0.05)
    plan = sched.schedule()
    update(sched, plan, runner.run(plan))
    sched.add(make_request("t", PROMPT + [9], max_tokens=4, window=100))
    plan = sched.schedule()
    kinds = {s.request.request_id: (s.kind, s.replay) for s in plan.seqs}
    assert kinds["t"][0] is PlanKind.INVARIANT and kinds["r"] == (PlanKind.INVARIANT, True)
    update(sched, plan, runner.run(plan))
    done = run_all(sched, runner)
    assert done["r"].output_ids == reference_output(PROMPT, 30)


def test_waiting_for_verification_does_not_decode():
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, max_tokens=20, tau=100.0))   # every token triggers
    runner = FakeRunner()
    for _ in range(12):
        plan = sched.schedule()
        if not plan.seqs:
            break
        (seq,) = plan.seqs
        req = seq.request
        if req.pending_verify:
            assert seq.kind is PlanKind.INVARIANT and seq.replay
        update(sched, plan, runner.run(plan))


def test_off_requests_never_verify():
    runner = FakeRunner(script={("r", 2): (47, 0.0)})
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, max_tokens=6, mode=Mode.OFF))
    req = run_all(sched, runner)["r"]
    assert req.output_ids[2] == 47 and req.stats.verify_passes == 0
    assert runner.calls[PlanKind.INVARIANT] == 0


def test_preemption_under_kv_pressure_loses_nothing():
    sched = make_scheduler(num_blocks=12, block_size=4, budget=16, max_seqs=8)
    prompts = {f"r{i}": [i + 1, 2, 3, 4, 5, i] for i in range(8)}
    for rid, p in prompts.items():
        mode = Mode.VERIFIED if int(rid[1:]) % 2 else Mode.OFF
        sched.add(make_request(rid, p, max_tokens=10, mode=mode, window=3))
    done = run_all(sched, FakeRunner(script={("r1", 4): (45, 10.0)}))
    assert sched.num_preemptions > 0
    for rid, p in prompts.items():
        assert done[rid].output_ids == reference_output(p, 10, rid=rid), rid


def test_chunked_prefill_respects_budget():
    sched = make_scheduler(budget=5)
    prompt = list(range(1, 23))
    sched.add(make_request("r", prompt, max_tokens=4))
    sizes = []
    run_all(sched, FakeRunner(), on_step=lambda s, p: sizes.append(sum(x.num_tokens for x in p.seqs)))
    assert max(sizes) <= 5


def test_prefix_cache_verified_reuses_only_canonical_blocks():
    sched = make_scheduler()
    prompt = list(range(1, 14))                     # 3 full blocks of 4 before the last token
    sched.add(make_request("off", prompt, max_tokens=2, mode=Mode.OFF))
    run_all(sched, FakeRunner())
    sched.add(make_request("v1", prompt, max_tokens=2))
    v1 = run_all(sched, FakeRunner())["v1"]
    assert v1.num_cached_tokens == 0               # fast blocks are not canonical
    sched.add(make_request("v2", prompt, max_tokens=2))
    sched.add(make_request("off2", prompt, max_tokens=2, mode=Mode.OFF))
    done = run_all(sched, FakeRunner())
    assert done["v2"].num_cached_tokens == 12 and done["off2"].num_cached_tokens == 12


def test_abort_frees_blocks():
    sched = make_scheduler()
    sched.add(make_request("a", PROMPT, max_tokens=50))
    sched.add(make_request("b", PROMPT, max_tokens=3))
    runner = FakeRunner()
    for _ in range(3):
        plan = sched.schedule()
        update(sched, plan, runner.run(plan))
    aborted = sched.abort("a")
    assert aborted.finish_reason is FinishReason.ABORT
    done = run_all(sched, runner)
    assert done["b"].output_ids == reference_output(PROMPT, 3)


def test_eager_emits_high_margin_and_holds_low():
    runner = FakeRunner(script={("r", 3): (truth_at(3), 0.1)})
    sched = make_scheduler()
    req = make_request("r", PROMPT, max_tokens=8, tau=1.0, window=100, policy=StreamPolicy.EAGER)
    sched.add(req)
    limits = []
    run_all(sched, runner, on_step=lambda s, p: limits.append((len(req.output_ids), req.emit_limit(), req.num_verified - req.num_prompt)))
    # At some step EAGER let the client see more than is verified.
    assert any(lim > ver for _, lim, ver in limits)
    # The low-margin token (index 3) is never shown before verification.
    assert all(not (lim > 3 and ver <= 3) for _, lim, ver in limits)


def test_request_needing_every_block_is_not_aborted_behind_a_prefix_holder():
    """A waiting request that matched a cached prefix must not make an admitted
    request that needs the whole cache look impossible."""
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64, max_seqs=4)
    shared = [7, 7, 7, 7, 8, 8, 8, 8]
    sched.add(make_request("warm", shared + [1], max_tokens=1, mode=Mode.OFF))
    run_all(sched, FakeRunner())                   # leaves the shared blocks cached
    big_prompt = list(range(1, 26))                # 25 + 7 tokens = 32 slots = all 8 blocks
    small_prompt = shared + [2, 3]
    sched.add(make_request("big", big_prompt, max_tokens=7, mode=Mode.OFF))
    sched.add(make_request("small", small_prompt, max_tokens=4, mode=Mode.OFF))
    plan = sched.schedule()                        # big prefills 7 blocks; small matches a cached block
    assert [s.request.request_id for s in plan.seqs] == ["big"]
    update(sched, plan, FakeRunner().run(plan))
    done = run_all(sched, FakeRunner())
    assert done["big"].finish_reason is FinishReason.LENGTH
    assert done["big"].output_ids == reference_output(big_prompt, 7, rid="big")
    assert done["small"].output_ids == reference_output(small_prompt, 4, rid="small")


@pytest.mark.parametrize("seed", range(12))
def test_random_kv_pressure_never_aborts_an_admitted_request(seed):
    """Random arrivals, shared prefixes, VERIFIED rollbacks and client aborts on a
    cache a few requests fill. After every step: nothing finished with ABORT that a
    client did not abort, and the block accounting holds."""
    rng = random.Random(seed)
    bs = 4
    sched = make_scheduler(num_blocks=rng.randint(6, 12), block_size=bs, budget=rng.randint(8, 40),
                           max_seqs=rng.randint(2, 8), delay=seed % 3)
    capacity = sched.blocks.num_blocks * bs
    prefixes = [[rng.randrange(1, 40) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    script, prompts, aborted, done = {}, {}, set(), {}
    max_window = min(5, sched.token_budget - 1)
    for step in range(3000):
        if len(prompts) < 40 and rng.random() < 0.3:
            rid = f"r{len(prompts)}"
            prompt = rng.choice(prefixes) + [rng.randrange(1, 40) for _ in range(rng.randint(1, 10))]
            max_tokens = rng.randint(1, max(1, min(16, capacity - len(prompt))))
            assert sched.fits(len(prompt) + max_tokens)   # what the engine admits
            mode = rng.choice([Mode.OFF, Mode.VERIFIED])
            if mode is Mode.VERIFIED:
                for i in rng.sample(range(max_tokens), k=min(2, max_tokens)):
                    script[(rid, i)] = (rng.randrange(1, 40), rng.choice([0.0, 10.0]))
            prompts[rid] = prompt
            sched.add(make_request(rid, prompt, max_tokens=max_tokens, mode=mode,
                                   window=rng.randint(1, max_window), tau=rng.choice([0.0, 1.0])))
        if rng.random() < 0.02:
            live = [r.request_id for r in list(sched.waiting) + sched.running]
            if live:
                rid = rng.choice(live)
                aborted.add(rid)
                sched.abort(rid)
        plan = sched.schedule()
        update(sched, plan, FakeRunner(script).run(plan))
        for req in sched.finished:
            assert req.finish_reason is not FinishReason.ABORT or req.request_id in aborted, \
                f"seed {seed} step {step}: {req.request_id} aborted by the scheduler"
            done[req.request_id] = req
        sched.finished.clear()
        sched.blocks.check_integrity()
        if not sched.has_work() and len(prompts) >= 40:
            break
    assert not sched.has_work() and len(done) == len(prompts)
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert sched.num_preemptions > 0 or seed % 3   # the cache really is under pressure
    for rid, req in done.items():
        if rid not in aborted:
            want = reference_output(prompts[rid], req.params.max_tokens, rid=rid)
            assert req.output_ids == want, rid


@pytest.mark.parametrize("script, tau, window, reason, margin", [
    ({("r", 2): (47, 0.05)}, 1.0, 100, "margin", 0.05),     # the gate saw the low margin
    ({("r", 2): (47, 10.0)}, 1.0, 3, "window", 10.0),       # a confident flip: only W caught it
    ({("r", 5): (47, 10.0)}, 0.0, 100, "finish", 10.0),     # the last token: caught before finishing
], ids=["margin", "window", "finish"])
def test_mismatch_is_attributed_to_the_trigger_that_caught_it(script, tau, window, reason, margin):
    sched = make_scheduler()
    sched.add(make_request("r", PROMPT, max_tokens=6, tau=tau, window=window))
    req = run_all(sched, FakeRunner(script))["r"]
    assert req.output_ids == reference_output(PROMPT, 6)
    st = req.stats
    assert st.mismatches == 1 and getattr(st, f"mismatches_{reason}") == 1
    assert st.mismatches_margin + st.mismatches_window + st.mismatches_finish == st.mismatches
    assert sched.stage.mismatches == [(reason, margin)]


@pytest.mark.parametrize("route", ["speculative", "direct"])
def test_the_steps_counts_add_up_to_the_requests_stats(route):
    # Observers get only each step's increments (metrics, the route policy's trigger
    # rate); summed over a run they must equal every request's own counters.
    script = {("a", 2): (47, 0.05), ("a", 7): (truth_at(7), 0.0), ("b", 3): (47, 10.0),
              ("c", 5): (47, 10.0)}
    sched = make_scheduler(route=route)
    for rid, tau, window in (("a", 1.0, 100), ("b", 1.0, 3), ("c", 0.0, 100)):
        sched.add(make_request(rid, PROMPT, max_tokens=6 if rid == "c" else 10, tau=tau, window=window))
    sched.add(make_request("off", PROMPT, mode=Mode.OFF))
    totals = DeterminismStats()

    def drain(sched, plan):
        for name, value in vars(sched.stage.drain()[1]).items():
            totals.add(name, value)
    done = run_all(sched, FakeRunner(script), on_step=drain)
    want = {name: sum(getattr(r.stats, name) for r in done.values()) for name in vars(totals)}
    assert vars(totals) == want
    if route == "speculative":
        assert totals.mismatches == 3 and totals.triggers_margin >= 2 and totals.decode_steps > 0
    else:
        assert totals.direct_steps > 0 and totals.decode_steps == 0


@pytest.mark.parametrize("chunk", [4, 0])
def test_long_prompts_are_chunked_while_others_decode(chunk):
    """A decoding request gets a token every step while a long prompt prefills in
    chunks of at most max(chunk, decoding requests); with no cap (0) the prompt
    takes the whole budget. Alone, a prompt always gets the whole budget."""
    bm = BlockManager(128, 4)
    sched = Scheduler(bm, 8, 32, RoutePolicy("speculative"), 0, prefill_chunk=chunk)
    sched.stage = VerificationStage(StopChecker({EOS}, max_model_len=1000))
    runner = FakeRunner()
    sched.add(make_request("talk", PROMPT, max_tokens=40, mode=Mode.OFF))
    plan = sched.schedule()
    assert plan.seqs[0].num_tokens == len(PROMPT)          # alone: the whole prompt
    update(sched, plan, runner.run(plan))
    sched.add(make_request("long", list(range(1, 101)), max_tokens=2, mode=Mode.OFF))
    prefilled = []
    while sched.waiting or any(r.request_id == "long" and r.num_computed < 100 for r in sched.running):
        plan = sched.schedule()
        rows = {s.request.request_id: s.num_tokens for s in plan.seqs}
        assert rows["talk"] == 1                               # the decode runs every step
        prefilled.append(rows.get("long", 0))
        update(sched, plan, runner.run(plan))
    assert sum(prefilled) == 100
    assert max(prefilled) == (4 if chunk else 31)
