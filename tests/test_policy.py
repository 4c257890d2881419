"""The trainer's policy (gateeng.train.Policy): its logprobs are a VERIFIED request's,
bit for bit (greedy and sampled, packed or alone, on another reference build or a
tensor-parallel server); its gradients are those of plain float32 arithmetic within
the bf16 rounding of the forward; a saved policy serves its own bits."""
import dataclasses

import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.plans import reference_ops
from gateeng.request import DeterminismParams, Mode, SamplingParams
from gateeng.train import Policy
from tiny import MOE_FAMILIES, hf_family, tiny_loaded

VERIFIED = DeterminismParams(Mode.VERIFIED)
PROMPTS = [[7, 3, 9, 11, 200, 13], [5, 6, 7], [100, 20, 30, 40, 50, 60, 70, 80, 90], [1, 2]]
SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0),
    "t1_top_p": SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True, logprobs=0),
    "t07_top_k": SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=20, ignore_eos=True, logprobs=0),
}
# Measured on the tiny families below (llama, qwen2 with biases, qwen3 with q/k norms;
# tied and untied): the largest relative L2 error of a parameter's gradient against
# float32 transformers on the same bf16-rounded weights was 0.027, the smallest
# cosine 0.99965. The difference is the forward's bf16 activations (2^-9 relative per
# rounding), which the backward's float32 derivative is evaluated at.
GRAD_REL_BOUND, GRAD_COS_BOUND = 0.05, 0.999


def engine_for(hf, **cfg) -> Engine:
    base = dict(dtype="bfloat16", num_kv_blocks=128, max_model_len=256, block_size=4, max_num_batched_tokens=64)
    return Engine(EngineConfig(**dict(base, **cfg)), loaded=tiny_loaded("bfloat16", hf))


def policy_args(p: SamplingParams) -> dict:
    """The policy's sampling for a request's: a greedy one's logprobs are T=1, untruncated."""
    if p.greedy:
        return dict(temperature=1.0)
    return dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)


def bits(values) -> list:
    return [float(v).hex() for v in values]


@pytest.fixture(scope="module")
def llama():
    hf = hf_family("llama")
    e = engine_for(hf)
    yield hf, e, Policy(tiny_loaded("float32", hf))
    e.shutdown()


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_logprobs_equal_verified_bits_packed_and_alone(llama, name):
    _, engine, policy = llama
    params = SAMPLINGS[name]
    res = [engine.generate(p, params, VERIFIED) for p in PROMPTS]
    seqs, lens = [p + r.token_ids for p, r in zip(PROMPTS, res)], [len(p) for p in PROMPTS]
    packed = policy.logprobs(seqs, lens, **policy_args(params))
    for i, r in enumerate(res):
        want = bits(e.logprob for e in r.logprobs)
        assert bits(packed[i].tolist()) == want
        assert bits(policy.logprobs([seqs[i]], [lens[i]], **policy_args(params))[0].tolist()) == want


@pytest.mark.parametrize("family", ["qwen2", "qwen3", *MOE_FAMILIES])
def test_logprobs_equal_verified_bits_with_biases_qk_norms_and_experts(family):
    """Mixtures of experts too: the routing is the reference's, the sampler's and the trainer's alike."""
    hf = hf_family(family)
    engine = engine_for(hf)
    try:
        params = SAMPLINGS["t1_top_p"]
        res = [engine.generate(p, params, VERIFIED) for p in PROMPTS]
    finally:
        engine.shutdown()
    got = Policy(tiny_loaded("float32", hf)).logprobs([p + r.token_ids for p, r in zip(PROMPTS, res)],
                                                      [len(p) for p in PROMPTS], **policy_args(params))
    assert [bits(g.tolist()) for g in got] == [bits(e.logprob for e in r.logprobs) for r in res]


def test_another_reference_build_gives_the_servers_bits(llama):
    hf, engine, native = llama
    params = SAMPLINGS["t07_top_k"]
    res = [engine.generate(p, params, VERIFIED) for p in PROMPTS]
    seqs, lens = [p + r.token_ids for p, r in zip(PROMPTS, res)], [len(p) for p in PROMPTS]
    want = [bits(e.logprob for e in r.logprobs) for r in res]
    others = [isa for isa in reference_ops.runnable() if isa != native.isa]
    assert others, "this CPU runs one reference build only"
    for isa in others:
        policy = Policy(tiny_loaded("float32", hf), isa=isa)
        assert policy.isa == isa
        assert [bits(g.tolist()) for g in policy.logprobs(seqs, lens, **policy_args(params))] == want, isa


def test_a_tensor_parallel_server_and_a_scalar_trainer_agree():
    hf = hf_family("llama")
    params = SAMPLINGS["t1_top_p"]
    engine = engine_for(hf, tensor_parallel_size=2, num_threads=1, max_num_seqs=16, num_kv_blocks=96)
    try:
        res = [engine.generate(p, params, VERIFIED) for p in PROMPTS]
    finally:
        engine.shutdown()
    assert res[0].reproducibility.tensor_parallel_size == 2
    policy = Policy(tiny_loaded("float32", hf), isa="scalar")
    got = policy.logprobs([p + r.token_ids for p, r in zip(PROMPTS, res)], [len(p) for p in PROMPTS],
                          **policy_args(params))
    assert [bits(g.tolist()) for g in got] == [bits(e.logprob for e in r.logprobs) for r in res]


def gradients_both_ways(hf, policy) -> tuple:
    """(the policy's, float32 transformers') gradients by name of one advantage-weighted
    sum of logprobs, both on hf's weights rounded to bf16."""
    with torch.no_grad():                      # the weights both sides use: the bf16 roundings
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    seqs, lens, temperature = [[7, 3, 9, 11, 200, 13, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 100, 101, 102, 103]], [6, 3], 0.8
    weights = [torch.linspace(-1, 1, len(s) - n) for s, n in zip(seqs, lens)]   # advantages of either sign
    lps = policy.logprobs(seqs, lens, temperature=temperature)
    sum((w * lp).sum() for w, lp in zip(weights, lps)).backward()
    total = 0
    for s, n, w in zip(seqs, lens, weights):
        lp = torch.log_softmax(hf(torch.tensor([s])).logits[0].float() / temperature, -1)
        total = total + (w * lp[n - 1:len(s) - 1].gather(1, torch.tensor(s[n:])[:, None])[:, 0]).sum()
    total.backward()
    return policy.model.hf_state_dict(lambda p: p.grad), {n: p.grad for n, p in hf.named_parameters()}


def assert_gradients_close(ours: dict, theirs: dict) -> None:
    for name, g in ours.items():
        want = theirs[name]
        if not want.any():                     # a part nothing reached (an expert no token chose), on both sides
            assert not g.any(), name
            continue
        rel = float((g - want).norm() / want.norm())
        cos = float(torch.nn.functional.cosine_similarity(g.flatten(), want.flatten(), dim=0))
        assert rel < GRAD_REL_BOUND and cos > GRAD_COS_BOUND, (name, rel, cos)


@pytest.mark.parametrize("family, tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", False)])
def test_gradients_match_float32_transformers_within_the_bf16_forward(family, tie):
    hf = hf_family(family, tie=tie).float()
    ours, theirs = gradients_both_ways(hf, Policy(tiny_loaded("float32", hf)))
    assert set(ours) == {n for n in theirs if not (tie and n == "lm_head.weight")}
    assert_gradients_close(ours, theirs)


def test_every_parameter_that_shapes_the_logprobs_gets_a_gradient(llama):
    _, _, policy = llama
    policy.zero_grad()
    policy.logprobs([[5, 6, 7, 8, 9]], [2], temperature=0.9)[0].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in policy.parameters())
    policy.zero_grad()


@pytest.mark.parametrize("sequences, prompt_lens, kwargs, words", [
    ([[1, 2, 3]], [3], {}, "leave a completion"),
    ([[1, 2, 3]], [0], {}, "at least 1"),
    ([[1, 2, 300]], [1], {}, "token ids must be in"),
    ([[1, 2, 3]], [1, 1], {}, "one length per sequence"),
    ([[1, 2, 3]], [1], dict(temperature=-1.0), "temperature"),
    ([[1, 2, 3]], [1], dict(top_p=0.0), "top_p"),
])
def test_bad_inputs_are_refused_with_the_reason(llama, sequences, prompt_lens, kwargs, words):
    _, _, policy = llama
    with pytest.raises(ValueError, match=words):
        policy.logprobs(sequences, prompt_lens, **kwargs)


@pytest.mark.model
def test_embedded_model_16_prompts_x_64_tokens_equal_verified_and_a_saved_step_serves_its_bits(smollm, tmp_path):
    from gateeng.model import loader
    policy = Policy.load()
    prompts = [policy.tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about topic {i}."}],
                                                    add_generation_prompt=True, tokenize=True) for i in range(16)]
    cfg = EngineConfig(dtype="bfloat16")   # the defaults, whose route costs other tests' engines share
    engine = Engine(cfg, loaded=smollm("bfloat16"))
    try:
        # Greedy at 16 x 64; sampled (top-p) on half of them, 32 tokens each.
        for params, batch in ((SamplingParams(max_tokens=64, ignore_eos=True, logprobs=0), prompts),
                              (SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=32, ignore_eos=True,
                                              logprobs=0), prompts[:8])):
            res = engine.generate(batch, params, VERIFIED)
            got = policy.logprobs([p + r.token_ids for p, r in zip(batch, res)], [len(p) for p in batch],
                                  **policy_args(params))
            assert [bits(g.tolist()) for g in got] == [bits(e.logprob for e in r.logprobs) for r in res]
    finally:
        engine.shutdown()
    # One real optimizer step, saved; a server on the saved weights gives the policy's bits.
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    seqs, lens = [p + [42, 43, 44] for p in prompts[:2]], [len(p) for p in prompts[:2]]
    (-sum(lp.sum() for lp in policy.logprobs(seqs, lens))).backward()
    opt.step()
    policy.save(tmp_path / "step1")
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True, logprobs=0)
    served = Engine(cfg, loaded=loader.load(str(tmp_path / "step1"), "bfloat16"))
    try:
        res = served.generate(prompts[:4], params, VERIFIED)
    finally:
        served.shutdown()
    got = policy.logprobs([p + r.token_ids for p, r in zip(prompts[:4], res)], [len(p) for p in prompts[:4]],
                          temperature=0.9)
    assert [bits(g.tolist()) for g in got] == [bits(e.logprob for e in r.logprobs) for r in res]


@pytest.mark.kernels
def test_the_triton_reference_gives_the_policy_the_same_bits():
    """The Triton kernels (the CUDA reference), here in the interpreter on CPU tensors,
    slow per layer: one layer runs every kernel."""
    pytest.importorskip("triton")
    hf = hf_family("llama", num_hidden_layers=1)
    params = SAMPLINGS["t1_top_p"]
    prompts = PROMPTS[:2]
    params = dataclasses.replace(params, max_tokens=6)
    engine = engine_for(hf)
    try:
        res = [engine.generate(p, params, VERIFIED) for p in prompts]
    finally:
        engine.shutdown()
    policy = Policy(tiny_loaded("float32", hf), kernels="triton")
    got = policy.logprobs([p + r.token_ids for p, r in zip(prompts, res)], [len(p) for p in prompts],
                          **policy_args(params))
    assert [bits(g.tolist()) for g in got] == [bits(e.logprob for e in r.logprobs) for r in res]
    sum(g.sum() for g in got).backward()
    assert all(p.grad is not None for p in policy.parameters())
