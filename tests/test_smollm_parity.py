"""The real model: our engine against transformers on SmolLM2-135M in float32."""
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.model.loader import default_model_path, ensure_hf_dir
from gateeng.request import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
MIXED = PROMPTS + ["Hi", "List three colors:", "The quick brown fox jumps over the lazy dog. Then the dog",
                   "1, 2, 3, 4,", "Water boils at"]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(ensure_hf_dir(default_model_path()), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(smollm):
    # OFF requests only: a fixed VERIFIED route, so the start-up prices no routes.
    e = Engine(EngineConfig(dtype="float32", num_kv_blocks=512, verified_route="speculative"), loaded=smollm("float32"))
    yield e
    e.shutdown()


def test_logits_match_hf_at_every_position(engine, hf_model):
    from gateeng.plans.generic import FastPlan
    from test_model import prefill_logits
    tok = engine.tokenizer
    seqs = [tok.encode(p) for p in PROMPTS]
    ours = prefill_logits(engine.loaded, FastPlan(), seqs, chunk=7)
    for s, lg in zip(seqs, ours):
        with torch.no_grad():
            ref = hf_model(torch.tensor([s])).logits[0].float()
        err = (lg - ref).abs().max().item()
        assert err < 1e-3, err


def hf_greedy(hf_model, tok, prompts, n):
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    hf_model.generation_config.eos_token_id = None   # like ignore_eos: always n tokens
    with torch.no_grad():
        out = hf_model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return [row[enc["input_ids"].shape[1]:].tolist() for row in out]


def test_greedy_matches_hf_generate_alone_and_in_batch(engine, hf_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ensure_hf_dir(default_model_path()))   # transformers' side, whole
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = [hf_greedy(hf_model, tok, [p], 32)[0] for p in PROMPTS]
    alone = [engine.generate(p, params).token_ids for p in PROMPTS]
    batch = engine.generate(MIXED, params)
    assert alone == want
    assert [c.token_ids for c in batch[:3]] == want
