"""One tensor-parallel rank's shard of a LlamaModel, and the row-parallel sums its
forward takes (Megatron's split).

q/k/v and gate/up are split by output columns (each rank its heads and its MLP
columns), the lm_head by vocabulary rows; o and down by K, on the reference dot's
block boundaries (plans.tp_shapes.k_slice), and summed over the ranks
(plans.collectives.row_linear). A quantized o or down (a GGUF's Q8_0, Q4_0, Q4_1 or
K-quant, served as stored) splits on its own lanes, whole GGUF blocks (a K-quant's
super-blocks of 256 values; kernels/SPEC.md), and
each rank's part is packed again with the whole K's lanes; the MLP columns follow
down's slice, so an uneven split of a quantized down is an uneven MLP split. Where the
heads do not split evenly over the ranks, or a quantized o's slices are not whole
heads (SmolLM2-135M: 9 heads, 3 KV heads), or a q/k norm spans the whole projection
(OLMoE), every rank holds all of attention and its KV cache, and o still runs
row-parallel: each rank multiplies its K slice of the full attention output. The
embedding and the norms are whole on every rank.

A mixture of experts' routing layer splits each expert as a plain MLP (its gate_up by
its columns, its down by K: every expert the same columns), and its router is whole
on every rank, so every rank chooses the same experts. Each expert's down gives the
rank's binary32 share of its rows; the reference sums every expert's share over the
ranks (its row-parallel sum) before the experts are combined, so each expert output
the combine takes, and the combine, have the bits of one device
(plans.collectives.expert_sum). Experts served quantized (a GGUF's, as stored) split
as a quantized down does: each expert's down on its own lanes, whole GGUF blocks,
its gate_up by the columns that slice gives the rank.

What the layout holds is a function of the model's shape, how its o and down are
stored, the size and the rank only, so every rank derives the same one.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from gateeng.config import QK_NORM_HEAD, ModelConfig
from gateeng.heap import trim_heap
from gateeng.model import families
from gateeng.model.llama import LlamaModel
from gateeng.plans import collectives, packing
from gateeng.plans import cpu_linear
from gateeng.plans.cpu_linear import Packed, Stacked
from gateeng.plans.tp_shapes import PAIR, KSlice, k_slice, refusal


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
    expert_mlp: range       # its columns of each expert's MLP (a mixture of experts; else empty)
    expert_down: KSlice     # its slice of each expert's down's K (those columns)


def layout(cfg: ModelConfig, size: int, rank: int, units: tuple = (PAIR, PAIR)) -> ShardLayout:
    """Rank `rank`'s part of the model at tensor-parallel size `size`, where o's and
    down's K, and a mixture of experts' experts' downs', split in `units` (row_units;
    the experts' in pairs where it names none); ValueError (with the reason) for a
    size the model cannot run at."""
    why = refusal(cfg, size)
    if why:
        raise ValueError(why)
    nq = cfg.num_heads * cfg.head_dim
    o = k_slice(nq, size, rank, units[0])
    down = k_slice(cfg.intermediate_size, size, rank, units[1])
    expert_unit = units[2] if len(units) > 2 else PAIR
    expert_down = k_slice(cfg.moe.intermediate_size if cfg.moe is not None else 0, size, rank, expert_unit)
    # An MLP's down stored in blocks too few for whole blocks on every rank (k_slice
    # gives the last ranks none): a rank would hold no column of that MLP, which is not
    # served (its shard can be neither read nor packed).
    row_parallel = []
    if cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_layers:
        row_parallel.append(("each MLP's down projection's", cfg.intermediate_size, units[1]))
    if cfg.moe is not None:
        row_parallel.append(("each expert's", cfg.moe.intermediate_size, expert_unit))
    for what, k, unit in row_parallel:
        if any(ks.stop <= ks.start for ks in (k_slice(k, size, r, unit) for r in range(size))):
            raise ValueError(f"{what} {k} columns are stored in blocks of {unit} values, too few for every one "
                             f"of {size} ranks to hold whole blocks: serve it with --dequantize at this "
                             "tensor-parallel size")
    # Heads split where they divide evenly and o's slices are whole heads (always for
    # bf16, whose K is a multiple of 32: an even split), and where no q/k norm reduces
    # over the whole projection (OLMoE's: a rank holding some heads could not compute it).
    split = (cfg.num_heads % size == 0 and cfg.num_kv_heads % size == 0 and cfg.qk_norm_scope == QK_NORM_HEAD
             and all(k_slice(nq, size, r, units[0])[:2] == (r * nq // size, (r + 1) * nq // size)
                     for r in range(size)))

    def part(n: int) -> range:
        return range(rank * n // size, (rank + 1) * n // size)
    per = -(-cfg.vocab_size // size)
    return ShardLayout(
        size=size, rank=rank, attention_split=split,
        heads=part(cfg.num_heads) if split else range(cfg.num_heads),
        kv_heads=part(cfg.num_kv_heads) if split else range(cfg.num_kv_heads),
        mlp=range(down.start, down.stop),
        vocab=range(min(cfg.vocab_size, rank * per), min(cfg.vocab_size, (rank + 1) * per)),
        vocab_size=cfg.vocab_size, vocab_per_rank=per, o=o, down=down,
        expert_mlp=range(expert_down.start, expert_down.stop), expert_down=expert_down)


# A weight whose columns are these (families.Weight.cols) is row-parallel: split by K,
# on the layout's slice of it named here.
ROW_PARALLEL = {"q": "o", "inter": "down", "expert_inter": "expert_down"}


def part_rows(cfg: ModelConfig, w: families.Weight, lay: ShardLayout) -> list:
    """The rows of w's stacked parts (q, k, v; gate, up) a rank holds, as [start, stop)
    in w's rows, part by part: each part's by what its rows are (the rank's query
    heads, key/value heads or MLP columns); any other part whole."""
    d, out, offset = cfg.head_dim, [], 0
    for kind, n in zip(w.rows, w.parts(cfg)):
        mine = {"q": (lay.heads, d), "kv": (lay.kv_heads, d), "inter": (lay.mlp, 1),
                "expert_inter": (lay.expert_mlp, 1)}.get(kind)
        out.append((offset, offset + n) if mine is None else
                   (offset + mine[0].start * mine[1], offset + mine[0].stop * mine[1]))
        offset += n
    return out


def row_units(model: LlamaModel, size: int) -> tuple:
    """The units o's and down's K, and a mixture of experts' experts' downs', split in
    (layout's `units`: a pair, or a triple for a mixture of experts): a
    quantized weight's GGUF blocks (32 values, a K-quant's 256) where every layer's
    (every expert's) is stored alike, bf16 pairs where none is quantized. A model
    whose layers or experts mix units is split where they all split the same way,
    else ValueError."""
    # a routing layer has no down of its own: its experts' downs split together
    units = {which: {_unit(model, getattr(layer, which)) for layer in model.layers if getattr(layer, which) is not None}
             for which in ("o", "down")}
    if model.cfg.moe is not None:
        units["expert_down"] = {_unit(model, e.down) for layer in model.layers for e in layer.experts or ()}
    return common_units(model.cfg, size, units)


# What common_units' refusal calls each row-parallel weight, quantized, and where its units differ.
_ROW_PARALLEL_NAMES = {"o": ("the model's o projections are quantized", "layers"),
                       "down": ("the model's down projections are quantized", "layers"),
                       "expert_down": ("the model's experts are quantized as stored", "experts")}


def common_units(cfg: ModelConfig, size: int, units: dict) -> tuple:
    """layout's `units` from the units every layer's o, down and (a mixture of experts)
    experts' downs split in ({"o": set, "down": set, "expert_down": set}: PAIR for
    bf16, a quantized weight's GGUF block values): row_units' rule, ValueError where
    they do not split alike."""
    out = []
    kinds = (("o", cfg.num_heads * cfg.head_dim), ("down", cfg.intermediate_size))
    if cfg.moe is not None:
        kinds += (("expert_down", cfg.moe.intermediate_size),)
    for which, k in kinds:
        used = units[which]
        if len(used) > 1 and len({tuple(k_slice(k, size, r, u)[:2] for r in range(size)) for u in used}) > 1:
            what, where = _ROW_PARALLEL_NAMES[which]
            how = (f"in some {where} and not in others" if PAIR in used else
                   f"in blocks of {' and '.join(map(str, sorted(used)))} values in different {where}")
            raise ValueError(f"{what} {how}, and these do not split alike over {size} "
                             "ranks: serve it with --dequantize at this tensor-parallel size")
        out.append(min(used) if used else PAIR)
    return tuple(out)


def _unit(model: LlamaModel, w: torch.Tensor) -> int:
    """What w's K splits in: its GGUF blocks' values where it is served quantized, else bf16 pairs."""
    p = _quantized(model, w)
    return PAIR if p is None else packing.of(model).quant_ops.qblock(p.data)


def _quantized(model: LlamaModel, w: torch.Tensor):
    """w's packed copy where it is served quantized (ref_ops.cpp qpack), else None."""
    p = packing.of(model).shared.get(id(w))
    return p if cpu_linear.quantized(p) else None


def local_config(cfg: ModelConfig, lay: ShardLayout) -> ModelConfig:
    """The shard's own shape: its heads, MLP columns (each expert's too) and lm_head
    rows (untied: the embedding stays whole)."""
    moe = None if cfg.moe is None else replace(cfg.moe, intermediate_size=len(lay.expert_mlp))
    return replace(cfg, num_heads=len(lay.heads), num_kv_heads=len(lay.kv_heads),
                   intermediate_size=len(lay.mlp), vocab_size=len(lay.vocab), tie_word_embeddings=False, moe=moe)


def shard_tensors(model: LlamaModel, lays: list, release: bool = False) -> list:
    """Each layout's rank's weights (one dict per layout in `lays`), named as the shard
    model's parameters, as new contiguous tensors; a weight served quantized as its
    rank's part packed again (cpu_linear.Packed: by rows, or by whole lanes of K).
    The model is split one weight at a time, for every rank at once. `release` (a model
    no one else holds): each projection and the lm_head is let go once every rank has
    its part, so the model and its shards together never hold more than one weight
    twice."""
    cfg = model.cfg
    ops = packing.of(model).quant_ops
    outs = [{} for _ in lays]

    def rank_rows(w: families.Weight):
        """A pick of w's rows for a rank (part_rows: each part's own)."""
        def pick(t, lay):
            out = [t[start:stop] for start, stop in part_rows(cfg, w, lay)]
            return out[0] if len(out) == 1 else torch.cat(out)
        return pick

    def plain(name: str, t: torch.Tensor, pick=lambda t, lay: t) -> None:
        """A small tensor (a norm, a bias): `pick`ed for each rank."""
        for out, lay in zip(outs, lays):
            out[name] = pick(t, lay).detach().clone().contiguous()

    def by_rows(name: str, w, pick) -> None:
        """w's rows that `pick(rows, lay)` selects for each rank (a quantized w: from its
        GGUF rows, each from the part of a Stacked that holds it, in the same order)."""
        p = _quantized(model, w)
        if p is None:
            for out, lay in zip(outs, lays):
                out[name] = pick(w, lay).detach().clone().contiguous()
        else:
            parts = cpu_linear.parts(p)
            raws = [ops.qunpack(q.data, q.n, q.per) for q in parts]
            starts = list(itertools.accumulate((q.n for q in parts), initial=0))
            for out, lay in zip(outs, lays):
                mine = pick(torch.arange(p.n), lay)   # the rank's rows, by number
                assert bool((mine[1:] > mine[:-1]).all()), "a rank's rows are picked in order"
                pieces = []
                for q, raw, start in zip(parts, raws, starts):
                    held = mine[(mine >= start) & (mine < start + q.n)] - start
                    if held.numel():
                        pieces.append(Packed(ops.qpack(raw[held].contiguous(), ops.qtype(q.data)), held.numel(), q.k))
                out[name] = pieces[0] if len(pieces) == 1 else Stacked(tuple(pieces))
        if release:
            packing.drop_weight(model, w)

    def by_k(name: str, w, which: str) -> None:
        """w's columns of each rank's slice of K (the layout's `which`; a quantized w:
        its GGUF blocks there, packed with the whole K's lanes, which row_units made
        the same columns)."""
        p = _quantized(model, w)
        raw = None if p is None else ops.qunpack(p.data, p.n, p.per)
        for out, lay in zip(outs, lays):
            ks = getattr(lay, which)
            if p is None:
                out[name] = w[:, ks.start:ks.stop].detach().clone().contiguous()
                continue
            unit = ops.qblock(p.data)                  # values per GGUF block
            ks = k_slice(p.k, lay.size, lay.rank, unit)   # its per counts blocks, not pairs
            block = raw.shape[1] // (p.k // unit)         # bytes per stored block
            part = raw[:, ks.start // unit * block: ks.stop // unit * block].contiguous()
            out[name] = Packed(ops.qpack(part, ops.qtype(p.data), ks.per), p.n, ks.stop - ks.start, ks.per)
        if release:
            packing.drop_weight(model, w)

    # The embedding is whole on every rank: one tensor (or packed copy) they all share.
    embed = packing.quantized_embedding(model) or packing.embed_rows(model, torch.arange(cfg.vocab_size)).contiguous()
    for out in outs:
        out["embed"] = embed
    plain("norm", model.norm)
    # o, down and each expert's down: row-parallel, split by K (the layout's slice of
    # it); a bias stays whole (added once), and so does the router (its experts' rows).
    for i, weights in itertools.groupby(families.of(cfg).block.tensors(cfg), key=lambda entry: entry[0]):
        for _, j, w, _ in weights:
            owner = model.layers[i] if j is None else model.layers[i].experts[j]
            name, t = shard_name(i, j, w.attr), getattr(owner, w.attr)
            if w.cols in ROW_PARALLEL:
                by_k(name, t, ROW_PARALLEL[w.cols])
            elif w.cols:
                by_rows(name, t, rank_rows(w))
            else:
                plain(name, t, rank_rows(w))
        if release:   # what the layer's weights held goes back to the OS, not only to malloc
            trim_heap()
    by_rows("lm_head", model.lm_head, lambda t, lay: t[lay.vocab.start:lay.vocab.stop])   # last: it may be the embedding
    return outs


def build_shard(cfg: ModelConfig, lay: ShardLayout, tensors: dict, stored_types: dict = None, ops=None) -> LlamaModel:
    """The rank's LlamaModel from shard_tensors' output, its forward summing the
    row-parallel projections over the group (`tp`). A quantized weight (Packed, or a
    Stacked one) is the shard's one copy of it, read by `ops` (the reference kernels),
    the file's `stored_types` named in the reference's version."""
    model = LlamaModel(local_config(cfg, lay), torch.bfloat16, "cpu")
    names = {name for name, _ in model.named_parameters()}
    if names != set(tensors):
        raise ValueError(f"the shard's tensors {sorted(set(tensors) ^ names)} do not match its model")
    # Assigned, not copied: a worker's tensors are the shared memory the driver handed over.
    # The whole embedding and o's K slice (where attention is whole) are not the local
    # config's shapes.
    for name, t in tensors.items():
        owner, _, attr = name.rpartition(".")
        plain = torch.empty(t.n, t.k, dtype=torch.bfloat16) if cpu_linear.is_packed(t) else t
        setattr(model.get_submodule(owner), attr, torch.nn.Parameter(plain, requires_grad=False))
    slices = {}
    for i, layer in enumerate(model.layers):   # each row-parallel weight's own KSlice, in its units
        row_parallel = [(None, "o", "o", cfg.num_heads * cfg.head_dim)]
        if layer.experts is None:
            row_parallel.append((None, "down", "down", cfg.intermediate_size))
        else:
            row_parallel += [(j, "down", "expert_down", cfg.moe.intermediate_size) for j in range(len(layer.experts))]
        for j, attr, which, k in row_parallel:
            name = shard_name(i, j, attr)
            t = tensors[name]
            unit = ops.qblock(t.data) if isinstance(t, Packed) else PAIR
            ks = k_slice(k, lay.size, lay.rank, unit)
            if ks[:2] != getattr(lay, which)[:2]:
                raise ValueError(f"{name} does not split as the layout does")
            slices[id(model.get_parameter(name))] = ks
    model.tp = RowParallel(lay, slices)
    model.finalize()
    for name, t in tensors.items():
        if cpu_linear.is_packed(t):
            owner, _, attr = name.rpartition(".")
            packing.set_packed(model, getattr(model.get_submodule(owner), attr), t, ops)
    packing.of(model).stored_types = dict(stored_types or {})
    return model


def shard_name(layer: int, expert, attr: str) -> str:
    """A layer weight's name among the shard model's parameters (an expert's below its
    layer's `experts`)."""
    return f"layers.{layer}." + ("" if expert is None else f"experts.{expert}.") + attr


class RowParallel:
    """A shard model's sums over the ranks (LlamaModel.forward calls it): the rank's
    share of x @ w.T for o and down, summed by the plan's rule
    (plans.collectives.row_linear), each weight on its own KSlice (`slices`, by id:
    a bf16 weight's K in pairs, a quantized one's in GGUF blocks); and a routing
    layer's choice and its experts' sum."""

    def __init__(self, lay: ShardLayout, slices: dict):
        self.layout = lay
        self._slices = slices

    def linear(self, plan, x: torch.Tensor, w: torch.Tensor, which: str) -> torch.Tensor:
        ks = self._slices[id(w)]
        if which == "o" and not self.layout.attention_split:   # every rank holds the whole attention output
            x = x[:, ks.start:ks.stop]
        return collectives.row_linear(plan, x, w, ks, self.layout.size)

    def same_routing(self, plan, chosen: torch.Tensor, weights: torch.Tensor) -> tuple:
        """The routing layer's choice as every rank takes it (collectives.same_routing)."""
        return collectives.same_routing(plan, chosen, weights)

    def expert_partial(self, plan, x: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """An expert's down for rows x (its columns of the expert's MLP): this rank's
        binary32 share, summed over the ranks by expert_sum."""
        return collectives.row_partial(plan, x, down, self._slices[id(down)])

    def expert_sum(self, plan, partials: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The routing layer's output from its rows' experts' shares [M, k, H] and their
        weights [M, k] (collectives.expert_sum)."""
        return collectives.expert_sum(plan, partials, weights, self.layout.size, dtype)
