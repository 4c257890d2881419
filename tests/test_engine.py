"""Engine API on the tiny model: generate, stream, abort, bad input, seeded sampling."""
import asyncio
import math

import pytest

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.outputs import Chunk, Completion
from gateeng.plans.generic import InvariantPlan
from gateeng.request import DeterminismParams, FinishReason, Mode, SamplingParams
from tiny import tiny_loaded


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(dtype="float32", num_kv_blocks=24, max_model_len=96, block_size=4,
                            attention_split=8, invariant_rows=8, max_num_batched_tokens=64),
               loaded=tiny_loaded("float32"))
    yield e
    e.shutdown()
    e.core.blocks.check_integrity()


GOOD = SamplingParams(max_tokens=8, ignore_eos=True)
VERIFIED = DeterminismParams(Mode.VERIFIED)


@pytest.mark.parametrize("prompt, params, det, match", [
    ("", GOOD, None, "prompt is empty"),
    ([], GOOD, None, "prompt is empty"),
    ([1, 2, 300], GOOD, None, "outside the vocabulary"),
    ([-1], GOOD, None, "outside the vocabulary"),
    (list(range(1, 97)), GOOD, None, "context holds 96"),
    ([1, 2], SamplingParams(temperature=-0.5), None, "temperature"),
    ([1, 2], SamplingParams(temperature=math.nan), None, "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), None, "top_p"),
    ([1, 2], SamplingParams(top_p=1.5), None, "top_p"),
    ([1, 2], SamplingParams(max_tokens=0), None, "max_tokens"),
    ([1, 2], GOOD, DeterminismParams(Mode.VERIFIED, margin_threshold=math.nan), "margin_threshold"),
    ([1, 2], GOOD, DeterminismParams(Mode.VERIFIED, max_window=0), "max_window"),
])
def test_bad_input_is_rejected_and_others_keep_running(engine, prompt, params, det, match):
    ok = engine.submit([5, 6, 7], GOOD)
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, params, det)
    assert ok.result(timeout=60).completion_tokens == 8


def collect(engine, prompt, params, det=None):
    async def go():
        ids, text, final = [], "", None
        async for ev in engine.stream(prompt, params, det):
            if isinstance(ev, Chunk):
                assert ev.position == len(ids)
                ids += ev.token_ids
                text += ev.text
            elif isinstance(ev, Completion):
                final = ev
        return ids, text, final
    return asyncio.run(go())


def test_stream_is_its_own_completion_and_verified_matches_unary(engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    # OFF promises no repeat across calls, only that a stream adds up to its own result.
    ids, text, final = collect(engine, [9, 8, 7, 6], params)
    assert ids == final.token_ids and len(ids) == 12
    assert text == final.text == engine.tokenizer.decode(final.token_ids)
    assert final.finish_reason is FinishReason.LENGTH
    # VERIFIED promises the same bits on every route.
    unary = engine.generate([9, 8, 7, 6], params, VERIFIED)
    ids, text, final = collect(engine, [9, 8, 7, 6], params, VERIFIED)
    assert ids == final.token_ids == unary.token_ids
    assert text == final.text == unary.text


def test_abort_mid_generation_frees_kv(engine):
    h = engine.submit([1, 2, 3], SamplingParams(max_tokens=80, ignore_eos=True))
    next(iter(h))   # first chunk arrived
    assert engine.abort(h.request_id)
    c = h.result(timeout=30)
    assert c.finish_reason is FinishReason.ABORT
    engine.generate([4, 4], GOOD)   # engine still serves
    assert engine.core.blocks.num_free == engine.core.blocks.num_blocks, "KV blocks leaked"


def test_seeded_sampling_repeats_and_seeds_differ(engine):
    """A seed names the same tokens alone and in a batch: promised for VERIFIED."""
    def run(seed, n_other):
        p = SamplingParams(temperature=0.8, seed=seed, max_tokens=16, ignore_eos=True)
        others = [[i + 3, i + 5] for i in range(n_other)]
        res = engine.generate([[10, 20, 30]] + others, [p] + [GOOD] * n_other, [VERIFIED] + [None] * n_other)
        return res[0].token_ids
    a = run(7, 0)
    assert run(7, 3) == a
    assert run(8, 0) != a


@pytest.mark.parametrize("temperature", [1e-38, 1e-37, 1e-6])
def test_temperature_below_the_floor_is_greedy(engine, temperature):
    greedy = engine.generate([3, 1, 4], GOOD, VERIFIED)
    tiny = engine.generate([3, 1, 4], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True),
                           VERIFIED)
    assert tiny.token_ids == greedy.token_ids and tiny.seed is None


def test_stop_strings_and_stop_ids(engine):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    free = engine.generate([3, 1, 4], params, VERIFIED).token_ids
    stop_id = free[4]
    res = engine.generate([3, 1, 4], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(stop_id,)),
                          VERIFIED)
    assert res.token_ids == free[:free.index(stop_id) + 1] and res.finish_reason is FinishReason.STOP


def test_verified_equals_reference_on_tiny_model(engine):
    ref_engine = Engine(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=128, block_size=4,
                                     attention_split=8, invariant_rows=8, plan="invariant",
                                     max_num_batched_tokens=64), loaded=engine.loaded)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    want = ref_engine.generate([[11, 12, 13, 14, 15]], params)[0].token_ids
    ref_engine.shutdown()
    det = DeterminismParams(Mode.VERIFIED)
    got = engine.generate([[11, 12, 13, 14, 15], [1, 2], [3, 4, 5]], params, [det, None, None])
    assert got[0].token_ids == want
    # Every token after the prefill's comes from a decode step on either route or from
    # a speculative verify pass (the verifier's next token, free); a mismatch removes
    # the rolled-back tokens.
    st = got[0].stats
    counted = st.decode_steps + st.direct_steps - st.rolled_back_tokens
    assert counted <= 19 <= counted + st.verify_passes


def test_queue_full_is_backpressure_not_memory():
    from gateeng.engine.errors import QueueFull
    e = Engine(EngineConfig(dtype="float32", num_kv_blocks=64, max_model_len=128, block_size=4, attention_split=8,
                            invariant_rows=8, max_num_batched_tokens=64, max_queue=2, max_num_seqs=2),
               loaded=tiny_loaded("float32"))
    handles = e.submit_many([[1, 2]] * 4, SamplingParams(max_tokens=30, ignore_eos=True))
    with pytest.raises(QueueFull, match="retry later"):
        e.submit([3, 4], GOOD)
    assert all(h.result(timeout=60).completion_tokens == 30 for h in handles)
    assert e.submit([3, 4], GOOD).result(timeout=60).completion_tokens == 8   # room again
    e.shutdown()


def test_verified_refused_when_self_check_failed(engine):
    from gateeng.engine.errors import DeterminismUnavailable
    from gateeng.plans.selfcheck import SelfCheckResult
    real = engine.selfcheck
    engine.core.selfcheck = SelfCheckResult(False, ["matmul: alone vs batch"])
    try:
        with pytest.raises(DeterminismUnavailable, match="self-check FAILED"):
            engine.submit([1, 2], GOOD, DeterminismParams(Mode.VERIFIED))
        assert engine.generate([1, 2], GOOD).completion_tokens == 8   # OFF still served
    finally:
        engine.core.selfcheck = real


def test_selfcheck_detects_a_batch_dependent_plan():
    """The start-up check must fail for a plan whose matmul depends on the batch."""
    from gateeng.plans.selfcheck import run_selfcheck

    class Leaky(InvariantPlan):
        @staticmethod
        def linear(x, w):
            return torch.nn.functional.linear(x, w) + x.mean() * 1e-3   # other rows leak in

    import torch
    res = run_selfcheck(Leaky(rows=8, split=8), 64, 4, 2, 16, torch.float32, 4)
    assert not res.passed and any("matmul" in f for f in res.failures)
    assert run_selfcheck(InvariantPlan(rows=8, split=8), 64, 4, 2, 16, torch.float32, 4).passed


def test_selfcheck_holds_only_plans_with_sparse_greedy_to_the_exact_logits(monkeypatch):
    """Exact logits decide greedy tokens only where the plan skips dense logits: a
    batch-dependent sum there fails the check, and does not fail a dense plan (the
    reference), which never computes them."""
    import torch
    from gateeng.plans import selfcheck

    def leaky(hidden, weight, rows, ids):
        return (hidden.index_select(0, rows).float() * weight.index_select(0, ids)).sum(-1) + rows.numel() * 1e-3
    monkeypatch.setattr(selfcheck, "exact_logits", leaky)

    class Dense(InvariantPlan):
        sparse_greedy = False

    sparse = selfcheck.run_selfcheck(InvariantPlan(rows=8, split=8), 64, 4, 2, 16, torch.float32, 4)
    assert sparse.failures == ["exact logits: one pair alone vs among many"]
    assert selfcheck.run_selfcheck(Dense(rows=8, split=8), 64, 4, 2, 16, torch.float32, 4).passed


def test_every_completion_carries_the_engine_reproducibility_record(engine):
    from gateeng.reproducibility import cpu_model_and_isa
    off = engine.generate([1, 2, 3], GOOD)
    ver = engine.generate([1, 2, 3], GOOD, VERIFIED)
    assert off.reproducibility is ver.reproducibility is engine.reproducibility
    r = engine.reproducibility
    assert (r.device_name, r.isa) == cpu_model_and_isa()
    assert r.model_fingerprint == engine.loaded.fingerprint
    assert r.kernel_plan == "fast; " + engine.invariant_plan.describe("float32")
    assert r.kernel_plan.startswith("fast; invariant-v4(rows=8,matmul=torch_mm,")   # float32: no packed weights


def test_kernel_plan_names_what_the_canonical_bits_depend_on():
    from types import SimpleNamespace
    packed, kernels = {1: None}, SimpleNamespace(digest="0123abcd4567")
    assert InvariantPlan(32, 64, packed, kernels, 16).describe() == (
        "invariant-v4(rows=32,matmul=onednn_packed,attention=cpu_paged(block=16),norm_rope_silu=cpu,"
        "cpu_ops=0123abcd4567,greedy_lm_head=bf16+exact_top2)")
    assert InvariantPlan(32, 64, packed, kernels, 16, "cpu_dpbf16").describe() == (
        "invariant-v4(rows=32,matmul=cpu_dpbf16,attention=cpu_paged(block=16),norm_rope_silu=cpu,"
        "cpu_ops=0123abcd4567,greedy_lm_head=bf16+exact_top2)")
    assert InvariantPlan(8, 64).describe() == (
        "invariant-v4(rows=8,matmul=torch_mm,attention=split(64),norm_rope_silu=torch,greedy_lm_head=bf16+exact_top2)")
    assert InvariantPlan(8, 32, packed).describe("float32") == (
        "invariant-v4(rows=8,matmul=torch_mm,attention=split(32),norm_rope_silu=torch)")


def test_only_the_row_invariant_matmul_with_the_kernels_drops_the_row_groups():
    from types import SimpleNamespace
    kernels = SimpleNamespace(digest="0")
    assert InvariantPlan(32, 64, {1: None}, kernels, 16, "cpu_dpbf16").group_rows == 0
    assert InvariantPlan(32, 64, {1: None}, None, 16, "cpu_dpbf16").group_rows == 32   # torch attention: groups
    assert InvariantPlan(32, 64, {1: None}, kernels, 16).group_rows == 32             # oneDNN: groups


@pytest.mark.parametrize("max_model_len, kv_blocks, want", [
    (0, 24, 96),              # the model allows 512; the KV cache holds 96
    (0, 1024, 512),           # the model's limit
    (200, 1024, 200),
    (600, 1024, "above the model's limit 512"),
    (128, 24, "does not fit the KV cache"),
])
def test_max_model_len_is_checked_against_the_model_and_the_kv_cache(max_model_len, kv_blocks, want):
    from gateeng.engine.core import resolve_max_model_len
    cfg = EngineConfig(max_model_len=max_model_len, num_kv_blocks=kv_blocks, block_size=4)
    mc = tiny_loaded("float32").config
    if isinstance(want, int):
        assert resolve_max_model_len(cfg, mc) == want
    else:
        with pytest.raises(ValueError, match=want):
            resolve_max_model_len(cfg, mc)


def test_the_default_kv_cache_is_sized_for_max_num_seqs_and_max_model_len():
    from gateeng.config import KV_POSITIONS_PER_SEQ, kv_blocks
    from gateeng.engine.core import resolve_max_model_len
    mc = tiny_loaded("float32").config                 # its limit: 512 positions
    assert kv_blocks(EngineConfig(num_kv_blocks=24, block_size=4)) == 24   # given: taken as it is
    for seqs in (1, 2, 64):
        cfg = EngineConfig(max_num_seqs=seqs, block_size=4)
        assert kv_blocks(cfg) == seqs * KV_POSITIONS_PER_SEQ // 4
        assert resolve_max_model_len(cfg, mc) == min(512, seqs * KV_POSITIONS_PER_SEQ)
    cfg = EngineConfig(max_num_seqs=1, max_model_len=500, block_size=4)   # one whole request must fit
    assert kv_blocks(cfg) == 125 and resolve_max_model_len(cfg, mc) == 500


def test_a_sliding_window_caps_the_context_so_full_attention_stays_exact():
    import dataclasses
    from gateeng.engine.core import resolve_max_model_len
    mc = dataclasses.replace(tiny_loaded("float32").config, sliding_window=64)
    assert resolve_max_model_len(EngineConfig(num_kv_blocks=1024, block_size=4), mc) == 64
    with pytest.raises(ValueError, match="sliding window"):
        resolve_max_model_len(EngineConfig(max_model_len=65, num_kv_blocks=1024, block_size=4), mc)


def test_teacher_forced_runs_a_plan_along_given_tokens_on_borrowed_kv_blocks():
    """The invariant plan fed the reference's own tokens predicts each next one, every
    sequence in one pass per step, and the KV blocks it borrowed are all free again."""
    from gateeng.engine.core import EngineCore
    from gateeng.step import PlanKind

    core = EngineCore(EngineConfig(dtype="float32", num_kv_blocks=24, max_model_len=96, block_size=4,
                                   attention_split=8, invariant_rows=8, plan="invariant",
                                   max_num_batched_tokens=64), loaded=tiny_loaded("float32"))
    prompts = [[11, 12, 13, 14, 15], [1, 2], [3, 4, 5]]
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    handles = [core.add_request(core.new_request(p, params)) for p in prompts]
    while core.has_work():
        core.step()
    refs = [h.result().token_ids for h in handles]
    free = core.blocks.num_free
    steps = core.teacher_forced(prompts, [r[:-1] for r in refs], PlanKind.INVARIANT)
    assert len(steps) == 8 and all(len(tokens) == len(margins) == 3 for tokens, margins, _ in steps)
    assert all(routers == [math.inf] * 3 for _, _, routers in steps)   # a dense model: no router
    assert [[tokens[i] for tokens, _, _ in steps] for i in range(3)] == [r[1:] for r in refs]
    assert core.blocks.num_free == free
    core.blocks.check_integrity()
    with pytest.raises(ValueError, match="one forced token list per prompt"):
        core.teacher_forced(prompts, [refs[0][:2], refs[1][:3], refs[2][:2]])
