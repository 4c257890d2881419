"""A tensor-parallel rank's shard read by byte ranges from a safetensors checkpoint or a
GGUF file (model.shard_read): the same tensors, bit for bit, as the rank's part of the
whole model loaded and split (model.shard.shard_tensors), the same fingerprint as a
single server's, and a rank's peak memory far below the whole model's bytes."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gateeng.model import loader, shard, shard_read

from gateeng.plans import packing
from gateeng.plans.cpu_linear import Packed, Stacked
from tiny import save_family
from tiny_gguf import write_tiny_gguf


def _split_whole(path, size):
    whole = loader.load(str(path), dtype="bfloat16")
    lays = [shard.layout(whole.config, size, r) for r in range(size)]
    return whole, shard.shard_tensors(whole.model, lays)


@pytest.mark.parametrize("family,tie,sizes", [("llama", True, (2, 4)), ("qwen2", False, (2,)),
                                              ("qwen3", False, (2,))])
def test_a_ranks_shard_read_by_ranges_is_its_part_of_the_whole_model(tmp_path, family, tie, sizes):
    # llama at size 4: 2 KV heads over 4 ranks, so attention stays whole on every rank
    # (o still splits by K); qwen2: q/k/v biases split by head; qwen3: per-head q/k norms.
    save_family(family, tmp_path, tie=tie)
    for size in sizes:
        whole, parts = _split_whole(tmp_path, size)
        for rank in range(size):
            got = shard_read.read_shard(tmp_path, size, rank)
            assert got.layout == shard.layout(whole.config, size, rank)
            assert set(got.tensors) == set(parts[rank])
            for name, t in parts[rank].items():
                assert got.tensors[name].dtype == torch.bfloat16
                assert torch.equal(got.tensors[name], t), (family, size, rank, name)
    assert shard_read.fingerprint(tmp_path) == whole.fingerprint


def _same(a, b) -> bool:
    """Two shard tensors equal: plain tensors bit for bit; packed ones (a GGUF's quantized
    weights) in their records, shape and lanes."""
    if isinstance(a, Stacked) or isinstance(b, Stacked):
        return (type(a) is type(b) and len(a.parts) == len(b.parts)
                and all(_same(x, y) for x, y in zip(a.parts, b.parts)))
    if isinstance(a, Packed) or isinstance(b, Packed):
        return (type(a) is type(b) and (a.n, a.k, a.per) == (b.n, b.k, b.per) and a.data.dtype == b.data.dtype
                and torch.equal(a.data, b.data))
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("qtype,size,shape", [
    # heads and o's GGUF blocks split alike: attention by head, q and k unpermuted head by head
    ("Q4_0", 2, dict(hidden=64, heads=4, kv_heads=2, head_dim=128, intermediate=512)),
    # the K-quants as stored, an untied Q6_K lm_head; attention whole on every rank
    ({"blk.*.ffn_down.weight": "Q6_K", "blk.*.ffn_gate.weight": "Q5_K", "output.weight": "Q6_K", "*": "Q4_K"},
     2, dict(hidden=256, heads=2, kv_heads=1, head_dim=128, intermediate=4096, layers=1, tie=False)),
    # a stack of two types (q, k in Q8_0, v in Q4_1), down in Q5_0 (served in bf16: its K
    # split in pairs, read from the whole blocks around the rank's columns), an F16
    # embedding beside a Q8_0 lm_head
    ({"blk.*.attn_v.weight": "Q4_1", "blk.*.ffn_down.weight": "Q5_0", "token_embd.weight": "F16",
      "output.weight": "Q8_0", "*": "Q8_0"}, 4, dict(hidden=64, heads=4, kv_heads=4, head_dim=16,
                                                     intermediate=192, tie=False)),
], ids=["q4_0", "k-quants", "stack-converted-f16"])
def test_a_ranks_shard_read_by_ranges_from_a_gguf_is_its_part_of_the_whole_model(tmp_path, qtype, size, shape):
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype, **shape)["path"]
    whole = loader.load(str(path))
    assert packing.quantized(whole.model)
    check_ranks(path, whole, size)
    assert shard_read.fingerprint(path) == whole.fingerprint


def check_ranks(path, whole, size: int) -> list:
    """Each rank's shard read from `path` by ranges is its part of `whole` (loaded from
    it) split at `size` (with row_units' units), bit for bit; the shards read."""
    units = shard.row_units(whole.model, size)
    lays = [shard.layout(whole.config, size, r, units) for r in range(size)]
    parts = shard.shard_tensors(whole.model, lays)
    out = []
    for rank in range(size):
        got = shard_read.read_shard(path, size, rank)
        assert got.layout == lays[rank]
        assert got.stored_types == packing.of(whole.model).stored_types
        assert set(got.tensors) == set(parts[rank])
        for name, t in parts[rank].items():
            assert _same(got.tensors[name], t), (path.name, size, rank, name)
        out.append(got)
    return out


def test_a_dequantized_gguf_and_a_path_that_is_no_model_are_refused_by_name(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="weights.bin: a rank's shard is read from"):
        shard_read.read_shard(tmp_path / "weights.bin", 2, 0)
    # a GGUF is read as stored: its --dequantize (converted whole) is refused, not served otherwise
    gguf = write_tiny_gguf(tmp_path / "q.gguf", "Q8_0")["path"]
    assert shard_read.refusal(gguf) == ""
    assert shard_read.source(None) == shard_read.source("") == loader.default_model_path()   # as load reads it
    with pytest.raises(ValueError, match="q.gguf: a rank reads a GGUF's weights as stored, and --dequantize"):
        shard_read.unloaded(gguf, dequantize=True)


# About 670 MB of bf16 weights (20 layers of 33.5 MB): a rank's half and the reading
# process's own memory (torch's import alone holds about 230 MB) stay below it only if
# the rank reads no more than its half.
BIG = dict(vocab_size=256, hidden_size=1024, intermediate_size=5632, num_hidden_layers=20,
           num_attention_heads=16, num_key_value_heads=8, head_dim=64)


def _write_big(path, layers: int = BIG["num_hidden_layers"]) -> int:
    """A random bf16 Llama of BIG's shape (with `layers` layers) as a safetensors
    directory; its weights' bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    LlamaConfig(**dict(BIG, num_hidden_layers=layers), max_position_embeddings=256,
                tie_word_embeddings=True).save_pretrained(path)
    h, i, d = BIG["hidden_size"], BIG["intermediate_size"], BIG["head_dim"]
    q, kv = BIG["num_attention_heads"] * d, BIG["num_key_value_heads"] * d
    gen = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": (BIG["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(layers):
        pre = f"model.layers.{n}."
        sd.update({pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,),
                   pre + "self_attn.q_proj.weight": (q, h), pre + "self_attn.k_proj.weight": (kv, h),
                   pre + "self_attn.v_proj.weight": (kv, h), pre + "self_attn.o_proj.weight": (h, q),
                   pre + "mlp.gate_proj.weight": (i, h), pre + "mlp.up_proj.weight": (i, h),
                   pre + "mlp.down_proj.weight": (h, i)})
    sd = {name: torch.randn(shape, generator=gen, dtype=torch.bfloat16) for name, shape in sd.items()}
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in sd.values())   # sd goes with this call


PEAK = textwrap.dedent("""
    import json, sys
    from gateeng.model import shard_read

    def kib(field):
        return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(field)))
    before = kib("VmRSS:")
    got = shard_read.read_shard(sys.argv[1], 2, int(sys.argv[2]))
    held = sum(t.numel() * t.element_size() for t in got.tensors.values())
    fingerprint = shard_read.fingerprint(sys.argv[1]) if sys.argv[2] == "0" else ""
    print(json.dumps(dict(before=before * 1024, peak=kib("VmHWM:") * 1024, held=held, fingerprint=fingerprint)))
""")


def test_a_rank_never_holds_the_whole_model(tmp_path):
    model_bytes = _write_big(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for rank in (0, 1):
        out = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path), str(rank)], env=env, check=True,
                             capture_output=True, text=True, timeout=300).stdout
        got = json.loads(out.strip().splitlines()[-1])
        # Its half of the layers' weights, and the whole (small) embedding twice over
        # (the embedding and the tied lm_head's rows), nothing more.
        assert 0.45 * model_bytes < got["held"] < 0.55 * model_bytes
        # Reading (and, rank 0, hashing every tensor for the fingerprint) adds its shard
        # and one tensor's slice at most; the process's whole peak stays below the model.
        assert got["peak"] - got["before"] < got["held"] + (64 << 20), got
        assert got["peak"] < model_bytes, got
        if rank == 0:
            assert got["fingerprint"] == loader.model_fingerprint(
                loader.read_model_config(tmp_path), loader.Checkpoint(loader.weight_files(tmp_path)))


def test_a_down_in_blocks_too_few_for_every_rank_is_refused_naming_dequantize(tmp_path):
    # down's 64 columns in Q8_0 blocks of 32: the reference's 16 lanes give rank 0 both
    # blocks, rank 1 none; refused before any rank starts (its plans could not be built)
    path = write_tiny_gguf(tmp_path / "q.gguf", {"blk.*.ffn_down.weight": "Q8_0", "*": "BF16"}, hidden=64,
                           heads=4, kv_heads=2, head_dim=128, intermediate=64)["path"]
    with pytest.raises(ValueError, match="down projection's 64 columns are stored in blocks of 32 values.*"
                                         "--dequantize at this tensor-parallel size"):
        shard_read.read_shard(path, 2, 1)
    cfg = shard_read.read_shard(path, 1, 0).config
    assert shard.layout(cfg, 2, 1).mlp == range(32, 64)   # bf16: 16 pairs each
