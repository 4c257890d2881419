"""One tensor-parallel rank's shard of a LlamaModel, and the row-parallel sums its
forward takes (Megatron's split).

q/k/v and gate/up are split by output columns (each rank its heads and its MLP
columns), the lm_head by vocabulary rows; o and down by K, on the reference dot's
block boundaries (plans.tp_shapes.k_slice), and summed over the ranks
(plans.collectives.row_linear). Where the heads do not split evenly over the ranks
(SmolLM2-135M: 9 heads, 3 KV heads), every rank holds all of attention and its KV
cache, and o still runs row-parallel: each rank multiplies its K slice of the full
attention output. The embedding and the norms are whole on every rank. What the
layout holds is a function of the model's shape, the size and the rank only, so
every rank derives the same one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gateeng.config import ModelConfig
from gateeng.model.llama import LlamaModel
from gateeng.plans import collectives
from gateeng.plans.tp_shapes import KSlice, k_slice, refusal


@dataclass(frozen=True)
class ShardLayout:
    size: int
    rank: int
    attention_split: bool   # heads and the KV cache split by head; else whole on every rank
    heads: range            # the rank's query heads
    kv_heads: range         # its key/value heads
    mlp: range              # its MLP (intermediate) columns
    vocab: range            # its lm_head rows
    vocab_size: int         # the whole vocabulary
    vocab_per_rank: int     # the width every rank's logits are padded to before the gather
    o: KSlice               # its slice of o's K (the attention output)
    down: KSlice            # its slice of down's K (the MLP columns)


def layout(cfg: ModelConfig, size: int, rank: int) -> ShardLayout:
    """Rank `rank`'s part of the model at tensor-parallel size `size`; ValueError
    (with the reason) for a size the model cannot run at."""
    why = refusal(cfg, size)
    if why:
        raise ValueError(why)
    split = cfg.num_heads % size == 0 and cfg.num_kv_heads % size == 0

    def part(n: int) -> range:
        return range(rank * n // size, (rank + 1) * n // size)
    per = -(-cfg.vocab_size // size)
    return ShardLayout(
        size=size, rank=rank, attention_split=split,
        heads=part(cfg.num_heads) if split else range(cfg.num_heads),
        kv_heads=part(cfg.num_kv_heads) if split else range(cfg.num_kv_heads),
        mlp=part(cfg.intermediate_size),
        vocab=range(min(cfg.vocab_size, rank * per), min(cfg.vocab_size, (rank + 1) * per)),
        vocab_size=cfg.vocab_size, vocab_per_rank=per,
        o=k_slice(cfg.num_heads * cfg.head_dim, size, rank),
        down=k_slice(cfg.intermediate_size, size, rank))


def local_config(cfg: ModelConfig, lay: ShardLayout) -> ModelConfig:
    """The shard's own shape: its heads, MLP columns and lm_head rows (untied: the
    embedding stays whole)."""
    return replace(cfg, num_heads=len(lay.heads), num_kv_heads=len(lay.kv_heads),
                   intermediate_size=len(lay.mlp), vocab_size=len(lay.vocab), tie_word_embeddings=False)


def shard_tensors(model: LlamaModel, lay: ShardLayout) -> dict:
    """The rank's weights, named as the shard model's parameters, as new contiguous
    tensors (the full model may be freed afterwards)."""
    cfg, d = model.cfg, model.cfg.head_dim
    nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
    inter = cfg.intermediate_size

    def rows(t, r: range, offset: int = 0, unit: int = 1):
        return t[offset + r.start * unit: offset + r.stop * unit]

    def qkv_rows(t):
        return torch.cat([rows(t, lay.heads, 0, d), rows(t, lay.kv_heads, nq, d), rows(t, lay.kv_heads, nq + nkv, d)])

    out = {"embed": model.embed_rows(torch.arange(cfg.vocab_size)), "norm": model.norm,
           "lm_head": rows(model.lm_head, lay.vocab)}
    for i, layer in enumerate(model.layers):
        pre = f"layers.{i}."
        out[pre + "input_norm"] = layer.input_norm
        out[pre + "post_norm"] = layer.post_norm
        out[pre + "qkv"] = qkv_rows(layer.qkv)
        if layer.qkv_bias is not None:
            out[pre + "qkv_bias"] = qkv_rows(layer.qkv_bias)
        out[pre + "o"] = layer.o[:, lay.o.start:lay.o.stop]
        if layer.o_bias is not None:   # added once, after the sum
            out[pre + "o_bias"] = layer.o_bias
        if layer.q_norm is not None:
            out[pre + "q_norm"], out[pre + "k_norm"] = layer.q_norm, layer.k_norm
        out[pre + "gate_up"] = torch.cat([rows(layer.gate_up, lay.mlp), rows(layer.gate_up, lay.mlp, inter)])
        out[pre + "down"] = layer.down[:, lay.mlp.start:lay.mlp.stop]
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def build_shard(cfg: ModelConfig, lay: ShardLayout, tensors: dict) -> LlamaModel:
    """The rank's LlamaModel from shard_tensors' output, its forward summing the
    row-parallel projections over the group (`tp`)."""
    model = LlamaModel(local_config(cfg, lay), tensors["embed"].dtype, tensors["embed"].device)
    names = {name for name, _ in model.named_parameters()}
    if names != set(tensors):
        raise ValueError(f"the shard's tensors {sorted(set(tensors) ^ names)} do not match its model")
    # Assigned, not copied: a worker's tensors are the shared memory the driver handed over.
    # The whole embedding and o's K slice (where attention is whole) are not the local
    # config's shapes.
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, torch.nn.Parameter(t, requires_grad=False))
    model.tp = RowParallel(lay)
    model.finalize()
    return model


class RowParallel:
    """A shard model's row-parallel projections (LlamaModel.forward calls it for o
    and down): the rank's share of x @ w.T, summed over the ranks by the plan's rule
    (plans.collectives.row_linear)."""

    def __init__(self, lay: ShardLayout):
        self.layout = lay

    def linear(self, plan, x: torch.Tensor, w: torch.Tensor, which: str) -> torch.Tensor:
        ks = self.layout.o if which == "o" else self.layout.down
        if which == "o" and not self.layout.attention_split:   # every rank holds the whole attention output
            x = x[:, ks.start:ks.stop]
        return collectives.row_linear(plan, x, w, ks, self.layout.size)
