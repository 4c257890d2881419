"""A random-weight Qwen3-MoE GGUF of Qwen3-30B-A3B's shape, written directly in Q4_0 as
llama-quantize's Q4_0 mix stores it, to measure serving memory at scale without a
60 GB bf16 checkpoint to convert.

    python bench/moe_gguf.py OUT.gguf [--layers 4] [--hidden 2048] [--experts 128] ...

The defaults are Qwen3-30B-A3B's: hidden 2048, 48 layers, 32 heads, 4 KV heads, head_dim
128, 128 experts of 768, 8 per token, vocabulary 151936, q/k norms, untied output
(about 17 GB). `--layers 4` writes about 1.8 GB. The types are llama-quantize's for a
Q4_0 file of llama.cpp's converter output: every 2-D and 3-D weight Q4_0 (the token
embedding too), output.weight Q6_K (its default for the output matrix), the router
(ffn_gate_inp) and the norms F32 (the converter stores them so and llama-quantize
leaves them). Values: random 4-bit integers with small positive binary16 scales (Q6_K:
random 6-bit ones); the router N(0, 0.02); norms 1.

The tokenizer is tests/tiny_gguf.py's byte-level BPE (256 tokens, <|im_start|> and
<|im_end|> at 254 and 255) padded with unused three-character tokens to the
vocabulary's size, which gateeng and llama-server both read.

The tensors are written as llama.cpp orders them (the converter's order), each in
slices of at most 32 MiB: the writer never holds more than one slice.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))   # after site-packages: the tests package, nothing it would shadow

# Qwen3-30B-A3B's config.json, as the flags' defaults.
SHAPE = dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, expert_ffn=768,
             experts_used=8, vocab=151936)
ARCH = "qwen3moe"
HELP = dict(hidden="hidden size", layers="decoder layers", heads="attention heads", kv_heads="KV heads",
            head_dim="head dimension", experts="experts per layer", expert_ffn="each expert's intermediate size",
            experts_used="experts per token", vocab="vocabulary size (at least 256)")
SLICE = 32 * 2 ** 20
# GGML type: (values per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q6_K": (256, 210), "F32": (1, 4)}


def tensors(s: dict) -> list:
    """(name, GGUF shape in numpy order, type) of every tensor, in the converter's order."""
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out = [("token_embd.weight", (s["vocab"], h), "Q4_0")]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), "F32"),
                (p + "attn_q.weight", (q, h), "Q4_0"), (p + "attn_k.weight", (kv, h), "Q4_0"),
                (p + "attn_v.weight", (kv, h), "Q4_0"), (p + "attn_output.weight", (h, q), "Q4_0"),
                (p + "attn_q_norm.weight", (s["head_dim"],), "F32"), (p + "attn_k_norm.weight", (s["head_dim"],), "F32"),
                (p + "ffn_norm.weight", (h,), "F32"), (p + "ffn_gate_inp.weight", (s["experts"], h), "F32"),
                (p + "ffn_gate_exps.weight", (s["experts"], s["expert_ffn"], h), "Q4_0"),
                (p + "ffn_up_exps.weight", (s["experts"], s["expert_ffn"], h), "Q4_0"),
                (p + "ffn_down_exps.weight", (s["experts"], h, s["expert_ffn"]), "Q4_0")]
    out += [("output_norm.weight", (h,), "F32"), ("output.weight", (s["vocab"], h), "Q6_K")]
    return out


def nbytes(shape: tuple, kind: str) -> int:
    values, size = BLOCKS[kind]
    if shape[-1] % values:
        raise ValueError(f"{kind} rows are multiples of {values} values, not {shape[-1]}")
    return int(np.prod(shape)) // values * size


def random_blocks(rng, n: int, kind: str) -> np.ndarray:
    """`n` random blocks of `kind`, uint8 [n, bytes per block]."""
    values, size = BLOCKS[kind]
    out = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    d = rng.uniform(2e-4, 2e-3, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if kind == "Q4_0":   # d, then 16 bytes of nibbles
        out[:, 0:2] = d
    else:                # Q6_K: ql[128] qh[64] scales[16] (int8, kept small and positive) d
        out[:, 192:208] = rng.integers(1, 16, size=(n, 16), dtype=np.uint8)
        out[:, 208:210] = d
    return out


def slices(rng, name: str, shape: tuple, kind: str):
    """The tensor's stored bytes, a slice of at most SLICE bytes at a time."""
    if kind == "F32":
        n = int(np.prod(shape))
        values = rng.normal(0, 0.02, n) if name.endswith("ffn_gate_inp.weight") else np.ones(n)
        yield values.astype(np.float32)
        return
    values, size = BLOCKS[kind]
    blocks = int(np.prod(shape)) // values
    step = max(1, SLICE // size)
    for start in range(0, blocks, step):
        yield random_blocks(rng, min(step, blocks - start), kind)


def tokenizer_kv(vocab: int) -> tuple:
    """tests/tiny_gguf.py's byte-level tokenizer, its tokens padded with unused
    three-character ones (never made: there is no merge to make them) to `vocab`."""
    from gguf import GGUFValueType as T
    from tests.tiny_gguf import byte_tokenizer_kv
    kv = {k: (v, t, sub) for k, v, t, sub in byte_tokenizer_kv()}
    tokens, types = kv["tokenizer.ggml.tokens"][0], kv["tokenizer.ggml.token_type"][0]
    if vocab < len(tokens):
        raise ValueError(f"the vocabulary is at least {len(tokens)} tokens, not {vocab}")
    alphabet = [t.decode() for t in tokens[:253]]
    pad = (alphabet[i // 253 ** 2 % 253] + alphabet[i // 253 % 253] + alphabet[i % 253]
           for i in range(vocab - len(tokens)))
    kv["tokenizer.ggml.tokens"] = (tokens + [p.encode() for p in pad], T.ARRAY, T.STRING)
    kv["tokenizer.ggml.token_type"] = (types + [1] * (vocab - len(tokens)), T.ARRAY, T.INT32)
    return tuple((k, v, t, sub) for k, (v, t, sub) in kv.items())


def write(path: Path, s: dict, seed: int = 0) -> int:
    """Write the file; its size in bytes."""
    from gguf import GGML_QUANT_VERSION, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
    table = tensors(s)
    w = GGUFWriter(str(path), ARCH)
    w.add_type("model")
    w.add_name("Random Qwen3-MoE")
    w.add_block_count(s["layers"])
    w.add_context_length(40960)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(6144)
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["experts_used"])
    w.add_expert_feed_forward_length(s["expert_ffn"])
    w.add_file_type(int(LlamaFileType.MOSTLY_Q4_0))
    w.add_vocab_size(s["vocab"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_quantization_version(GGML_QUANT_VERSION)
    for key, value, vtype, sub in tokenizer_kv(s["vocab"]):
        w.add_key_value(key, value, GGUFValueType(vtype), sub_type=None if sub is None else GGUFValueType(sub))
    for name, shape, kind in table:
        if kind == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, kind))
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, kind), raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    out = w.fout[0]
    for name, shape, kind in table:   # as GGUFWriter.write_tensor_data, a slice at a time
        w.write_padding(out, out.tell())
        for part in slices(rng, name, shape, kind):
            part.tofile(out)
        w.write_padding(out, nbytes(shape, kind))
    w.close()
    return path.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out", type=Path, help="the GGUF file to write")
    for key, value in SHAPE.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, help=HELP[key])
    ap.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    args = ap.parse_args()
    size = write(args.out, {k: getattr(args, k) for k in SHAPE}, args.seed)
    print(f"{args.out}: {size / 2 ** 30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
