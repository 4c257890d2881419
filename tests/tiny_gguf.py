"""A tiny random-weight Llama written as a GGUF file, the way llama.cpp's
convert_hf_to_gguf.py and llama-quantize write one, so tests load quantized models
without a download.

The weights come from a transformers LlamaForCausalLM; the file holds llama.cpp's
tensor names and layout (q and k rows permuted as LlamaModel.permute does, 1-D norms
in F32, output.weight only when untied), the llama.* keys the converter writes, and
every tokenizer.* key of the embedded SmolLM2 GGUF (so the vocabulary is SmolLM2's,
49152 tokens). Quantization is gguf-py's (gguf.quants.quantize: Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, BF16, F16), plus a numpy port of ggml's quantize_row_q6_K_ref for Q6_K,
which gguf-py cannot quantize, and a plain min/max quantizer for Q4_K and Q5_K (ggml's
block layout; not llama-quantize's choice of scales).

Checked once by hand against llama.cpp 11434 (/tmp/llama, not needed by the tests):
convert_hf_to_gguf.py --outtype f32 on the same HF model (and the tokenizer transformers
reads from the SmolLM2 GGUF) writes the same tensor bytes (tied and untied) and the same
metadata values but general.name (and it lacks tokenizer.ggml.add_space_prefix, which
SmolLM2's own tokenizer_config gave its file); llama-quantize --pure on that F32
file to Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16, F16 and Q6_K (hidden 256), and Q4_0 with
--output-tensor-type q6_k --token-embedding-type q8_0, writes the same tensor bytes and
metadata values as this module. Only the order differs: llama-quantize 11434 sorts the
tensors and moves general.file_type/quantization_version last; this module keeps the
converter's order (as the embedded SmolLM2 file does).
"""
from __future__ import annotations

import fnmatch
import functools
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Union

import numpy as np
import torch

QType = Union[str, Mapping[str, str]]

# HF parameter name (after "model.layers.N.") -> llama.cpp tensor name (after "blk.N.")
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """The llama.cpp name of a LlamaForCausalLM parameter (gguf's tensor map for llama)."""
    base, suffix = hf_name.rsplit(".", 1)
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)     # model.layers.N.<rest>
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py / conversion/llama.py): HF's
    rotate-half q/k rows into the interleaved order GGUF stores. Its inverse is
    transformers' LlamaTensorProcessor._reverse_permute_weights."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@functools.lru_cache(maxsize=1)
def _embedded_tokenizer_kv() -> tuple:
    """Every tokenizer.* key of the embedded SmolLM2 GGUF as (key, value, type, sub_type),
    strings kept as their raw bytes. Read once per process (GGUFReader takes seconds: about
    10 s on a 2-core AVX2 EPYC)."""
    from gguf import GGUFReader, GGUFValueType

    from gateeng.model.loader import default_model_path

    reader = GGUFReader(str(default_model_path()))
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == GGUFValueType.STRING:
                value = [field.parts[i].tobytes() for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            out.append((key, value, vtype, sub))
        elif vtype == GGUFValueType.STRING:
            out.append((key, field.parts[field.data[0]].tobytes(), vtype, None))
        else:
            out.append((key, field.parts[field.data[0]].tolist()[0], vtype, None))
    return tuple(out)


def embedded_vocab_size() -> int:
    return len(dict((k, v) for k, v, _, _ in _embedded_tokenizer_kv())["tokenizer.ggml.tokens"])


# ---- Q6_K: ggml's quantize_row_q6_K_ref (ggml-quants.c), what llama-quantize runs
# without an importance matrix, in float32 numpy with C's sequential sums.

def _nearest_int(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)          # ggml's nearest_int: round half to even


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Column sums of a (16, n) float32 array, added top to bottom as C's loop adds."""
    s = a[0].copy()
    for row in a[1:]:
        s += row
    return s


def _make_qx_quants_32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(16, 32, x, L, rmse_type=1, NULL) over the columns of x (16, n):
    (scale (n,), L (16, n))."""
    f32 = np.float32
    amax_at = np.argmax(np.abs(x), axis=0)
    mx = x[amax_at, np.arange(x.shape[1])]
    zero = np.abs(mx) < f32(1e-15)
    mx = np.where(zero, f32(1), mx).astype(f32)
    wx = x * x * x              # C's w*x[i] with w = x[i]*x[i], before the product with l
    w = x * x

    def trial(iscale):
        lf = np.clip(np.rint(iscale * x), f32(-32), f32(31))
        return lf, _seq_sum(wx * lf), _seq_sum(w * lf * lf)

    lf, sumlx, suml2 = trial(f32(-32) / mx)
    L = lf
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0)).astype(f32)
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        lf, sumlx, suml2 = trial(-(f32(32) + f32(0.1) * f32(i)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better, lf, L)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(better, sumlx / suml2, scale).astype(f32)
        best = np.where(better, scale * sumlx, best).astype(f32)
    L = L.astype(np.int32) + 32
    return np.where(zero, f32(0), scale), np.where(zero, 0, L)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K blocks (uint8, rows x row_bytes) of a float array whose rows are multiples of
    256, as ggml's quantize_row_q6_K_ref writes them (block: ql[128] qh[64] scales[16] d)."""
    f32 = np.float32
    rows, cols = data.shape
    if cols % 256:
        raise ValueError(f"Q6_K needs rows that are a multiple of 256 values, not {cols}")
    x = np.ascontiguousarray(data, dtype=f32).reshape(-1, 16)         # sub-blocks of 16
    scales, L = _make_qx_quants_32(np.ascontiguousarray(x.T))
    nb = len(x) // 16
    scales = scales.reshape(nb, 16)
    L = L.T.reshape(nb, 16, 16)
    at = np.argmax(np.abs(scales), axis=1)
    max_scale = scales[np.arange(nb), at]
    zero = np.abs(max_scale) < f32(1e-15)
    iscale = f32(-128) / np.where(zero, f32(1), max_scale).astype(f32)
    d16 = (f32(1) / iscale).astype(np.float16)
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales)).astype(np.int8)
    d = d16.astype(f32)[:, None] * sc.astype(f32)                      # (nb, 16)
    xb = x.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq = np.clip(_nearest_int(xb / d[:, :, None]), -32, 31) + 32
    L = np.where((d != 0)[:, :, None], lq, L).astype(np.uint8).reshape(nb, 2, 4, 32)
    lo, hi = L & 0xF, L >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8),
                             d16.reshape(nb, 1).view(np.uint8)], axis=1)
    blocks[zero] = 0
    return blocks.reshape(rows, cols // 256 * 210)


def quantize_q45_k(data: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K (bits 4) or Q5_K (bits 5) blocks (uint8, rows x row_bytes) of a float array
    whose rows are multiples of 256: valid blocks by a plain min/max rule per sub-block
    of 32 (scale (max - min) / (2^bits - 1), minimum -min(min, 0)), the sub-block scales
    and minimums as 6-bit multiples of d and dmin. Not llama-quantize's search for the
    best scales (make_qkx2_quants): the bytes differ from its, the layout is ggml's."""
    f32, top = np.float32, (1 << bits) - 1
    rows, cols = data.shape
    if cols % 256:
        raise ValueError(f"Q{bits}_K needs rows that are a multiple of 256 values, not {cols}")
    x = np.ascontiguousarray(data, dtype=f32).reshape(-1, 8, 32)       # super-blocks of 8 sub-blocks
    nb = len(x)
    low = np.minimum(x.min(-1), 0)
    step = ((x.max(-1) - low) / top).astype(f32)
    d16 = (step.max(-1) / 63).astype(np.float16)
    dmin16 = ((-low).max(-1) / 63).astype(np.float16)
    d, dmin = d16.astype(f32)[:, None], dmin16.astype(f32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.clip(_nearest_int(step / d), 0, 63), 0)
        mn = np.where(dmin > 0, np.clip(_nearest_int(-low / dmin), 0, 63), 0)
        scale, offset = (d * sc)[..., None], (dmin * mn)[..., None]
        q = np.where(scale > 0, np.clip(_nearest_int((x + offset) / scale), 0, top), 0).astype(np.uint8)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    qs = np.concatenate([(q[:, 2 * i] & 15) | ((q[:, 2 * i + 1] & 15) << 4) for i in range(4)], axis=1)
    parts = [d16.reshape(nb, 1).view(np.uint8), dmin16.reshape(nb, 1).view(np.uint8), scales]
    if bits == 5:
        parts.append(np.bitwise_or.reduce([(q[:, j] >> 4) << j for j in range(8)], axis=0).astype(np.uint8))
    blocks = np.concatenate(parts + [qs], axis=1)
    return blocks.reshape(rows, cols // 256 * (144 if bits == 4 else 176))


def quantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """`data` (float32, 2-D) in GGML type `qtype`, as the bytes (or floats) GGUF stores."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf import quants

    t = GGMLQuantizationType[qtype]
    block = GGML_QUANT_SIZES[t][0]
    if data.shape[-1] % block:
        raise ValueError(f"{qtype} needs rows that are a multiple of {block} values, not {data.shape[-1]} "
                         "(llama-quantize would fall back to another type)")
    if data.ndim > 2:   # stacked experts: each row on its own, as for a matrix
        return quantize(data.reshape(-1, data.shape[-1]), qtype).reshape(*data.shape[:-1], -1)
    if t == GGMLQuantizationType.Q6_K:
        return quantize_q6_k(data)
    if t in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        return quantize_q45_k(data, 4 if t == GGMLQuantizationType.Q4_K else 5)
    return quants.quantize(np.ascontiguousarray(data, dtype=np.float32), t)


def _type_for(name: str, spec: Mapping[str, str]) -> str:
    for pattern, t in spec.items():
        if fnmatch.fnmatchcase(name, pattern):
            return t.upper()
    raise ValueError(f"no type given for {name}: add a '*' entry")


def tiny_llama(vocab_size: int, seed: int = 0, tie: bool = True, hidden: int = 64, intermediate: int = 128,
               layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
               max_positions: int = 2048):
    """A random float32 LlamaForCausalLM (2-D weights N(0, 0.1), norm weights U(0.5, 1.5)),
    with SmolLM2's special ids (bos 1, eos and pad 2); the global torch RNG is untouched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim or hidden // heads, max_position_embeddings=max_positions,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=tie,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        m = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1, generator=g)
            else:
                p.uniform_(0.5, 1.5, generator=g)
    return m


def write_tiny_gguf(path, qtype: QType, seed: int = 0, tie: bool = True, hidden=64, intermediate=128, layers=2,
                    heads=4, kv_heads=2, head_dim=None, edit=None, byte_vocab: bool = False) -> dict:
    """Write a tiny random-weight Llama to `path` as llama.cpp's convert_hf_to_gguf.py
    plus llama-quantize would, and return {"hf": the float32 LlamaForCausalLM it holds,
    "path": Path(path), "types": {gguf tensor name: type name}, "file_type": the
    general.file_type written, "vocab_size": 49152 (256 with byte_vocab)}.

    qtype: the type of every 2-D weight ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K",
    "BF16", "F16" or "F32"), or a dict {fnmatch pattern on the GGUF tensor name: type}
    for a mixed file, the first matching pattern winning, e.g.
    {"output.weight": "Q6_K", "*": "Q4_0"} (with tie=False: a tied model has no
    output.weight; with hidden a multiple of 256, as Q6_K's rows must be). Unlike
    llama-quantize's default mixes, a plain str gives every 2-D tensor that type
    (llama-quantize Q4_1 on SmolLM2 gives {"token_embd.weight": "Q8_0", "*": "Q4_1"}).
    1-D tensors (the norms) are always F32. general.file_type is the '*' type's (else
    the commonest). Rows must be a multiple of the type's block (32; 256 for Q6_K).
    `edit`: called on the model (under no_grad) before it is written, to set weights.
    `byte_vocab`: byte_tokenizer_kv's 256 tokens instead of the embedded 49152 (a file
    written in a second; its special ids are that tokenizer's).
    """
    spec = {"*": qtype} if isinstance(qtype, str) else dict(qtype)
    vocab = 256 if byte_vocab else embedded_vocab_size()
    head_dim = head_dim or hidden // heads
    hf = tiny_llama(vocab, seed, tie, hidden, intermediate, layers, heads, kv_heads, head_dim)
    if edit is not None:
        with torch.no_grad():
            edit(hf)

    tensors = []
    for name, t in sorted(hf.state_dict().items()):     # safetensors' order, as the converter reads it
        if tie and name == "lm_head.weight":
            continue
        g = gguf_name(name)
        w = t.detach().to(torch.float32).numpy()
        if g.endswith("attn_q.weight"):
            w = permute(w, heads, heads)
        elif g.endswith("attn_k.weight"):
            w = permute(w, heads, kv_heads)
        tensors.append((g, w, _type_for(g, spec) if w.ndim == 2 else "F32"))
    types = {g: t for g, _, t in tensors}

    file_type = write_file(path, "llama", "Tiny Random Llama", hf, tensors, spec,
                           tokenizer=byte_tokenizer_kv() if byte_vocab else ())
    return {"hf": hf, "path": Path(path), "types": types, "file_type": file_type, "vocab_size": vocab}


def byte_tokenizer_kv() -> tuple:
    """A 256-token byte-level BPE as tokenizer.* keys: the 253 first bytes of GPT-2's
    alphabet, one merge of the first two, then <|im_start|> (bos, 254) and <|im_end|>
    (eos, 255), the special ids of tests/tiny.py's models. transformers reads it in a second, where
    the embedded 49152-token vocabulary takes a minute."""
    from gguf import GGUFValueType as T
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet[:253] + [alphabet[0] + alphabet[1], "<|im_start|>", "<|im_end|>"]
    return (("tokenizer.ggml.model", b"gpt2", T.STRING, None), ("tokenizer.ggml.pre", b"default", T.STRING, None),
            ("tokenizer.ggml.tokens", [t.encode() for t in tokens], T.ARRAY, T.STRING),
            ("tokenizer.ggml.token_type", [1] * 254 + [3, 3], T.ARRAY, T.INT32),
            ("tokenizer.ggml.merges", [f"{alphabet[0]} {alphabet[1]}".encode()], T.ARRAY, T.STRING),
            ("tokenizer.ggml.bos_token_id", 254, T.UINT32, None), ("tokenizer.ggml.eos_token_id", 255, T.UINT32, None))


def write_file(path, arch: str, name: str, hf, tensors: list, spec: Mapping[str, str], extra=None,
               tokenizer: tuple = ()) -> int:
    """Write `tensors` [(GGUF name, float32 array, type)] of the transformers model `hf`
    to `path` as a GGUF of `arch`, with the keys llama.cpp's converter writes (`extra`:
    a function that adds the architecture's own to the writer) and `tokenizer`'s keys
    (default: the embedded tokenizer's); the general.file_type written back (the '*'
    type's, else the commonest)."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType, GGML_QUANT_VERSION

    cfg = hf.config
    base = spec.get("*", "").upper() or Counter(t for _, w, t in tensors if w.ndim >= 2).most_common(1)[0][0]
    base = {"Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}.get(base, base)   # llama.cpp's file types name the K mixes
    file_type = int(LlamaFileType.ALL_F32 if base == "F32" else LlamaFileType[f"MOSTLY_{base}"])
    writer = GGUFWriter(str(path), arch)
    writer.add_type("model")
    writer.add_name(name)
    writer.add_size_label(f"{sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if extra is not None:
        extra(writer)
    writer.add_file_type(file_type)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    for key, value, vtype, sub in tokenizer or _embedded_tokenizer_kv():
        writer.add_key_value(key, value, GGUFValueType(vtype), sub_type=None if sub is None else GGUFValueType(sub))
    for g, w, t in tensors:
        data = quantize(w, t)
        if t in ("F32", "F16"):
            writer.add_tensor(g, data)
        else:
            writer.add_tensor(g, data, raw_dtype=GGMLQuantizationType[t])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file_type


# A mixture of experts as llama.cpp's converter writes it (conversion/qwen.py Qwen3MoeModel,
# conversion/llama.py for Mixtral): the family's GGUF architecture, the router as
# ffn_gate_inp, each projection's experts stacked in one [experts, rows, columns] tensor,
# q/k norms as attn_q_norm/attn_k_norm. Checked once by hand against llama.cpp 11434:
# convert_hf_to_gguf.py --outtype bf16 on tiny.py's Qwen3-MoE (every layer routing) and
# Mixtral writes these names, shapes and expert keys (Mixtral: no
# expert_feed_forward_length), and gateeng reads from its files the HF directory's weights.
# OLMoE (conversion/olmo.py OlmoeModel, architecture olmoe): q and k rows not permuted,
# q/k norms over the whole projection, the experts feed_forward_length wide; checked the
# same way (tests/test_olmoe_gguf.py).
MOE_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
_MOE_LAYER_NAMES = {**_LAYER_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                    "mlp.gate": "ffn_gate_inp"}


def moe_tensors(hf, arch: str) -> list:
    """(GGUF name, float32 array) of a transformers 5 mixture of experts (fused experts:
    mlp.experts.gate_up_proj [experts, 2 inter, hidden], down_proj [experts, hidden,
    inter]), in the converter's names and layout."""
    cfg = hf.config
    out = []
    for name, t in sorted(hf.state_dict().items()):
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        w = t.detach().to(torch.float32).numpy()
        if ".mlp.experts." in name:
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):
                inter = w.shape[1] // 2
                out += [(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(w[:, :inter])),
                        (f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(w[:, inter:]))]
            else:
                out.append((f"blk.{layer}.ffn_down_exps.weight", w))
            continue
        base, suffix = name.rsplit(".", 1)
        if base in _TOP_NAMES:
            out.append((f"{_TOP_NAMES[base]}.{suffix}", w))
            continue
        _, _, layer, rest = base.split(".", 3)
        g = f"blk.{layer}.{_MOE_LAYER_NAMES[rest]}.{suffix}"
        if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):   # LlamaModel.permute
            w = permute(w, cfg.num_attention_heads, None if rest.endswith("q_proj") else cfg.num_key_value_heads)
        out.append((g, w))
    return out


def write_tiny_moe_gguf(path, hf, qtype: QType, tokenizer: tuple = ()) -> dict:
    """Write the transformers mixture of experts `hf` (a tiny random one of tests/tiny.py,
    vocabulary 256, bos 254 and eos 255) to `path` as llama.cpp's converter plus
    llama-quantize would, with `tokenizer`'s keys (write_file's form; default
    byte_tokenizer_kv's); {"path", "types": {gguf name: type}}. qtype as
    write_tiny_gguf's; the router (ffn_gate_inp) and 1-D tensors stay F32, as
    llama-quantize keeps them."""
    spec = {"*": qtype} if isinstance(qtype, str) else dict(qtype)
    cfg, arch = hf.config, MOE_ARCH[hf.config.model_type]
    tensors = [(g, w, "F32" if w.ndim == 1 or g.endswith("ffn_gate_inp.weight") else _type_for(g, spec))
               for g, w in moe_tensors(hf, arch)]

    def experts(writer):
        writer.add_expert_count(cfg.num_local_experts if arch == "llama" else cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None) is not None:
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    write_file(path, arch, f"Tiny Random {cfg.model_type}", hf, tensors, spec, experts,
               tokenizer or byte_tokenizer_kv())
    return {"path": Path(path), "types": {g: t for g, _, t in tensors}}
