"""Models the benches make: a random-weight Llama of a given shape as a bf16 Hugging
Face directory (with the embedded model's tokenizer and vocabulary), the GGUF
llama.cpp's own converter writes from it, and llama-quantize's copies of a GGUF in
other types.

    python bench/models.py --shape 1b --out DIR [--convert PATH/convert_hf_to_gguf.py]
        [--llama-quantize PATH --types Q8_0 Q4_0]

llama.cpp's converter runs under this Python and needs llama.cpp's own requirements
for it (`pip install sentencepiece`, with numpy, torch and transformers already here).

Shapes: `1b` is TinyLlama-1.1B's (2048 hidden, 5632 MLP, 22 layers, 32 heads, 4 KV
heads) with SmolLM2's 49152-token vocabulary: 1.17B parameters, 2.3 GB in bf16.
`moe-1.8b` is a Qwen3-MoE (1024 hidden, 16 layers, 64 experts of 512, 8 per token):
1.8B parameters, about 0.3B active per token; `moe-tiny` a small Qwen3-MoE.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

# name -> (hidden, intermediate, layers, heads, KV heads)
SHAPES = {"1b": (2048, 5632, 22, 32, 4), "360m": (960, 2560, 32, 15, 5)}
# Qwen3-MoE shapes, name -> (hidden, expert intermediate, layers, heads, KV heads, experts, experts per token):
# `moe-1.8b` is a 1.8B-total model with about 0.3B parameters active per token; `moe-tiny`
# a small one for end-to-end runs (its vocabulary is still SmolLM2's).
MOE_SHAPES = {"moe-1.8b": (1024, 512, 16, 16, 4, 64, 8), "moe-tiny": (256, 128, 4, 4, 2, 8, 2)}


def random_llama(out: Path, shape: str) -> Path:
    """A random-weight Llama (a Qwen3-MoE for MOE_SHAPES) of `shape` as a bf16 HF
    directory, with the embedded model's tokenizer and vocabulary; `out` is reused where
    it already holds one."""
    from gateeng.model.loader import default_model_path, ensure_hf_dir
    src = ensure_hf_dir(default_model_path())
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        _copy_tokenizer(src, out)
        return out
    import torch
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    moe = shape in MOE_SHAPES
    hidden, inter, layers, heads, kv, *experts = MOE_SHAPES[shape] if moe else SHAPES[shape]
    config.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=hidden // heads, tie_word_embeddings=False, dtype="bfloat16",
                  model_type="llama", architectures=["LlamaForCausalLM"])   # what llama.cpp's converter reads
    if moe:
        config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=experts[0],
                      num_experts_per_tok=experts[1], moe_intermediate_size=inter, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None,
                      attention_bias=False, router_aux_loss_coef=0.001, output_router_logits=False)
    vocab, hd = config["vocab_size"], hidden // heads
    gen = torch.Generator().manual_seed(0)

    def rand(*s):
        return (torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16)

    def ones():
        return torch.ones(hidden, dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "lm_head.weight": rand(vocab, hidden),
               "model.norm.weight": ones()}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
                        p + "self_attn.q_proj.weight": rand(heads * hd, hidden),
                        p + "self_attn.k_proj.weight": rand(kv * hd, hidden),
                        p + "self_attn.v_proj.weight": rand(kv * hd, hidden),
                        p + "self_attn.o_proj.weight": rand(hidden, heads * hd)})
        if not moe:
            tensors.update({p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                            p + "mlp.down_proj.weight": rand(hidden, inter)})
            continue
        tensors.update({p + "self_attn.q_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                        p + "self_attn.k_norm.weight": torch.ones(hd, dtype=torch.bfloat16),
                        p + "mlp.gate.weight": rand(experts[0], hidden)})
        for j in range(experts[0]):   # one tensor per expert, as the hub stores them
            tensors.update({f"{p}mlp.experts.{j}.gate_proj.weight": rand(inter, hidden),
                            f"{p}mlp.experts.{j}.up_proj.weight": rand(inter, hidden),
                            f"{p}mlp.experts.{j}.down_proj.weight": rand(hidden, inter)})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _copy_tokenizer(src, out)
    params = sum(t.numel() for t in tensors.values())
    print(f"wrote {out}: {params / 1e9:.2f}B parameters", file=sys.stderr, flush=True)
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    """The embedded model's tokenizer and chat template into `out`."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def _written(out: Path, command, quiet: bool = False) -> Path:
    """`out`, written by `command(partial path)` unless it exists: the file takes its
    name only once the command has succeeded, so a run killed half-way is not reused."""
    if not out.is_file():
        part = out.with_name(out.name + ".part")
        subprocess.run(command(part), check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL if quiet else None)
        part.replace(out)
    return out


def to_gguf(converter: str, hf_dir: Path, out: Path) -> Path:
    """The BF16 GGUF llama.cpp's converter (convert_hf_to_gguf.py) writes from hf_dir."""
    return _written(out, lambda part: [sys.executable, converter, str(hf_dir), "--outtype", "bf16",
                                       "--outfile", str(part)])


def quantized(quantize: str, gguf: Path, kind: str, out: Path) -> Path:
    """llama-quantize's copy of `gguf` in `kind` (BF16, Q8_0, Q4_0, ...)."""
    return _written(out, lambda part: [quantize, "--allow-requantize", str(gguf), str(part), kind], quiet=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default="1b")
    ap.add_argument("--out", required=True, help="folder for the HF directory and the GGUF files")
    ap.add_argument("--convert", default=None, help="llama.cpp's convert_hf_to_gguf.py: also write a BF16 GGUF")
    ap.add_argument("--llama-quantize", default=None, help="llama-quantize: also write --types copies")
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0"])
    args = ap.parse_args()
    out = Path(args.out)
    hf = random_llama(out / f"random-{args.shape}", args.shape)
    if args.convert:
        gguf = to_gguf(args.convert, hf, out / f"random-{args.shape}-BF16.gguf")
        print(gguf)
        if args.llama_quantize:
            for kind in args.types:
                print(quantized(args.llama_quantize, gguf, kind, out / f"random-{args.shape}-{kind}.gguf"))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
