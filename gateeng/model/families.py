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

A mixture of experts (Family.moe) is described here too: its config fields (Moe), and
in its Block the weights of a routing layer (Weight.kind "moe": the router, and each
expert's gate_up and down, Weight.experts) beside those of a plain-MLP layer (kind
"mlp"). Which layers route is the ModelConfig's (MoeConfig.sparse_layers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gateeng.config import QK_NORM_HEAD, QK_NORM_PROJECTION, SOFTMAX_TOPK, TOPK_SOFTMAX, ModelConfig, MoeConfig

# What a layer's MLP is (Weight.kind): a plain MLP, or a routed mixture of experts.
MLP, MOE = "mlp", "moe"


def dims(cfg: ModelConfig) -> dict:
    """The sizes a weight's rows and columns are named by (Weight.rows, .cols)."""
    size = {"vocab": cfg.vocab_size, "hidden": cfg.hidden_size, "head": cfg.head_dim,
            "q": cfg.num_heads * cfg.head_dim, "kv": cfg.num_kv_heads * cfg.head_dim,
            "inter": cfg.intermediate_size}
    if cfg.moe is not None:
        size.update(experts=cfg.moe.num_experts, expert_inter=cfg.moe.intermediate_size)
    return size


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    """MOE for a layer that routes its tokens to experts, else MLP."""
    return MOE if cfg.moe is not None and layer in cfg.moe.sparse_layers else MLP


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
    kind: str = ""        # the layers it exists in: MLP (plain-MLP layers), MOE (routing layers); "" all
    # One per expert (a layer's `experts[j].<attr>`): each part's name holds "{j}", the
    # expert's index.
    experts: bool = False
    # transformers 5's name for the whole weight as its model holds it (its
    # conversion mapping's target): an expert weight's parts stacked by rows, for
    # every expert, [experts, rows, cols]. A checkpoint may hold either form
    # (model.experts reads both).
    fused: str = ""

    def present(self, cfg: ModelConfig, kind: str = MLP) -> bool:
        """Whether a layer of this kind (MLP or MOE) of `cfg` has this weight."""
        return (not self.when or bool(getattr(cfg, self.when))) and self.kind in ("", kind)

    def names(self, expert: Optional[int] = None) -> tuple:
        """Each part's transformers name (below the layer's prefix), for one expert of an
        expert weight."""
        return tuple(n.format(j=expert) for n in self.hf) if self.experts else self.hf

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

    def weights(self, cfg: ModelConfig, layer: Optional[int] = None) -> list:
        """The weights layer `layer` of `cfg` has, in transformers' order. Without a
        layer: a dense model's (every layer alike); a mixture of experts' layers
        differ, so it must name one."""
        if layer is None and cfg.moe is not None:
            raise ValueError("a mixture of experts' layers differ: name the layer")
        kind = MLP if layer is None else layer_kind(cfg, layer)
        return [w for w in self.layer if w.present(cfg, kind)]

    def tensors(self, cfg: ModelConfig):
        """Every layer weight of `cfg` as (layer, expert or None, its Weight, each part's
        full transformers name), layer by layer in transformers' order, an expert
        weight once per expert."""
        for i in range(cfg.num_layers):
            for w in self.weights(cfg, i):
                for j in range(cfg.moe.num_experts) if w.experts else (None,):
                    yield i, j, w, tuple(f"{self.hf_layers}{i}.{n}" for n in w.names(j))

    def gguf_weights(self, cfg: ModelConfig, layer: Optional[int] = None) -> list:
        """The weights layer `layer` of `cfg` has (weights' `layer`), in the order a GGUF is read."""
        by_attr = {w.attr: w for w in self.weights(cfg, layer)}
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
               ("inter", "inter"), "hidden", kind=MLP),
        Weight("down", ("mlp.down_proj.weight",), ("ffn_down.weight",), ("hidden",), "inter", kind=MLP),
    ),
    gguf_order=("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up", "down"),
    embed=Weight("embed", ("model.embed_tokens.weight",), ("token_embd.weight",), ("vocab",), "hidden"),
    norm=Weight("norm", ("model.norm.weight",), ("output_norm.weight",), ("hidden",)),
    lm_head=Weight("lm_head", ("lm_head.weight",), ("output.weight",), ("vocab",), "hidden"),
)


def _moe_block(base: Block, router: str, gate_up: tuple, down: str, fused_router: str = "",
               replace: tuple = ()) -> Block:
    """`base` with a routing layer's weights: the router [experts, hidden] and each
    expert's gate_up [2 expert_inter, hidden] and down [hidden, expert_inter], as
    LlamaModel holds them (a layer's `router`, `experts[j].gate_up`, `experts[j].down`).
    `replace`: weights of `base` this family holds otherwise."""
    swapped = {w.attr: w for w in replace}
    layer = tuple(swapped.get(w.attr, w) for w in base.layer) + (
        Weight("router", (router,), ("ffn_gate_inp.weight",), ("experts",), "hidden", kind=MOE,
               fused=fused_router),
        Weight("gate_up", gate_up, ("ffn_gate_exps.weight", "ffn_up_exps.weight"), ("expert_inter", "expert_inter"),
               "hidden", kind=MOE, experts=True, fused="mlp.experts.gate_up_proj"),
        Weight("down", (down,), ("ffn_down_exps.weight",), ("hidden",), "expert_inter", kind=MOE, experts=True,
               fused="mlp.experts.down_proj"),
    )
    # A GGUF's router is read before its experts (the fingerprint's order).
    order = tuple(a for a in base.gguf_order if a not in ("gate_up", "down")) + ("router", "gate_up", "down")
    return Block(layer, order, base.embed, base.norm, base.lm_head)


QWEN_MOE = _moe_block(DECODER, "mlp.gate.weight", ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"),
                      "mlp.experts.{j}.down_proj.weight")
# OLMoE's q and k norms reduce over the whole projection (ModelConfig.qk_norm_scope).
OLMOE = _moe_block(DECODER, "mlp.gate.weight", ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"),
                   "mlp.experts.{j}.down_proj.weight",
                   replace=(Weight("q_norm", ("self_attn.q_norm.weight",), ("attn_q_norm.weight",), ("q",),
                                   when="qk_norm"),
                            Weight("k_norm", ("self_attn.k_norm.weight",), ("attn_k_norm.weight",), ("kv",),
                                   when="qk_norm")))
# Mixtral's checkpoints name the block block_sparse_moe (w1: gate, w3: up, w2: down);
# transformers 5 holds it as mlp.
MIXTRAL = _moe_block(DECODER, "block_sparse_moe.gate.weight",
                     ("block_sparse_moe.experts.{j}.w1.weight", "block_sparse_moe.experts.{j}.w3.weight"),
                     "block_sparse_moe.experts.{j}.w2.weight", fused_router="mlp.gate.weight")


@dataclass(frozen=True)
class Moe:
    """How a mixture-of-experts family's config.json names its experts (MoeConfig)."""
    experts: tuple             # the expert count's field, and its other spellings (transformers' attribute_map)
    inter: str                 # each expert's MLP width
    routing: str               # config.SOFTMAX_TOPK or TOPK_SOFTMAX
    norm: str = ""             # the field that turns on the k probabilities' renormalization; "" none
    sparse_step: bool = False  # decoder_sparse_step and mlp_only_layers choose the routing layers
    # (field, the one value served): a config with any other value is refused (training
    # terms such as a router's jitter, or terms the engine does not compute).
    served_only: tuple = ()
    # (field, value): what llama.cpp's graph for the family's GGUF architecture fixes
    # whatever the file says (Qwen3-MoE's renormalized k probabilities).
    gguf_fixed: tuple = ()

    def fields(self) -> tuple:
        """The config fields this reads, each a tuple of its spellings."""
        return ((self.experts, ("num_experts_per_tok",), (self.inter,))
                + (((self.norm,),) if self.norm else ())
                + ((("decoder_sparse_step",), ("mlp_only_layers",)) if self.sparse_step else ())
                + tuple((name,) for name, _ in self.served_only))

    def config(self, hf, num_layers: int) -> MoeConfig:
        """The MoeConfig of a transformers config; ValueError naming a field it does not serve."""
        for name, served in self.served_only:
            if getattr(hf, name, served) != served:
                raise ValueError(f"{hf.model_type}: {name}={getattr(hf, name)!r} is not supported "
                                 f"(only {served!r} is served)")
        experts = next(getattr(hf, f) for f in self.experts if getattr(hf, f, None) is not None)
        top_k = int(hf.num_experts_per_tok)
        if not 0 < top_k <= experts:
            raise ValueError(f"{hf.model_type}: num_experts_per_tok={top_k} is not between 1 and the "
                             f"{experts} experts")
        layers = range(num_layers)
        if self.sparse_step:
            dense, step = set(getattr(hf, "mlp_only_layers", None) or ()), int(hf.decoder_sparse_step)
            layers = [i for i in layers if i not in dense and step > 0 and (i + 1) % step == 0]
        return MoeConfig(num_experts=int(experts), top_k=top_k, intermediate_size=int(getattr(hf, self.inter)),
                         routing=self.routing, norm_topk_prob=bool(self.norm and getattr(hf, self.norm)),
                         sparse_layers=tuple(layers))


# llama.cpp's metadata keys (below "<architecture>.") of a mixture of experts, and the
# value of each the engine serves where the file has the key (gguf-py's
# ExpertGatingFuncType.SOFTMAX is 1): a file with any other value is refused by name.
GGUF_EXPERTS, GGUF_EXPERTS_USED = "expert_count", "expert_used_count"
GGUF_EXPERT_WIDTH, GGUF_WIDTH = "expert_feed_forward_length", "feed_forward_length"
GGUF_SERVED_ONLY = (("expert_shared_count", 0), ("expert_gating_func", 1), ("expert_weights_scale", 1.0),
                    ("expert_group_count", 0), ("leading_dense_block_count", 0))
# A decoder's keys as llama.cpp's converter writes them (below "<architecture>.") and
# the config.json field each gives, for a family whose GGUF config transformers does
# not read (Family.gguf_native_config); each is required.
GGUF_DECODER_KEYS = (("block_count", "num_hidden_layers"), ("context_length", "max_position_embeddings"),
                     ("embedding_length", "hidden_size"), ("attention.head_count", "num_attention_heads"),
                     ("attention.layer_norm_rms_epsilon", "rms_norm_eps"))
# Keys llama.cpp reads with a default where the file lacks them: the kv heads (the
# heads'), each head's width (hidden / heads), and the RoPE base (llama.cpp's 10000).
GGUF_KV_HEADS, GGUF_HEAD_DIM, GGUF_ROPE_BASE = "attention.head_count_kv", "attention.key_length", "rope.freq_base"
# Keys that must agree with the config read: the value heads' and the rotary width
# (whole heads), the vocabulary (the embedding's rows); and a RoPE scaling of none.
GGUF_HEAD_WIDTHS, GGUF_VOCAB = ("attention.value_length", "rope.dimension_count"), "vocab_size"
GGUF_ROPE_SCALING = "rope.scaling.type"
# tokenizer.ggml.* special token ids and the config.json field each gives.
GGUF_SPECIAL_IDS = (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id"))


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
    qk_norm_scope: str = QK_NORM_HEAD  # what its q/k norms reduce over
    moe: Optional[Moe] = None          # a mixture of experts: how its config names them
    # transformers reads no config from its GGUF: the engine reads llama.cpp's metadata
    # (gguf_native_config), and the tokenizer from tokenizer.ggml.* through transformers'
    # GGUF tokenizer converters, which are keyed by the tokenizer's type, not the model's.
    gguf_native_config: bool = False

    def config(self, hf) -> ModelConfig:
        """The ModelConfig of a transformers config (or config.json's fields as attributes)."""
        bias = bool(getattr(hf, "attention_bias", False))
        terms = {}
        if self.qk_norm_scope != QK_NORM_HEAD:
            terms["qk_norm_scope"] = self.qk_norm_scope
        if self.moe is not None:
            terms["moe"] = self.moe.config(hf, hf.num_hidden_layers)
        return ModelConfig.from_hf(hf, qkv_bias=bias if self.qkv_bias is None else self.qkv_bias,
                                   o_bias=bias if self.o_bias is None else self.o_bias, qk_norm=self.qk_norm,
                                   **terms)

    def gguf_config(self, meta: dict) -> dict:
        """The config.json fields of a mixture of experts that llama.cpp's metadata `meta`
        ({key below "<architecture>.": value}) gives this family: its expert count, k and
        expert width, every layer routing and no sliding window (as llama.cpp's graph
        computes it), and what that graph fixes (Moe.gguf_fixed). ValueError naming a
        key whose value is not served."""
        moe = self.moe
        for key, served in GGUF_SERVED_ONLY:
            if meta.get(key, served) != served:
                raise ValueError(f"GGUF {self.gguf}.{key}={meta[key]!r} is not supported (only {served!r} is served)")
        for key in (GGUF_EXPERTS, GGUF_EXPERTS_USED):
            if key not in meta:
                raise ValueError(f"GGUF metadata {self.gguf}.{key} is missing")
        # Mixtral's experts are as wide as its MLP (llama.cpp writes only feed_forward_length).
        width = meta.get(GGUF_EXPERT_WIDTH, meta.get(GGUF_WIDTH) if moe.inter == "intermediate_size" else None)
        if width is None:
            raise ValueError(f"GGUF metadata {self.gguf}.{GGUF_EXPERT_WIDTH} is missing")
        out = {"model_type": self.model_type, moe.experts[0]: int(meta[GGUF_EXPERTS]),
               "num_experts_per_tok": int(meta[GGUF_EXPERTS_USED]), moe.inter: int(width),
               "sliding_window": None, "use_sliding_window": False}
        if moe.sparse_step:
            out.update(decoder_sparse_step=1, mlp_only_layers=[])
        out.update(dict(moe.served_only), **dict(moe.gguf_fixed))
        return out

    def gguf_decoder_config(self, meta: dict, tensors: dict, tokenizer: dict) -> dict:
        """The whole config.json of a GGUF of this family (gguf_native_config) from
        llama.cpp's metadata `meta` ({key below "<architecture>.": value}, arrays
        included), the file's
        tensor shapes `tensors` ({GGUF name: shape}: the vocabulary is the embedding's
        rows, the embedding is tied where no output matrix is stored) and its
        tokenizer.ggml.* keys `tokenizer` ({key below "tokenizer.ggml.": value}: the
        special ids), with the experts' fields (gguf_config). ValueError naming a key
        that is missing, disagrees or is not read: a key this does not know could
        change the arithmetic, so it is refused, not ignored."""
        def key(name: str):
            if name not in meta:
                raise ValueError(f"GGUF metadata {self.gguf}.{name} is missing")
            return meta[name]

        for name, value in meta.items():   # llama.cpp's per-layer values (none of this reader's)
            if isinstance(value, (list, tuple)):
                raise ValueError(f"GGUF metadata {self.gguf}.{name} is an array (one value per layer): not supported")

        embed = self.block.embed.gguf[0]
        if embed not in tensors:
            raise ValueError(f"tensor {embed} is missing")
        out = {field: key(name) for name, field in GGUF_DECODER_KEYS}
        heads = int(out["num_attention_heads"])
        head_dim = int(meta.get(GGUF_HEAD_DIM, int(out["hidden_size"]) // max(heads, 1)))
        out.update(model_type=self.model_type, num_key_value_heads=int(meta.get(GGUF_KV_HEADS, heads)),
                   head_dim=head_dim, rope_theta=float(meta.get(GGUF_ROPE_BASE, 10000.0)),
                   vocab_size=int(tensors[embed][0]), tie_word_embeddings=self.block.lm_head.gguf[0] not in tensors,
                   **{field: tokenizer.get(name) for name, field in GGUF_SPECIAL_IDS})
        agree = dict.fromkeys(GGUF_HEAD_WIDTHS, head_dim)
        agree.update({GGUF_VOCAB: out["vocab_size"], GGUF_ROPE_SCALING: "none"})
        for name, want in agree.items():
            if meta.get(name, want) != want:
                why = "the embedding has that many rows" if name == GGUF_VOCAB else "as the config reads"
                raise ValueError(f"GGUF {self.gguf}.{name}={meta[name]!r} is not served (only {want!r}: {why})")
        known = ({n for n, _ in GGUF_DECODER_KEYS} | {GGUF_KV_HEADS, GGUF_HEAD_DIM, GGUF_ROPE_BASE} | set(agree)
                 | {n for n, _ in GGUF_SERVED_ONLY} | {GGUF_EXPERTS, GGUF_EXPERTS_USED, GGUF_EXPERT_WIDTH, GGUF_WIDTH})
        unread = sorted(set(meta) - known)
        if unread:
            raise ValueError(f"GGUF metadata {', '.join(f'{self.gguf}.{n}' for n in unread)} is not supported "
                             "(a key the engine does not read could change what the model computes)")
        out.update(self.gguf_config(meta))
        return out

    def required_fields(self) -> tuple:
        """The config fields its transformers class defaults differently from what the
        engine would assume, each a tuple of its spellings (hf_config reads a file that
        lacks one through transformers)."""
        return tuple((f,) for f in self.required) + (self.moe.fields() if self.moe is not None else ())


_FAMILIES = (
    Family("llama", gguf="llama", gguf_permuted=True),       # Llama 2 and 3.x
    Family("mistral", required=("sliding_window",)),
    Family("qwen2", qkv_bias=True, o_bias=False, required=("sliding_window", "use_sliding_window"),
           gguf="qwen2"),                                      # Qwen2 and 2.5
    Family("qwen3", qk_norm=True, required=("head_dim", "sliding_window", "use_sliding_window"), gguf="qwen3"),
    Family("smollm"),
    # Mixtures of experts. llama.cpp writes Mixtral as a "llama" GGUF with experts.
    Family("qwen3_moe", qk_norm=True, required=("head_dim", "sliding_window", "use_sliding_window"),
           block=QWEN_MOE, gguf="qwen3moe",
           moe=Moe(("num_experts", "num_local_experts"), "moe_intermediate_size", SOFTMAX_TOPK,
                   norm="norm_topk_prob", sparse_step=True, gguf_fixed=(("norm_topk_prob", True),))),
    Family("mixtral", required=("sliding_window",), block=MIXTRAL, gguf="llama", gguf_permuted=True,
           moe=Moe(("num_local_experts", "num_experts"), "intermediate_size", TOPK_SOFTMAX,
                   served_only=(("router_jitter_noise", 0.0),))),
    # llama.cpp's olmoe: q and k rows as transformers holds them (not permuted), the k
    # probabilities not renormalized, the experts as wide as feed_forward_length.
    Family("olmoe", qk_norm=True, qk_norm_scope=QK_NORM_PROJECTION, block=OLMOE, gguf="olmoe",
           gguf_native_config=True,
           moe=Moe(("num_experts", "num_local_experts"), "intermediate_size", SOFTMAX_TOPK, norm="norm_topk_prob",
                   served_only=(("clip_qkv", None),), gguf_fixed=(("norm_topk_prob", False),))),
)
FAMILIES = {f.model_type: f for f in _FAMILIES}
SUPPORTED = tuple(FAMILIES)                                    # the model types the engine runs
# GGUF architectures read natively: a dense model's, and a mixture of experts' (a file
# with experts, GGUF_EXPERTS).
GGUF_ARCHITECTURES = {f.gguf: f for f in _FAMILIES if f.gguf and f.moe is None}
GGUF_MOE_ARCHITECTURES = {f.gguf: f for f in _FAMILIES if f.gguf and f.moe is not None}
# Model types refused by name, with what in them the engine does not compute.
REFUSED = {
    "qwen2_moe": "its shared expert (an always-on MLP with a sigmoid gate beside the routed experts)",
    "deepseek_v2": "its shared experts, grouped routing and multi-head latent attention",
    "deepseek_v3": "its shared experts, sigmoid routing with a bias and multi-head latent attention",
    "gpt_oss": "its attention sinks and MXFP4 experts",
}


def family(model_type: str) -> Family:
    """The family of a model type; ValueError naming the supported ones."""
    if model_type in REFUSED:
        raise ValueError(f"model type {model_type!r} is not supported: the engine does not compute "
                         f"{REFUSED[model_type]} (supported: {', '.join(SUPPORTED)})")
    if model_type not in FAMILIES:
        raise ValueError(f"model type {model_type!r} is not a supported Llama-family decoder "
                         f"({', '.join(SUPPORTED)})")
    return FAMILIES[model_type]


def gguf_family(architecture: str, experts: bool) -> Family:
    """The family a GGUF of `architecture` (with `experts`, or dense) is read natively
    as; ValueError naming what is read."""
    table = GGUF_MOE_ARCHITECTURES if experts else GGUF_ARCHITECTURES
    if architecture not in table:
        if experts:
            raise ValueError(f"a mixture-of-experts GGUF of architecture {architecture!r} is not served "
                             f"(mixtures of experts are read from GGUF architectures {', '.join(table)})")
        raise ValueError(f"GGUF architecture {architecture!r} is not read natively ({', '.join(table)} are); "
                         "pass --dequantize to convert it through transformers")
    return table[architecture]


def of(cfg: ModelConfig) -> Family:
    """The family of a model the engine runs."""
    return family(cfg.architecture)


def config_from_hf(hf) -> ModelConfig:
    """The ModelConfig of a transformers config of a supported family."""
    fam = family(hf.model_type)
    if getattr(hf, "mlp_bias", False):
        raise ValueError("models with MLP biases are not supported")
    return fam.config(hf)
