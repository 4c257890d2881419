"""A model loaded for one engine gives up each plain weight as soon as its packed copy
exists (packing.pack_shared(release=True)), so start-up never holds the weights
twice; the plans it then builds answer with the bits of a model that kept them."""
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.plans import cpu_linear, cpu_ops, factory, packing, reference_ops
from tiny import tiny_loaded


def _ref():
    try:
        return reference_ops.load()
    except reference_ops.ReferenceUnavailable as exc:
        pytest.skip(f"no reference build here: {exc}")


def _weights(model) -> list:
    return model.projections() + [model.lm_head]


def test_unpack_gives_back_the_weight_bit_for_bit():
    ref = _ref()
    gen = torch.Generator().manual_seed(0)
    for n, k in [(37, 24), (16, 2), (50, 64), (1, 8)]:
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        w[0, 0] = float("nan") if n > 1 else w[0, 0]   # any bits, NaN's included
        back = cpu_linear.unpack(cpu_linear.shared_pack(w, ref))
        assert back.shape == w.shape and torch.equal(back.view(torch.int16), w.view(torch.int16))


def test_release_frees_every_weight_while_packing_and_reads_them_back_exactly():
    ref = _ref()
    model = tiny_loaded("bfloat16").model
    before = {id(w): w.clone() for w in _weights(model)}
    packing.pack_shared(model, ref, release=True)
    assert all(w.untyped_storage().nbytes() == 0 for w in _weights(model))
    assert packing.of(model).freed_bytes == sum(w.numel() * w.element_size() for w in before.values())
    for w in _weights(model):
        assert torch.equal(packing.plain(model, w), before[id(w)])


def test_plain_weights_come_back_where_a_plan_multiplies_them():
    """Without a row-invariant matmul (no C++ kernels), the fast plan multiplies the
    plain weights: pack_fast puts every freed one back, in its own storage."""
    ref = _ref()
    model = tiny_loaded("bfloat16").model
    before = {id(w): w.clone() for w in _weights(model)}
    packing.pack_shared(model, ref, release=True)
    packing.pack_fast(model, None, ref)
    assert packing.of(model).plain_needed and packing.of(model).freed_bytes == 0
    assert all(torch.equal(w, before[id(w)]) for w in _weights(model))
    assert packing.release_plain_weights(model) == 0


@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN", "no oneDNN"])
def test_an_engine_that_released_early_answers_with_the_same_bits(onednn, monkeypatch):
    """factory.build on an owned model (weights freed while packing) against one on a
    model someone else holds (nothing freed): the same fast and reference logits. Without
    oneDNN (an AVX2-only CPU) the start-up probe times torch's matmul on a weight read
    back from the packed copy."""
    if cpu_ops.load() is None:
        pytest.skip("no C++ kernels here")
    if not onednn:
        monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    from test_model import prefill_logits
    cfg = EngineConfig(block_size=4)
    seqs = [list(range(5, 30)), [7, 3, 9, 11, 200]]
    out = {}
    for owned in (True, False):
        loaded = tiny_loaded("bfloat16")
        plans = factory.build(cfg, loaded.model, loaded.config, torch.bfloat16, owned=owned)
        if owned and packing.of(loaded.model).plain_needed:
            pytest.skip("no row-invariant matmul here: the plain weights stay")
        assert (loaded.model.lm_head.untyped_storage().nbytes() == 0) is owned
        out[owned] = [prefill_logits(loaded, plan, seqs, chunk=3) for plan in (plans.fast, plans.invariant)]
    for a, b in zip(out[True], out[False]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_weights_are_checked_while_their_plain_copy_is_at_hand(monkeypatch):
    """Each weight's row-invariant matmul is checked against F.linear as it is packed,
    before its plain copy goes: an owned model's start reads back from the packed
    copies only the one weight the start-up probe times, and where the probe keeps
    oneDNN's copy too (AMX), each weight once more to make it."""
    if cpu_ops.load() is None:
        pytest.skip("no C++ kernels here")
    calls = []
    unpack = cpu_linear.unpack
    monkeypatch.setattr(cpu_linear, "unpack", lambda p: calls.append(p) or unpack(p))
    loaded = tiny_loaded("bfloat16")
    factory.build(EngineConfig(block_size=4), loaded.model, loaded.config, torch.bfloat16, owned=True)
    if packing.of(loaded.model).plain_needed:
        pytest.skip("no row-invariant matmul here: the plain weights stay")
    weights = len(loaded.model.projections()) + 1   # and the lm_head
    second_copy = packing.of(loaded.model).fast_rowwise_max_rows is not None
    assert len(calls) <= 1 + (weights if second_copy else 0)


@pytest.mark.parametrize("available", [1 << 40, 1 << 10])
def test_a_second_copy_is_kept_only_where_it_fits(monkeypatch, available):
    """Where the start-up probe finds another kernel faster above some row count, its
    copy of the weights is made only if it fits in half the memory available: else
    the row-invariant kernel on the one packed copy serves every row count, and no
    plain weight comes back."""
    if cpu_ops.load() is None:
        pytest.skip("no C++ kernels here")
    monkeypatch.setattr(cpu_linear, "rowwise_max_rows", lambda *a: 8)   # the probe, as on AMX
    monkeypatch.setattr(cpu_linear, "available_bytes", lambda: available)
    loaded = tiny_loaded("bfloat16")
    factory.build(EngineConfig(block_size=4), loaded.model, loaded.config, torch.bfloat16, owned=True)
    model, stored = loaded.model, packing.of(loaded.model)
    if stored.rowwise_checked_name is None:
        pytest.skip("no row-invariant matmul here")
    fits = available > 1 << 20
    assert (stored.fast_rowwise_max_rows == 8) is fits
    if not fits:
        assert not stored.plain_needed and all(w.untyped_storage().nbytes() == 0 for w in _weights(model))
