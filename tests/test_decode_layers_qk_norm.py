"""The fast plan's one-call decode layers on a family with q/k norms (Qwen3): the norms
run inside the call, with the op-by-op forward's bits."""
import pytest
import torch

from gateeng.plans import cpu_linear, packing, reference_ops
from gateeng.plans.generic import FastPlan
from test_model import cpu_kernels, prefill_logits
from tiny import hf_family, tiny_loaded


def test_one_call_decode_layers_with_qk_norms_give_the_op_by_op_bits(monkeypatch):
    k = cpu_kernels()
    loaded = tiny_loaded("bfloat16", hf_family("qwen3"))
    m, ref = loaded.model, reference_ops.load()
    assert m.cfg.qk_norm
    # Every row count on the row-invariant matmul, both ways (test_model's reason).
    monkeypatch.setattr(cpu_linear, "rowwise_max_rows", lambda *args: None)
    packing.pack_shared(m, ref)
    packing.pack_fast(m, k, ref)
    stored = packing.of(m)
    if stored.fused_layers is None:
        pytest.skip("no row-invariant matmul here (neither AVX-512 BF16 nor an AVX2 reference build)")
    assert len(stored.fused_layers.qk_norms) == 2 * m.cfg.num_layers   # each layer's q and k norms
    plan = FastPlan(0.0, stored.packed, k, stored.dense_head)
    one_call, calls = plan.decode_layers, []
    plan.decode_layers = lambda *a: calls.append(one_call(*a)) or calls[-1]
    seqs = [list(range(5, 30)), [7, 3, 9, 11, 200, 13], list(range(100, 110))]
    fused = prefill_logits(loaded, plan, seqs, chunk=1)   # one row per sequence a step: decode steps
    assert calls and all(c is not None for c in calls)
    stored.fused_layers = None
    op_by_op = prefill_logits(loaded, plan, seqs, chunk=1)
    assert all(torch.equal(a, b) for a, b in zip(fused, op_by_op))
    assert not torch.equal(fused[0][3], fused[0][4])
