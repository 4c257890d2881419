"""The Triton reference's mixture-of-experts kernels (kernels/triton_reference.py:
moe_route, moe_combine, the router logits through matmul) give ref_ops.cpp's bits under
TRITON_INTERPRET=1: every routing rule on random logits, exact ties and results the spec
flushes, and a tiny Qwen3-MoE's forward on TritonReferencePlan (the CUDA invariant plan)
against ReferencePlan. Shapes stay tiny: the interpreter is slow."""
import numpy as np
import pytest
import torch

from gateeng.kernels import triton_reference as tr
from gateeng.plans import reference_ops
from tests import oracle
from tests.test_triton_reference import same

pytestmark = pytest.mark.kernels

RULES = {"softmax-topk-renorm": (True, True), "softmax-topk": (True, False), "topk-softmax": (False, False)}
D = 2.0 ** -130   # a binary32 denormal: read as zero of its sign


def crafted_logits() -> torch.Tensor:
    """Router logits [16, 6]: random rows, then rows with exact ties (at the top, at the
    k-th place, all equal, -0 against +0 and denormals) and rows whose softmax scores,
    weights or margins fall below 2^-126 and are flushed (FLUSHED says which)."""
    z = torch.randn(16, 6, generator=torch.Generator().manual_seed(11)) * 3
    z[:11] = torch.tensor([
        [1.0, 2.0, 2.0, 0.5, 2.0, -1.0],       # a three-way tie across the k-th place
        [3.0, 3.0, 3.0, 3.0, 3.0, 3.0],        # all equal
        [0.0, 5.0, 1.0, 1.0, -100.0, 1.0],     # a tie for 2nd and 3rd; an exp below -86
        [D, -D, 0.0, -0.0, 2 * D, -5.0],       # equal once read: the lower id wins
        [0.0, 0.0, 0.0, 0.0, 0.0, -85.9],      # softmax: s[5] = 5e-38 / 5 is flushed to 0
        [0.0, 0.0, 0.0, 0.0, -86.5, -86.0],    # softmax: s[4] = 0 ties s[5] = 4.5e-38 / 4, flushed
        [0.0, 0.0, 0.0, 0.0, -85.0, -85.1],    # softmax: s[4] - s[5] is flushed (k = 5)
        [1.5e-38, 1.2e-38, -3.0, -4.0, -5.0, -6.0],   # logits: z[0] - z[1] is flushed (k = 1)
        [0.0, 0.0, 0.0, 0.0, -86.0, -100.0],   # top-k softmax, k = 5: w[4] = 4.5e-38 / 4 flushed
        [7.0, 7.0, -2.0, 0.0, 0.0, 1.0],
        [5.0, -0.0, -0.0, 0.0, 0.0, -1.0],     # logits, k = 2: the margin is -0 - (-0) = +0
    ])
    return z


# (row, rule, k) whose answer the flush rule changes (test_the_cases_reach_the_flush)
FLUSHED = [(3, "topk-softmax", 2), (4, "softmax-topk", 6), (5, "softmax-topk", 5), (6, "softmax-topk", 5),
           (7, "topk-softmax", 1), (8, "topk-softmax", 5)]


def wide_logits() -> torch.Tensor:
    """[5, 40]: blocks of 3 in the spec's sum, the last two empty; a row near the flush."""
    z = torch.randn(5, 40, generator=torch.Generator().manual_seed(12)) * 4
    z[0, :] = 0.0
    z[0, 7] = -85.5   # beside 39 equal experts: its score is flushed
    z[1, 3::5] = z[1, 3]   # eight equal logits
    return z


def bits(t: torch.Tensor) -> list:
    return t.contiguous().view(torch.int32).tolist()


@pytest.mark.parametrize("rule", RULES)
def test_routing_gives_the_cpu_builds_bits(rule):
    ops = reference_ops.load()
    for z, ks in ((crafted_logits(), (1, 2, 5, 6)), (wide_logits(), (4, 8))):
        for k in ks:
            got, want = tr.moe_route(z, k, *RULES[rule]), ops.moe_route(z, k, *RULES[rule])
            assert torch.equal(got[0], want[0]), (rule, k)
            assert bits(got[1]) == bits(want[1]), (rule, k)
            assert bits(got[2]) == bits(want[2]), (rule, k)


def test_ties_and_flushed_scores_route_by_the_written_rule():
    """What the spec says of the crafted rows, read off the Triton kernel's answers."""
    z = crafted_logits()
    ids, _, margins = tr.moe_route(z, 2, False, False)
    assert ids[0].tolist() == [1, 2] and margins[0] == 0.0     # 1 and 2 beat 4 at the 2nd place
    assert ids[1].tolist() == [0, 1] and ids[3].tolist() == [0, 1]
    assert bits(margins[3:4]) == [-2 ** 31] and bits(margins[10:11]) == [0]   # -0 - (+0); -0 - (-0)
    ids, weights, margins = tr.moe_route(z, 5, True, False)
    assert ids[5].tolist() == [0, 1, 2, 3, 4] and weights[5, 4] == 0.0 and margins[5] == 0.0
    assert margins[6] == 0.0
    assert tr.moe_route(z, 6, True, False)[1][4, 5] == 0.0
    ids, weights, margins = tr.moe_route(z, 6, False, False)
    assert margins.isinf().all()


def test_the_cases_reach_the_flush(monkeypatch):
    """Each FLUSHED case's answer (ids, weights or margin) is another without the
    flush rule: the cases test it."""
    z = crafted_logits().numpy()
    kept = {}
    with monkeypatch.context() as mp:
        mp.setattr(oracle, "flush", lambda v: np.asarray(v, np.float32))
        for r, rule, k in FLUSHED:
            kept[r, rule, k] = oracle.moe_route(z[r], k, *RULES[rule])
    for (r, rule, k), (ids, w, margin) in kept.items():
        fids, fw, fmargin = oracle.moe_route(z[r], k, *RULES[rule])
        assert ids != fids or w.tobytes() != fw.tobytes() or margin.tobytes() != fmargin.tobytes(), (r, rule, k)


def test_combine_gives_the_cpu_builds_bits():
    """Random outputs and weights; rows with tiny weights (products below 2^-126), bf16
    denormal outputs, and outputs that cancel to zero."""
    ops = reference_ops.load()
    gen = torch.Generator().manual_seed(13)
    rows, k, h = 18, 3, 140   # two row blocks, two column blocks (both partly masked)
    y = (torch.randn(rows, k, h, generator=gen) * 4).to(torch.bfloat16)
    w = torch.rand(rows, k, generator=gen)
    w[0] = torch.tensor([2e-38, 5e-38, 1.5e-38])        # w * y below 2^-126 where |y| < 0.6
    y.view(torch.int16)[1, :, ::2] = 0x007F             # bf16 denormals, read as +0 and -0
    y.view(torch.int16)[1, :, 1::4] = -0x7FFF
    y[2, 1] = -y[2, 0]                                    # acc + w*y cancels
    w[2, :2] = 0.5
    _, weights, _ = ops.moe_route(torch.randn(rows, 5, generator=gen), k, True, True)
    for ws in (w, weights):
        assert same(tr.moe_combine(y, ws), ops.moe_combine(y, ws))


def tiny_moe():
    """A one-layer Qwen3-MoE routing 2 of 4 experts, hidden 32: small enough for the
    interpreter to run a whole forward in seconds."""
    from gateeng.config import SOFTMAX_TOPK, ModelConfig, MoeConfig
    from gateeng.model.llama import LlamaModel
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=64,
                      tie_word_embeddings=True, eos_token_ids=(63,), architecture="qwen3_moe", qk_norm=True,
                      moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=16, routing=SOFTMAX_TOPK,
                                    norm_topk_prob=True, sparse_layers=(0,)))
    model = LlamaModel(cfg, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(15)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise / 8 if p.dim() == 1 else noise / 3)
    model.finalize()
    return model


def test_router_logits_give_the_cpu_references_bits():
    """The binary32 logits of a router: TritonReferencePlan's and ReferencePlan's."""
    from gateeng.plans.gpu import TritonReferencePlan
    from gateeng.plans.reference import ReferencePlan
    model = tiny_moe()
    x = (torch.randn(5, 32, generator=torch.Generator().manual_seed(14)) * 3).to(torch.bfloat16)
    router = model.routers()[0]
    got = TritonReferencePlan(4, model).router_logits(x, router)
    want = ReferencePlan(model, reference_ops.load(), 4).router_logits(x, router)
    assert got.dtype == torch.float32 and same(got, want)


def prefill_then_decode(model, plan) -> list:
    """(hidden states, float32 logits, smallest router margins) at every row of a prefill
    of two sequences (9 rows routed in one batch), then of a decode step of both, on
    `plan` (with bench/gpu_check.py: on the model's device)."""
    from gateeng.model.llama import KVCache
    from gateeng.plans.rows import Rows
    kv = KVCache(model.cfg, 8, 4, torch.bfloat16, model.device)
    outs = []
    for chunks in ([(list(range(50, 56)), 0, [3, 7]), ([9, 20, 31], 0, [5])],
                   [([42], 6, [3, 7]), ([7], 3, [5])]):
        rows = Rows([], [], [], [], [])
        for ids, first, table in chunks:
            rows.add_chunk(ids, first, table, 4)
        rows.sample_rows.extend(range(len(rows)))
        hidden, margins = plan.hidden_and_router(model, kv, rows)
        outs.append((hidden, plan.full_logits(model, hidden), margins))
    return outs


def test_the_triton_plan_runs_a_mixture_of_experts_as_the_cpu_reference():
    """tiny_moe on TritonReferencePlan in the interpreter: ReferencePlan's bits."""
    from gateeng.plans.gpu import TritonReferencePlan
    from gateeng.plans.reference import ReferencePlan
    model = tiny_moe()
    want = prefill_then_decode(model, ReferencePlan(model, reference_ops.load(), 4))
    got = prefill_then_decode(model, TritonReferencePlan(4, model))
    assert [h.shape[0] for h, _, _ in got] == [9, 2]
    for step_got, step_want in zip(got, want):
        assert all(same(g, w) for g, w in zip(step_got, step_want))


def test_a_nan_router_logit_is_refused_by_name():
    z = torch.zeros(3, 4)
    z[2, 1] = float("nan")
    with pytest.raises(RuntimeError, match=r"router logit is NaN \(row 2, expert 1\)"):
        tr.moe_route(z, 2, True, True)


def test_the_trainers_triton_kernels_route_and_combine_as_the_cpu_build():
    """gateeng.train's TritonReference.moe_route and moe_combine: the CPU build's
    functions' signatures and bits."""
    from gateeng.train.kernels import TritonReference
    ops, tri = reference_ops.load(), TritonReference()
    z = crafted_logits()
    got, want = tri.moe_route(z, 2, False, False), ops.moe_route(z, 2, False, False)
    assert torch.equal(got[0], want[0]) and bits(got[1]) == bits(want[1]) and bits(got[2]) == bits(want[2])
    y = (torch.randn(16, 2, 40, generator=torch.Generator().manual_seed(16)) * 4).to(torch.bfloat16)
    assert same(tri.moe_combine(y, want[1]), ops.moe_combine(y, want[1]))



def test_the_policy_on_the_triton_kernels_gives_a_mixture_of_experts_the_cpu_bits():
    """The trainer's policy on a tiny Mixtral (gateeng.train, kernels="triton": the
    router logits, moe_route and moe_combine above): the logprobs of its CPU build, bit
    for bit, and a backward through the routing. One layer runs every kernel (the
    interpreter is slow per layer); seed 1's router sends these tokens to each of its
    4 experts, so every parameter has a gradient to get."""
    from gateeng.train import Policy
    from tests.tiny import hf_family, tiny_loaded
    hf = hf_family("mixtral", seed=1, num_hidden_layers=1)
    seqs, prompt_lens = [[7, 3, 9, 11, 200, 13], [5, 6, 7, 8]], [4, 2]
    want = Policy(tiny_loaded("float32", hf)).logprobs(seqs, prompt_lens, temperature=0.9)
    policy = Policy(tiny_loaded("float32", hf), kernels="triton")
    got = policy.logprobs(seqs, prompt_lens, temperature=0.9)
    assert [bits(g.detach()) for g in got] == [bits(w.detach()) for w in want]
    sum(g.sum() for g in got).backward()
    assert all(p.grad is not None for p in policy.parameters())
