"""VERIFIED requests on SmolLM2-135M in bf16 on this CPU. Every VERIFIED output must
equal the canonical reference (an engine with plan=invariant) token for token.

With the C++ kernels the fast path's bits may not move with the batch at all (on CPUs
where the start-up probe picks the row-invariant matmul at every row count, every
fast-plan op is row-invariant), so the tests with teeth also run on the torch ops
(no C++ kernels, plain weights), where they do move."""
import asyncio
import random

import pytest

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.outputs import Chunk, Completion, Rollback
from gateeng.request import DeterminismParams, Mode, SamplingParams, StreamPolicy

pytestmark = pytest.mark.model

TARGETS = [
    "Write a story about a dragon who learns to paint.",
    "Explain how a refrigerator works.",
    "What are the benefits of learning a second language?",
    "Describe a day in the life of a medieval blacksmith.",
]
N_TOKENS = 48
VERIFIED = DeterminismParams(Mode.VERIFIED)
GREEDY = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)


def fillers(n, seed):
    rng = random.Random(seed)
    words = "sun river code market poem engine winter garden ocean theory music city".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def loaded(smollm):
    return smollm("bfloat16")


@pytest.fixture(scope="module")
def ref_engine(loaded):
    e = Engine(EngineConfig(plan="invariant"), loaded=loaded)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def engine(loaded):
    e = Engine(EngineConfig(), loaded=loaded)
    yield e
    e.shutdown()
    e.core.blocks.check_integrity()


@pytest.fixture(scope="module")
def reference(ref_engine):
    return [c.token_ids for c in ref_engine.generate(TARGETS, GREEDY, chat=True)]


TORCH_OPS = dict(cpu_kernels=False, pack_fast_weights=False)   # F.linear on the plain weights, torch attention


@pytest.fixture(scope="module")
def torch_engines(loaded):
    """(engine, reference engine) on the torch ops, where the fast plan is batch-variant."""
    e, r = Engine(EngineConfig(**TORCH_OPS), loaded=loaded), Engine(EngineConfig(plan="invariant", **TORCH_OPS),
                                                                   loaded=loaded)
    yield e, r
    e.shutdown()
    r.shutdown()
    e.core.blocks.check_integrity()


def run_in_batch(engine, size, det, seed=0, params=GREEDY):
    """All targets plus filler OFF traffic, `size` requests in all (or each target alone)."""
    if size == 1:
        return [engine.generate(t, params, det, chat=True).token_ids for t in TARGETS]
    n_fill = max(0, size - len(TARGETS))
    rng = random.Random(seed)
    # Fillers of mixed lengths keep the batch shape changing while the targets decode.
    fill_params = [SamplingParams(max_tokens=rng.randint(8, params.max_tokens), temperature=0.7, seed=seed + i,
                                  ignore_eos=True) for i in range(n_fill)]
    prompts = TARGETS + fillers(n_fill, seed)
    ps = [params] * len(TARGETS) + fill_params
    ds = [det] * len(TARGETS) + [None] * n_fill
    res = engine.generate(prompts, ps, ds, chat=True)
    return [r.token_ids for r in res[:len(TARGETS)]]


@pytest.fixture(scope="module")
def batch_runs(engine):
    """{("verified", size): outputs of the targets} for batch sizes 1..32."""
    return {("verified", size): run_in_batch(engine, size, VERIFIED, seed=size) for size in (1, 4, 12, 32)}


def test_1_verified_is_identical_to_reference_at_every_batch_size(batch_runs, reference):
    for i, want in enumerate(reference):
        outs = {tuple(batch_runs[("verified", s)][i]) for s in (1, 4, 12, 32)}
        assert len(outs) == 1, f"target {i}: {len(outs)} distinct outputs"
        assert list(outs.pop()) == want


def test_2_where_the_batch_moves_off_output_verified_still_gives_the_reference(torch_engines):
    """Teeth for test 1: on the torch ops, without verification the batch changes the
    output; VERIFIED on the same engine still equals that plan's reference. 24 tokens:
    alone and in a batch of 32, OFF output of this CPU's torch ops parted at tokens 4
    and 21 (of the first two targets)."""
    engine, ref_engine = torch_engines
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [c.token_ids for c in ref_engine.generate(TARGETS, params, chat=True)]
    off = {s: run_in_batch(engine, s, None, seed=s, params=params) for s in (1, 32)}
    distinct = [len({tuple(off[s][i]) for s in off}) for i in range(len(TARGETS))]
    assert max(distinct) > 1, distinct
    for s in (1, 32):
        assert run_in_batch(engine, s, VERIFIED, seed=s, params=params) == want


def test_3_prefix_cache_and_chunk_budgets(loaded, ref_engine):
    base = "You are a careful assistant. Answer in one paragraph. " * 3
    prompts = [base[:n] + q for n in (0, 60, len(base)) for q in (" Why is the sky blue?", " Name a prime.")]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [c.token_ids for c in ref_engine.generate(prompts, params)]
    for budget in (16, 48, 512):
        e = Engine(EngineConfig(max_num_batched_tokens=budget, max_window=min(32, budget - 1)), loaded=loaded)
        # OFF traffic first fills the prefix cache with fast (non-canonical) blocks.
        e.generate(prompts[2:], params)
        cold = e.generate(prompts, params, VERIFIED)
        warm = e.generate(prompts, params, VERIFIED)
        assert any(c.cached_tokens > 0 for c in warm)
        assert [c.token_ids for c in cold] == want, f"cold, budget {budget}"
        assert [c.token_ids for c in warm] == want, f"warm, budget {budget}"
        e.shutdown()
        e.core.blocks.check_integrity()


def test_4_seeded_sampling(engine, ref_engine):
    def params(seed):
        return SamplingParams(max_tokens=24, temperature=0.8, seed=seed, ignore_eos=True)
    want = ref_engine.generate(TARGETS[0], params(11), chat=True).token_ids
    for size in (1, 12):
        got = run_in_batch(engine, size, VERIFIED, seed=size, params=params(11))[0]
        assert got == want, f"batch {size}"
    other = engine.generate(TARGETS[0], params(12), VERIFIED, chat=True).token_ids
    assert other != want


def collect_stream(engine, prompt, params, det):
    async def go():
        events = []
        async for ev in engine.stream(prompt, params, det, chat=True):
            events.append(ev)
        return events
    return asyncio.run(go())


def test_5_streaming_matches_unary_and_verified_only_never_retracts(engine, reference):
    events = collect_stream(engine, TARGETS[1], GREEDY, VERIFIED)
    assert not any(isinstance(e, Rollback) for e in events)
    streamed = [t for e in events if isinstance(e, Chunk) for t in e.token_ids]
    final = events[-1]
    assert isinstance(final, Completion)
    assert streamed == final.token_ids == reference[1]
    assert engine.generate(TARGETS[1], GREEDY, VERIFIED, chat=True).token_ids == reference[1]


def test_6_rollback_with_a_known_cause(loaded, reference):
    """Noise on the fast path's logits makes it pick wrong tokens; the verifier must
    catch every one (rollbacks > 0) and the output must still be the reference. The
    speculative route: the adaptive one may decode every token directly on the
    invariant plan, where nothing is rolled back."""
    n = 24   # a greedy decode's first n tokens are the reference's first n
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    e = Engine(EngineConfig(fast_logit_noise=2.0, verified_route="speculative"), loaded=loaded)
    res = e.generate(TARGETS[:2], params, VERIFIED, chat=True)
    assert [r.token_ids for r in res] == [r[:n] for r in reference[:2]]
    assert sum(r.stats.mismatches for r in res) > 0
    assert sum(r.stats.rolled_back_tokens for r in res) > 0
    # EAGER streams may retract, but the final result is still the reference.
    eager = DeterminismParams(Mode.VERIFIED, stream_policy=StreamPolicy.EAGER)
    events = collect_stream(e, TARGETS[2], params, eager)
    assert events[-1].token_ids == reference[2][:n]
    e.shutdown()
    e.core.blocks.check_integrity()


def test_window_only_mode_tau_zero(engine, reference):
    det = DeterminismParams(Mode.VERIFIED, margin_threshold=0.0, max_window=8)
    res = run_in_batch(engine, 6, det, seed=5)
    assert res == reference


@pytest.mark.parametrize("route", ["direct", "adaptive", "switching"])
def test_7_every_verified_route_gives_the_reference(loaded, reference, route):
    """Speculative or direct, chosen per step (randomly for "switching", so requests
    change route mid-way), with a noisy fast path and OFF traffic in the batch."""
    from test_route import Switching
    n = 24
    e = Engine(EngineConfig(fast_logit_noise=2.0, verified_route="adaptive" if route == "switching" else route),
               loaded=loaded)
    if route == "switching":
        e.core.scheduler.route = Switching(3)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    prompts = TARGETS[:2] + fillers(4, 11)
    res = e.generate(prompts, params, [VERIFIED] * 2 + [None] * 4, chat=True)
    assert [r.token_ids for r in res[:2]] == [r[:n] for r in reference[:2]]
    for r in res[:2]:
        if route == "direct":
            assert r.stats.decode_steps == 0 and r.stats.direct_steps == n - 1
        if route == "switching":
            assert r.stats.decode_steps > 0 and r.stats.direct_steps > 0
    e.shutdown()
    e.core.blocks.check_integrity()

