"""The reference's greedy choice from a few exact logits (ReferencePlan.greedy_choice):
the fast plan's int8 logits lie within plans.head.int8_logit_bound of every id's
reference logit, so only the ids that could be the top two get their exact logit, and
the token and margin are those the sampler takes from the dense logits, bit for bit."""
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.model import loader
from gateeng.plans import factory, head, packing
from tests.tiny_gguf import write_tiny_gguf

SHAPE = dict(hidden=256, heads=2, kv_heads=1, head_dim=128, intermediate=512, tie=False, byte_vocab=True)
FIRST, TWIN = 40, 200   # two lm_head rows with the same values: their logits always tie


def twins(hf) -> None:
    hf.lm_head.weight[TWIN] = hf.lm_head.weight[FIRST]


def plan_for(path):
    loaded = loader.load(str(path))
    plans = factory.build(EngineConfig(dtype="bfloat16"), loaded.model, loaded.config, torch.bfloat16)
    return loaded.model, plans.invariant


@pytest.fixture(scope="module", params=["Q6_K", "Q8_0", "Q4_0"])
def served(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("greedy") / f"tiny-{request.param}.gguf"
    write_tiny_gguf(path, {"output.weight": request.param, "*": "Q4_0"}, edit=twins, **SHAPE)
    model, plan = plan_for(path)
    if not plan.sparse_greedy:
        pytest.skip("no int8 kernels for the fast plan on this CPU (plans.cpu_ops)")
    return model, plan


def rows(seed: int) -> torch.Tensor:
    """Hidden rows over many magnitudes, some with most values zero."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for scale in (2.0 ** -90, 2.0 ** -20, 1.0, 3.0, 2.0 ** 20, 2.0 ** 60):
        x = torch.randn(4, SHAPE["hidden"], generator=g) * scale
        x[1, torch.randperm(SHAPE["hidden"], generator=g)[:200]] = 0.0
        out.append(x)
    return torch.cat(out).to(torch.bfloat16)


def same(a, b) -> bool:
    """Two (tokens, margins) results with the same tokens and the same margin bits."""
    return a[0] == b[0] and [m.hex() for m in a[1]] == [m.hex() for m in b[1]]


def test_the_int8_logits_lie_within_the_bound_of_the_reference_logits(served):
    model, plan = served
    x = rows(0)
    approx = packing.of(model).int8_head(x)
    exact = plan.full_logits(model, x)
    bound = head.int8_logit_bound(x, packing.lm_head_abs_sum(model))
    err = (approx.double() - exact.double()).abs().amax(dim=-1)
    assert (err <= bound.double()).all(), (err / bound.double()).max()
    assert (err > 0).any()   # the int8 logits are another arithmetic: the bound is what holds


def test_greedy_choice_is_the_dense_choice_bit_for_bit(served, monkeypatch):
    model, plan = served
    dense, calls = plan._dense_choice, []
    monkeypatch.setattr(plan, "_dense_choice", lambda m, h: calls.append(h.shape[0]) or dense(m, h))
    for seed in range(3):
        x = rows(seed)
        tok, mar = plan.greedy_choice(model, x)
        assert same((tok, mar), dense(model, x))
        for i in range(0, x.shape[0], 5):   # a row alone chooses as in the batch
            assert same(plan.greedy_choice(model, x[i:i + 1]), ([tok[i]], [mar[i]]))
    assert not calls   # every row chose from its candidates


def test_a_tie_at_the_top_goes_to_the_lower_id_with_margin_0(served):
    model, plan = served
    w = packing.plain(model, model.lm_head)[FIRST].float()
    x = (w / w.norm() * 8).to(torch.bfloat16)[None]   # FIRST and TWIN lead every other id
    assert plan._dense_choice(model, x) == ([FIRST], [0.0])
    assert plan.greedy_choice(model, x) == ([FIRST], [0.0])


def test_rows_the_bound_does_not_cover_take_the_dense_logits(served, monkeypatch):
    model, plan = served
    dense, calls = plan._dense_choice, []
    monkeypatch.setattr(plan, "_dense_choice", lambda m, h: calls.append(h.shape[0]) or dense(m, h))
    tiny = torch.randn(2, SHAPE["hidden"])
    tiny[0, :32] *= 2.0 ** -110   # a block of inputs below 2^-100: the int8 scale is not the bound's
    assert same(plan.greedy_choice(model, tiny.to(torch.bfloat16)), dense(model, tiny.to(torch.bfloat16)))
    inf = torch.randn(1, SHAPE["hidden"])
    inf[0, 5] = float("inf")
    assert same(plan.greedy_choice(model, inf.to(torch.bfloat16)), dense(model, inf.to(torch.bfloat16)))
    assert calls == [2, 1]


def test_an_lm_head_with_minimums_takes_the_dense_logits(tmp_path):
    write_tiny_gguf(tmp_path / "tiny-q4_1.gguf", {"output.weight": "Q4_1", "*": "Q4_0"}, **SHAPE)
    model, plan = plan_for(tmp_path / "tiny-q4_1.gguf")
    assert packing.of(model).int8_head is None and not plan.sparse_greedy
