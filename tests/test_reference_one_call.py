"""The reference's decoder layers in one C++ call (ReferencePlan.decode_layers) give the
op-by-op forward's bits, on every family's tiny model: q/k norms per head (Qwen3) or
over the projection (OLMoE), q/k/v biases (Qwen2), routing layers (their router
margins too), in prefill chunks and decode steps."""
import pytest
import torch

from gateeng.plans import reference_ops
from gateeng.plans.reference import ReferencePlan
from test_model import prefill_logits
from tiny import hf_family, tiny_loaded

SEQS = [list(range(5, 30)), [7, 3, 9, 11, 200, 13], list(range(100, 110))]


def run(loaded, plan):
    """Logits of every position (prefill chunks of 4, then one row a step) and the
    router margins of every pass's sample rows."""
    margins, passes = [], plan.hidden_and_router

    def recorded(*args):
        out = passes(*args)
        margins.append(out[1])
        return out
    plan.hidden_and_router = recorded
    logits = [prefill_logits(loaded, plan, SEQS, chunk) for chunk in (4, 1)]
    del plan.hidden_and_router
    return logits, margins


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe"])
def test_one_call_layers_give_the_op_by_op_bits(family):
    loaded = tiny_loaded("bfloat16", hf_family(family))
    plan = ReferencePlan(loaded.model, reference_ops.load())
    one_call, calls = plan.decode_layers, []
    plan.decode_layers = lambda *args: calls.append(one_call(*args)) or calls[-1]
    fused, fused_margins = run(loaded, plan)
    assert calls and all(c is not None for c in calls)
    plan.decode_layers = lambda *args: None   # the op-by-op forward
    op_by_op, margins = run(loaded, plan)
    for a, b in zip(fused, op_by_op):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(fused[1][0][3], fused[1][0][4])
    moe = loaded.model.cfg.moe is not None
    assert len(fused_margins) == len(margins) and all((m is not None) == moe for m in fused_margins + margins)
    if moe:
        assert all(torch.equal(a, b) for a, b in zip(fused_margins, margins))
