"""bench/moe_gguf.py at a tiny shape: the file holds llama-quantize's Q4_0 types for a
Qwen3-MoE (experts stacked 3-D, the router and norms F32, output.weight Q6_K), every
block of a tensor written in slices is a valid one, and gateeng serves it with each
expert as stored."""
import sys
from pathlib import Path

import numpy as np
import torch

from gateeng.model.gguf_weights import GGUFTensors
from gateeng.model.loader import load
from gateeng.plans import packing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import moe_gguf  # noqa: E402

SHAPE = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, experts=4, expert_ffn=64, experts_used=2,
             vocab=300)


def test_tiny_file_is_served_as_stored(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_gguf, "SLICE", 1000)   # many slices per tensor
    path = tmp_path / "moe.gguf"
    size = moe_gguf.write(path, SHAPE)
    assert size == path.stat().st_size
    tensors = GGUFTensors(path)
    assert tensors.architecture == "qwen3moe"
    table = {t.name: t for t in tensors.tensors.values()}
    assert table["blk.1.ffn_down_exps.weight"].shape == (4, 256, 64)
    assert table["blk.0.ffn_gate_inp.weight"].type == table["blk.0.attn_q_norm.weight"].type == "F32"
    assert table["output.weight"].type == "Q6_K" and table["token_embd.weight"].type == "Q4_0"
    assert sum(t.nbytes for t in table.values()) < size < sum(t.nbytes for t in table.values()) + 64 * 1024
    for name in ("blk.1.ffn_up_exps.weight", "token_embd.weight"):   # each block's scale is small and positive
        d = tensors.raw(name).reshape(-1, 18)[:, 0:2].copy().view(np.float16)
        assert ((d > 0) & (d < 0.01)).all()
    q6 = tensors.raw("output.weight").reshape(-1, 210)
    assert (q6[:, 208:210].copy().view(np.float16) > 0).all()

    loaded = load(str(path))
    assert loaded.config.moe.num_experts == 4 and loaded.config.vocab_size == 300
    assert packing.of(loaded.model).stored_types == {"Q4_0": 1 + 2 * 7, "Q6_K": 1}


def test_matrices_packed_in_slices_are_packed_whole(tmp_path, monkeypatch):
    """A matrix served as stored is read and packed SLICE_ROWS rows at a time: the same
    packed bytes and fingerprint as read whole (slices of 32 and 48 rows against one of
    all 300 rows of the output matrix, 256 of each attention matrix)."""
    from gateeng.model import gguf_weights
    path = tmp_path / "moe.gguf"
    moe_gguf.write(path, SHAPE)

    def packed_at(rows):
        monkeypatch.setattr(gguf_weights, "SLICE_ROWS", rows)
        loaded = load(str(path))
        store = packing.of(loaded.model)
        out = {name: store.shared[id(getattr(owner, name))].data
               for owner, name in ((loaded.model, "lm_head"), (loaded.model.layers[1], "o"))}
        return out, loaded.fingerprint
    whole, fp = packed_at(4096)
    for rows in (32, 48):
        sliced, fp_sliced = packed_at(rows)
        assert fp_sliced == fp
        for name, t in whole.items():
            assert t.shape == sliced[name].shape and torch.equal(t, sliced[name])
