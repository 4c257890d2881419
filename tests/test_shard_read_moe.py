"""A mixture of experts' tensor-parallel shard read by byte ranges (model.shard_read):
from a Hugging Face directory's per-expert tensors and from transformers 5's fused
[experts, rows, columns] ones, and from a GGUF's stacked ffn_*_exps tensors (quantized
experts as stored, a down's columns by whole blocks), the rank's tensors are its part
of the whole model loaded and split (model.shard.shard_tensors), bit for bit, the
router whole on every rank, and the fingerprint is a single server's. Quantized experts
split over the ranks on one machine give VERIFIED answers equal to one process's."""
import shutil

import pytest
import torch

from gateeng.model import loader, shard, shard_read
from gateeng.plans import packing
from tests.test_shard_read import check_ranks
from tests.test_tensor_parallel_engine import PROMPTS
from tests.test_tensor_parallel_moe import answers, engine, moe_config
from tests.tiny import hf_family, save_family
from tests.tiny_gguf import write_tiny_moe_gguf


def _fused_copy(src, dst, family: str):
    """`src` (save_family's per-expert directory) with its weights as transformers 5's
    state_dict holds them: every expert weight fused, [experts, rows, columns]."""
    from safetensors.torch import save_file
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    fused = {k: v.contiguous() for k, v in hf_family(family).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    save_file(fused, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _check(path, sizes) -> None:
    """Each rank's shard read from `path` by ranges == its part of the whole model, the
    router whole on every rank; the fingerprint a single server's."""
    whole = loader.load(str(path))
    for size in sizes:
        for got in check_ranks(path, whole, size):
            assert torch.equal(got.tensors["layers.0.router"], whole.model.layers[0].router)   # whole, in bf16
    assert shard_read.fingerprint(path) == whole.fingerprint


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_a_ranks_experts_read_by_ranges_from_per_expert_and_fused_tensors_are_its_part_of_the_whole(
        tmp_path, family):
    save_family(family, tmp_path / "per-expert")
    fused = _fused_copy(tmp_path / "per-expert", tmp_path / "fused", family)
    assert shard_read.fingerprint(fused) == shard_read.fingerprint(tmp_path / "per-expert")   # one model
    for path in (tmp_path / "per-expert", fused):
        _check(path, (2, 4))


# Experts 512 columns wide: 16 GGUF blocks of 32, so each of 2 or 4 ranks holds whole blocks
# (every layer routing, as llama.cpp's qwen3moe graph computes).
WIDE = {"qwen3_moe": dict(moe_intermediate_size=512, mlp_only_layers=[]), "mixtral": dict(intermediate_size=512),
        "olmoe": dict(intermediate_size=512)}


@pytest.mark.parametrize("family,qtype,sizes", [
    ("qwen3_moe", "Q4_0", (2, 4)),
    ("mixtral", "Q8_0", (2,)),        # llama.cpp's permuted q/k rows, undone head by head
    # experts' down in Q5_0 (served in bf16: its K split in pairs, from the whole blocks
    # around the rank's columns), gate and up as stored
    ("olmoe", {"blk.*.ffn_down_exps.weight": "Q5_0", "*": "Q8_0"}, (2, 4)),
], ids=["qwen3_moe-q4_0", "mixtral-q8_0", "olmoe-q5_0-down"])
def test_a_ranks_experts_read_by_ranges_from_a_gguf_are_its_part_of_the_whole(tmp_path, family, qtype, sizes):
    path = write_tiny_moe_gguf(tmp_path / "moe.gguf", hf_family(family, **WIDE[family]), qtype)["path"]
    _check(path, sizes)


def test_quantized_experts_split_over_two_processes_give_one_processs_verified_answers(tmp_path):
    path = write_tiny_moe_gguf(tmp_path / "moe.gguf", hf_family("qwen3_moe", **WIDE["qwen3_moe"]), "Q4_0")["path"]
    loaded = loader.load(str(path))
    one = engine(loaded, 1)
    try:
        want = answers(one, PROMPTS[:1])
    finally:
        one.shutdown()
    two = engine(loader.load(str(path)), 2)
    try:
        expert = two.core.model.layers[0].experts[0]
        assert packing.quantized(two.core.model) and expert.down.shape == (64, 256)   # half of each expert's K
        assert answers(two, PROMPTS[:1]) == want
    finally:
        two.shutdown()


def test_experts_in_blocks_too_few_for_every_rank_are_refused_naming_dequantize():
    # 64 columns in blocks of 32: the reference's 16 lanes give rank 0 both blocks, rank 1 none
    with pytest.raises(ValueError, match="64 columns are stored in blocks of 32 values.*--dequantize"):
        shard.layout(moe_config(64), 2, 1, (2, 2, 32))
    assert shard.layout(moe_config(512), 2, 1, (2, 2, 32)).expert_mlp == range(256, 512)   # 8 blocks each
    assert shard.layout(moe_config(64), 2, 1).expert_mlp == range(32, 64)   # bf16: 16 pairs each
