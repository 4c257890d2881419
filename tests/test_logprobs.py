"""Logprobs: what they are defined on, parity with transformers, and VERIFIED
logprobs that are bitwise the same alone and in a batch."""
import math

import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.request import DeterminismParams, Mode, SamplingParams
from tiny import hf_family, tiny_loaded

TINY = dict(num_kv_blocks=128, max_model_len=256, block_size=4, attention_split=8, invariant_rows=8,
            max_num_batched_tokens=64)
VERIFIED = DeterminismParams(Mode.VERIFIED)
PROMPT = [7, 3, 9, 11, 200, 13]


@pytest.fixture(scope="module")
def tiny():
    hf = hf_family("llama")
    engine = Engine(EngineConfig(dtype="float32", **TINY), loaded=tiny_loaded("float32", hf))
    yield hf, engine
    engine.shutdown()


def test_greedy_logprobs_are_the_models_log_softmax(tiny):
    hf, engine = tiny
    res = engine.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5))
    assert len(res.logprobs) == len(res.token_ids) == 6
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT + res.token_ids])).logits[0].float(), -1)
    for i, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        assert lp.token == tok and abs(lp.logprob - row[tok].item()) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(5).indices.tolist()
        assert lp.top[0] == (tok, lp.logprob)                    # greedy took the most likely token
        assert all(abs(v - row[t].item()) < 1e-4 for t, v in lp.top)


def test_sampled_logprobs_are_on_the_filtered_tempered_distribution(tiny):
    _, engine = tiny
    params = SamplingParams(temperature=0.7, top_k=4, max_tokens=8, seed=5, ignore_eos=True, logprobs=6)
    res = engine.generate(PROMPT, params)
    for tok, lp in zip(res.token_ids, res.logprobs):
        finite = [(t, v) for t, v in lp.top if v != float("-inf")]
        assert len(finite) == 4                                   # top-k keeps 4; the rest are -inf
        assert abs(sum(math.exp(v) for _, v in finite) - 1) < 1e-5   # renormalized over what is kept
        assert tok in [t for t, _ in finite] and lp.logprob == dict(finite)[tok]


def test_no_logprobs_unless_asked_and_bounds(tiny):
    _, engine = tiny
    assert engine.generate(PROMPT, SamplingParams(max_tokens=3)).logprobs == []
    with pytest.raises(ValueError, match="logprobs must be in"):
        engine.generate(PROMPT, SamplingParams(max_tokens=3, logprobs=21))


def test_verified_logprobs_survive_rollbacks_and_come_from_the_reference(tiny):
    hf, _ = tiny
    loaded = tiny_loaded("bfloat16", hf)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    ref = Engine(EngineConfig(dtype="bfloat16", plan="invariant", **TINY), loaded=loaded)
    want = ref.generate(PROMPT, params)
    ref.shutdown()
    noisy = Engine(EngineConfig(dtype="bfloat16", fast_logit_noise=0.5, verified_route="speculative", **TINY),
                   loaded=loaded)   # speculative: rollbacks must happen
    got = noisy.generate([PROMPT, [1, 2, 3], list(range(30, 60))], params, [VERIFIED, None, None])[0]
    noisy.shutdown()
    assert got.stats.mismatches > 0                              # the noise forced rollbacks
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


@pytest.mark.model
def test_verified_top5_logprobs_are_bitwise_the_same_alone_and_in_a_batch_of_32(smollm):
    loaded = smollm("bfloat16")
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=5)
    prompt = "Name three rivers in Europe."
    engine = Engine(EngineConfig(), loaded=loaded)
    try:
        alone = engine.generate(prompt, params, VERIFIED, chat=True)
        others = [f"Tell me fact {i} about {w}." for i, w in enumerate(["tea", "owls", "rain", "maps"] * 8)][:31]
        batch = engine.generate([prompt] + others, params, [VERIFIED] + [None] * 31, chat=True)
    finally:
        engine.shutdown()
    assert batch[0].token_ids == alone.token_ids
    assert batch[0].logprobs == alone.logprobs                   # floats compared exactly
    assert all(len(lp.top) == 5 for lp in alone.logprobs)


def test_prompt_logprobs_match_transformers_across_chunks_and_a_warm_prefix_cache(tiny):
    hf, _ = tiny
    # A 64-position step budget and a 16-position prefill cap: the prompt comes in chunks.
    engine = Engine(EngineConfig(dtype="float32", prefill_chunk=16, **TINY), loaded=tiny_loaded("float32", hf))
    prompt = list(range(3, 103))
    try:
        engine.generate([[1, 2]] + [prompt], SamplingParams(max_tokens=30, ignore_eos=True))   # warms the cache
        res = engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2))
    finally:
        engine.shutdown()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert len(res.prompt_logprobs) == len(prompt) - 1 and res.logprobs == []
    for j, lp in enumerate(res.prompt_logprobs):
        assert lp.token == prompt[j + 1] and abs(lp.logprob - ref[j, prompt[j + 1]].item()) < 1e-4
        assert [t for t, _ in lp.top] == ref[j].topk(2).indices.tolist()


def test_verified_prompt_logprobs_are_the_same_alone_and_in_a_batch(tiny):
    hf, _ = tiny
    loaded = tiny_loaded("bfloat16", hf)
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=3)
    engine = Engine(EngineConfig(dtype="bfloat16", **TINY), loaded=loaded)
    try:
        alone = engine.generate(PROMPT * 5, params, VERIFIED)
        batch = engine.generate([list(range(40, 90)), PROMPT * 5, [5] * 20], params, [None, VERIFIED, None])[1]
    finally:
        engine.shutdown()
    assert batch.prompt_logprobs == alone.prompt_logprobs and batch.logprobs == alone.logprobs
    assert len(alone.prompt_logprobs) == len(PROMPT) * 5 - 1


@pytest.mark.model
def test_off_logprobs_of_the_embedded_model_match_float32_transformers(smollm):
    """In float32 the engine's OFF logprobs (fast plan) are transformers' log-softmax.
    (In bf16 they differ by up to ~0.2 from float32 transformers: bf16 precision.)"""
    from transformers import AutoModelForCausalLM

    from gateeng.model.loader import default_model_path, ensure_hf_dir
    hf = AutoModelForCausalLM.from_pretrained(ensure_hf_dir(default_model_path()), dtype=torch.float32).eval()
    # An OFF request only: a fixed VERIFIED route, so the start-up prices no routes.
    engine = Engine(EngineConfig(dtype="float32", verified_route="speculative"), loaded=smollm("float32"))
    try:
        res = engine.generate("Name three rivers in Europe.",
                              SamplingParams(max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5), chat=True)
        ids = engine.encode("Name three rivers in Europe.", chat=True)
    finally:
        engine.shutdown()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids + res.token_ids])).logits[0].float(), -1)
    rows = [(len(ids) - 1 + i, lp) for i, lp in enumerate(res.logprobs)] + list(enumerate(res.prompt_logprobs))
    for pos, lp in rows:
        assert abs(lp.logprob - ref[pos, lp.token].item()) < 1e-2
        assert all(abs(v - ref[pos, t].item()) < 1e-2 for t, v in lp.top)
