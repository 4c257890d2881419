"""Each supported family (Llama 2 and 3.x, Mistral, Qwen2/2.5, Qwen3) against
transformers on a tiny random-weight model built from its config: float32 logits
at every position, greedy output, and VERIFIED == reference in a batch."""
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.model.families import config_from_hf
from gateeng.engine.engine import Engine
from gateeng.plans.generic import FastPlan, InvariantPlan
from gateeng.request import DeterminismParams, Mode, SamplingParams
from test_model import prefill_logits
from tiny import FAMILIES, hf_family, tiny_loaded

TINY = dict(num_kv_blocks=128, max_model_len=256, block_size=4, attention_split=8, invariant_rows=8,
            max_num_batched_tokens=64)
SEQS = [list(range(5, 45)), [7, 3, 9, 11, 200, 13], list(range(100, 121))]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, hf_family(request.param)


def test_config_reads_the_family_terms(family):
    name, hf = family
    cfg = config_from_hf(hf.config)
    assert cfg.qkv_bias == (name == "qwen2") and cfg.qk_norm == (name == "qwen3") and not cfg.o_bias
    assert cfg.head_dim == (32 if name == "qwen3" else 16)
    assert cfg.sliding_window == (4096 if name == "mistral" else None)
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if name == "llama3" else None)


@pytest.mark.parametrize("plan", [FastPlan(), InvariantPlan(rows=8, split=8)], ids=["fast", "invariant"])
def test_float32_logits_match_transformers_at_every_position(family, plan):
    _, hf = family
    loaded = tiny_loaded("float32", hf)
    ours = prefill_logits(loaded, plan, SEQS, chunk=7)
    for s, lg in zip(SEQS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0].float()
        assert (lg - ref).abs().max().item() < 1e-3


def test_greedy_output_equals_transformers_generate(family):
    _, hf = family
    engine = Engine(EngineConfig(dtype="float32", **TINY), loaded=tiny_loaded("float32", hf))
    try:
        for prompt in SEQS[1:]:
            ours = engine.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True)).token_ids
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                  pad_token_id=0)
            assert ours == out[0, len(prompt):].tolist()
    finally:
        engine.shutdown()


def test_verified_in_a_batch_equals_the_reference_in_bf16(family):
    _, hf = family
    loaded = tiny_loaded("bfloat16", hf)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = Engine(EngineConfig(dtype="bfloat16", plan="invariant", **TINY), loaded=loaded)
    want = ref.generate(SEQS[0], params).token_ids
    ref.shutdown()
    # A noisy fast path provokes rollbacks; the batch around the VERIFIED request changes
    # the fast plan's shapes at every step.
    engine = Engine(EngineConfig(dtype="bfloat16", fast_logit_noise=0.5, **TINY), loaded=loaded)
    try:
        got = engine.generate([SEQS[0], SEQS[1], SEQS[2], [9] * 30], params,
                              [DeterminismParams(Mode.VERIFIED), None, None, None])
    finally:
        engine.shutdown()
    assert got[0].token_ids == want
    assert got[0].stats.triggers + got[0].stats.direct_steps > 0


def test_a_saved_model_directory_loads_through_model_flag_path(family, tmp_path):
    """`--model DIR`: the loader accepts every family and the engine serves it."""
    from gateeng.model.loader import load
    from tiny import save_family
    name, hf = family
    save_family(name, tmp_path)
    loaded = load(str(tmp_path), "float32")
    assert loaded.config.architecture == hf.config.model_type
    assert loaded.config == config_from_hf(hf.config)
    engine = Engine(EngineConfig(dtype="float32", **TINY), loaded=loaded)
    try:
        res = engine.generate("hi there", SamplingParams(max_tokens=8, ignore_eos=True), chat=True)
    finally:
        engine.shutdown()
    from transformers import AutoTokenizer
    with torch.no_grad():
        ids = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "hi there"}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert res.token_ids == want[0, len(ids):].tolist()
