"""tests/tiny_gguf.py writes Llama GGUF files that transformers reads as llama.cpp's:
its names, q/k permutation, metadata and quantized blocks."""
import struct
from pathlib import Path

import numpy as np
import pytest
import torch


MIXED = {"blk.*.ffn_down.weight": "Q6_K", "output.weight": "Q8_0", "*": "Q4_0"}
# name: (qtype, write_tiny_gguf's other arguments)
CASES = {
    "F32": ("F32", {}),
    "BF16": ("BF16", {}),
    "Q8_0": ("Q8_0", {}),
    "Q4_0": ("Q4_0", {}),
    "Q4_1": ("Q4_1", {}),
    # untied, Q6_K rows of 256 (ffn_down), head_dim other than hidden / heads
    "mixed": (MIXED, dict(tie=False, seed=1, intermediate=256, head_dim=32)),
}
# how far the dequantized weights may be from the source (relative Frobenius error)
TOLERANCE = {"F32": 0.0, "BF16": 0.005, "Q8_0": 0.01, "Q4_0": 0.15, "Q4_1": 0.1, "Q6_K": 0.04}


@pytest.fixture(scope="module")
def written(tiny_gguf):
    return {name: tiny_gguf(qtype, **kw) for name, (qtype, kw) in CASES.items()}


def stored_tensors(path: Path) -> dict:
    """{name: (GGMLQuantizationType, shape as numpy has it, stored bytes as (rows, row bytes))},
    read by hand from the GGUF v3 layout (gguf.GGUFReader takes seconds on the 100k
    tokenizer strings, and this way the check does not lean on gguf-py's reader)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    buf = path.read_bytes()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert (magic, version) == (b"GGUF", 3)
    at = 24
    fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string():
        nonlocal at
        (n,) = struct.unpack_from("<Q", buf, at)
        at += 8 + n
        return buf[at - n:at].decode()

    def skip(vtype):
        nonlocal at
        if vtype == 8:
            string()
        elif vtype == 9:
            sub, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if sub in fixed:
                at += fixed[sub] * count
            else:
                for _ in range(count):
                    skip(sub)
        else:
            at += fixed[vtype]

    alignment = 32
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, at)
        at += 4
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, at)
        skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, at)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        infos.append((name, GGMLQuantizationType(qtype), tuple(reversed(dims)), offset))
    start = -(-at // alignment) * alignment
    out = {}
    for name, qtype, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        data = np.frombuffer(buf, np.uint8, rows * cols // block * size, start + offset)
        out[name] = (qtype, shape, data.reshape(rows, -1))
    return out


def hf_name(gguf_name: str) -> str:
    from tiny_gguf import _LAYER_NAMES, _TOP_NAMES
    base, suffix = gguf_name.rsplit(".", 1)
    top = {v: k for k, v in _TOP_NAMES.items()}
    if base in top:
        return f"{top[base]}.{suffix}"
    _, layer, rest = base.split(".")
    return f"model.layers.{layer}.{ {v: k for k, v in _LAYER_NAMES.items()}[rest]}.{suffix}"


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_reads_the_weights_llama_cpp_would_store(written, gguf_in_transformers, case):
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    info = written[case]
    src, path = info["hf"], info["path"]
    assert path.stat().st_size < 20e6
    loaded = gguf_in_transformers(path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(loaded.config, key) == getattr(src.config, key), key
    assert loaded.config.rms_norm_eps == np.float32(src.config.rms_norm_eps)     # GGUF holds a float32
    assert loaded.config.rope_parameters["rope_theta"] == src.config.rope_parameters["rope_theta"]
    assert loaded.config.vocab_size == 49152

    cfg = src.config
    unpermute = LlamaTensorProcessor(config={"num_attention_heads": cfg.num_attention_heads,
                                             "num_key_value_heads": cfg.num_key_value_heads})
    got = loaded.state_dict()
    want = src.state_dict()
    stored = stored_tensors(path)
    assert ("output.weight" in stored) == (not cfg.tie_word_embeddings)
    assert len(stored) == 3 + 9 * cfg.num_hidden_layers - cfg.tie_word_embeddings
    for gname, (qtype, shape, data) in stored.items():
        kind = qtype.name
        assert kind == info["types"][gname]
        if gname.endswith("norm.weight"):
            assert kind == "F32"
        w = dequantize(data, qtype).reshape(shape)
        w = torch.from_numpy(unpermute.process(w, gname).weights.copy())
        name = hf_name(gname)
        assert torch.equal(got[name], w), gname
        source = want[name]
        if kind == "F32":
            assert torch.equal(w, source), gname
        elif kind == "BF16":
            assert torch.equal(w, source.to(torch.bfloat16).float()), gname
        else:   # quantized: near the source, so the q/k permutation round-trips
            err = ((w - source).norm() / source.norm()).item()
            assert 0 < err < TOLERANCE[kind], (gname, err)
    if cfg.tie_word_embeddings:
        assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])

    ids = torch.tensor([[1, 19556, 905, 2, 7, 300, 4000, 49151]])
    with torch.no_grad():
        a, b = loaded(ids).logits, src(ids).logits
    if case == "F32":   # the same weights and hyperparameters: the same logits
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert torch.isfinite(a).all() and (a - b).abs().max() < 0.5 * b.abs().max()


def test_tokenizer_is_the_embedded_models(written):
    from transformers import AutoTokenizer

    from gateeng.model.loader import default_model_path

    path = written["Q4_0"]["path"]
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    embedded = default_model_path()
    ref = AutoTokenizer.from_pretrained(embedded.parent, gguf_file=embedded.name)
    for text in ("Hello world", " <|im_start|>user\nÉtonnant, 1234 😀"):
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert len(tok) == len(ref) == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert tok.chat_template == ref.chat_template
