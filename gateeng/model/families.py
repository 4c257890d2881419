"""The model families the engine runs: one entry each, and the only place a model type
is named.

An entry says how the family's config.json is read (its attention terms, the fields
its transformers class defaults differently), which GGUF architecture llama.cpp writes
it as, and its decoder block: each weight as LlamaModel holds it, with its parts'
names in transformers' checkpoints and in GGUF files, their shapes and how they stack.
The loader, the GGUF reader, the sharder, the trainer's save (LlamaModel.hf_state_dict)
and weight updates all read this table, so a new family is one entry of FAMILIES (and,
where its block differs, one Block). The table is data: it imports no torch and no
model code (import-linter).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gateeng.config import ModelConfig


def dims(cfg: ModelConfig) -> dict:
    """The sizes a weight's rows and columns are named by (Weight.rows, .cols)."""
    return {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "head": cfg.head_dim,
            "q": cfg.num_heads * cfg.head_dim, "kv": cfg.num_kv_heads * cfg.head_dim,
            "inter": cfg.intermediate_size}


@dataclass(frozen=True)
class Weight:
    """One weight as LlamaModel holds it: its parts stacked by rows (q, k, v; gate, up),
    each named as transformers and as llama.cpp name it."""
    attr: str             # the parameter's name on a layer (or on the model)
    hf: tuple             # each part's transformers name (a layer's: below Block.hf_layers{i}.)
    gguf: tuple           # each part's GGUF name (a layer's: below Block.gguf_layers{i}.)
    rows: tuple           # each part's rows, by size name (dims)
    cols: str = ""        # the columns' size name; "" for a vector
    when: str = ""        # the ModelConfig flag it exists under; "" always
    rotary: tuple = ()    # per part: its rows are RoPE heads (llama.cpp permutes them in some families)

    def present(self, cfg: ModelConfig) -> bool:
        return not self.when or bool(getattr(cfg, self.when))

    def parts(self, cfg: ModelConfig) -> list:
        """Each part's row count: where the stacked weight splits."""
        size = dims(cfg)
        return [size[r] for r in self.rows]

    def shapes(self, cfg: ModelConfig) -> list:
        """Each part's shape as a checkpoint stores it."""
        size = dims(cfg)
        return [(size[r], size[self.cols]) if self.cols else (size[r],) for r in self.rows]


def _each(pattern: str, names: str = "qkv") -> tuple:
    return tuple(pattern.format(n) for n in names)


@dataclass(frozen=True)
class Block:
    """A decoder's weights: the model's own (embedding, final norm, lm_head) and each
    layer's, in transformers' order (the order hf_state_dict writes and checkpoints
    load in)."""
    layer: tuple
    # The order a GGUF's layer tensors are read in, which is the order its fingerprint
    # hashes them: keep it so, or every GGUF model's fingerprint moves.
    gguf_order: tuple
    embed: Weight
    norm: Weight
    lm_head: Weight       # absent where the embedding is tied
    hf_layers: str = "model.layers."
    gguf_layers: str = "blk."

    def weights(self, cfg: ModelConfig) -> list:
        """The layer weights `cfg` has, in transformers' order."""
        return [w for w in self.layer if w.present(cfg)]

    def gguf_weights(self, cfg: ModelConfig) -> list:
        """The layer weights `cfg` has, in the order a GGUF is read."""
        by_attr = {w.attr: w for w in self.weights(cfg)}
        return [by_attr[a] for a in self.gguf_order if a in by_attr]

    def gguf_model_names(self) -> tuple:
        """The GGUF names of the model's own tensors (outside the layers)."""
        return self.embed.gguf + self.norm.gguf + self.lm_head.gguf


DECODER = Block(
    layer=(
        Weight("input_norm", ("input_layernorm.weight",), ("attn_norm.weight",), ("hidden",)),
        Weight("post_norm", ("post_attention_layernorm.weight",), ("ffn_norm.weight",), ("hidden",)),
        Weight("qkv", _each("self_attn.{}_proj.weight"), _each("attn_{}.weight"), ("q", "kv", "kv"), "hidden",
               rotary=(True, True, False)),
        Weight("qkv_bias", _each("self_attn.{}_proj.bias"), _each("attn_{}.bias"), ("q", "kv", "kv"),
               when="qkv_bias"),
        Weight("o", ("self_attn.o_proj.weight",), ("attn_output.weight",), ("hidden",), "q"),
        Weight("o_bias", ("self_attn.o_proj.bias",), ("attn_output.bias",), ("hidden",), when="o_bias"),
        Weight("q_norm", ("self_attn.q_norm.weight",), ("attn_q_norm.weight",), ("head",), when="qk_norm"),
        Weight("k_norm", ("self_attn.k_norm.weight",), ("attn_k_norm.weight",), ("head",), when="qk_norm"),
        Weight("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), ("ffn_gate.weight", "ffn_up.weight"),
               ("inter", "inter"), "hidden"),
        Weight("down", ("mlp.down_proj.weight",), ("ffn_down.weight",), ("hidden",), "inter"),
    ),
    gguf_order=("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up", "down"),
    embed=Weight("embed", ("model.embed_tokens.weight",), ("token_embd.weight",), ("vocab",), "hidden"),
    norm=Weight("norm", ("model.norm.weight",), ("output_norm.weight",), ("hidden",)),
    lm_head=Weight("lm_head", ("lm_head.weight",), ("output.weight",), ("vocab",), "hidden"),
)


@dataclass(frozen=True)
class Family:
    """One model family: how its config.json is read and how its weights are named."""
    model_type: str                    # transformers' config.json model_type
    qkv_bias: Optional[bool] = None    # q, k and v biases; None: as config.json's attention_bias says
    o_bias: Optional[bool] = None      # o's bias; None: as attention_bias says
    qk_norm: bool = False              # RMSNorm of each head's q and k before RoPE
    # config.json fields its transformers class defaults to something other than what
    # ModelConfig.from_hf assumes when they are absent (hf_config reads such a file
    # through transformers).
    required: tuple = ()
    gguf: str = ""                     # the GGUF general.architecture read natively as this family
    gguf_permuted: bool = False        # llama.cpp's converter interleaves its q and k rotary rows
    block: Block = DECODER

    def config(self, hf) -> ModelConfig:
        """The ModelConfig of a transformers config (or config.json's fields as attributes)."""
        bias = bool(getattr(hf, "attention_bias", False))
        return ModelConfig.from_hf(hf, qkv_bias=bias if self.qkv_bias is None else self.qkv_bias,
                                   o_bias=bias if self.o_bias is None else self.o_bias, qk_norm=self.qk_norm)


_FAMILIES = (
    Family("llama", gguf="llama", gguf_permuted=True),       # Llama 2 and 3.x
    Family("mistral", required=("sliding_window",)),
    Family("qwen2", qkv_bias=True, o_bias=False, required=("sliding_window", "use_sliding_window"),
           gguf="qwen2"),                                      # Qwen2 and 2.5
    Family("qwen3", qk_norm=True, required=("head_dim", "sliding_window", "use_sliding_window"), gguf="qwen3"),
    Family("smollm"),
)
FAMILIES = {f.model_type: f for f in _FAMILIES}
SUPPORTED = tuple(FAMILIES)                                    # the model types the engine runs
GGUF_ARCHITECTURES = {f.gguf: f for f in _FAMILIES if f.gguf}  # GGUF architectures read natively


def family(model_type: str) -> Family:
    """The family of a model type; ValueError naming the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(f"model type {model_type!r} is not a supported Llama-family decoder "
                         f"({', '.join(SUPPORTED)})")
    return FAMILIES[model_type]


def of(cfg: ModelConfig) -> Family:
    """The family of a model the engine runs."""
    return family(cfg.architecture)


def config_from_hf(hf) -> ModelConfig:
    """The ModelConfig of a transformers config of a supported family."""
    fam = family(hf.model_type)
    if getattr(hf, "mlp_bias", False):
        raise ValueError("models with MLP biases are not supported")
    return fam.config(hf)
