"""The trainer's policy on a mixture of experts (its logprobs equal a VERIFIED answer's
bit for bit: tests/test_policy.py, for every family): its gradients, straight through
the choice of experts, are float32 transformers' within the bf16 forward; a saved
step is the hub's per-expert layout, and a server updated in place to it gives the
policy's bits."""
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.model import loader
from gateeng.model.experts import per_expert
from gateeng.request import SamplingParams
from gateeng.train import Policy
from test_policy import PROMPTS, VERIFIED, assert_gradients_close, bits, gradients_both_ways
from tiny import MOE_FAMILIES, hf_family, save_family, tiny_loaded


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_gradients_through_the_routing_match_float32_transformers(family):
    hf = hf_family(family).float()
    policy = Policy(tiny_loaded("float32", hf))
    ours, theirs = gradients_both_ways(hf, policy)
    # transformers holds each layer's experts fused: its gradients shown per expert, as ours are named
    theirs = per_expert(theirs, policy.config)
    assert set(ours) == set(theirs)
    routers = [n for n in ours if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))]
    assert len(routers) == len(policy.config.moe.sparse_layers) and all(ours[n].any() for n in routers)
    assert_gradients_close(ours, theirs)


def test_a_saved_step_is_the_hub_layout_and_an_update_in_place_serves_its_bits(tmp_path):
    from safetensors import safe_open
    save_family("qwen3_moe", tmp_path / "base")
    policy = Policy.load(str(tmp_path / "base"))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    (-sum(lp.sum() for lp in policy.logprobs([PROMPTS[0] + [42, 43, 44]], [len(PROMPTS[0])]))).backward()
    opt.step()
    policy.save(tmp_path / "step1")
    with safe_open(str(tmp_path / "step1" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names        # one tensor per expert, as the hub stores them
    assert "model.layers.0.mlp.gate.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    engine = Engine(EngineConfig(dtype="bfloat16", num_kv_blocks=128, max_model_len=256, block_size=4),
                    loaded=loader.load(str(tmp_path / "base"), "bfloat16"))
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True, logprobs=0)
    try:
        before = [engine.generate(p, params, VERIFIED) for p in PROMPTS]
        engine.update_weights(tmp_path / "step1")
        after = [engine.generate(p, params, VERIFIED) for p in PROMPTS]
    finally:
        engine.shutdown()
    assert after[0].reproducibility.model_fingerprint == policy.fingerprint != before[0].reproducibility.model_fingerprint
    got = policy.logprobs([p + r.token_ids for p, r in zip(PROMPTS, after)], [len(p) for p in PROMPTS],
                          temperature=0.9)
    assert [bits(g.tolist()) for g in got] == [bits(e.logprob for e in r.logprobs) for r in after]
