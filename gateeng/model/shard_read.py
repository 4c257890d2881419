"""One tensor-parallel rank's shard read straight from the checkpoint's bytes.

A rank on its own node has no whole model to split (model.shard.shard_tensors): it
reads the checkpoint's header, derives its layout (model.shard.layout: a function of
the model's shape, the size and the rank only), and then reads only the byte ranges of
its own slices: its rows of a column-parallel weight (a contiguous range per stacked
part), its columns of a row-parallel one (a range per row), its lm_head rows, and the
tensors every rank holds whole (the embedding, the norms, a bias of o or down). Each
slice is converted to bf16 as loading converts a whole tensor (torch's rounding to
nearest even), so the rank's tensors are the ones shard_tensors gives it from the
whole model loaded: the same names, shapes and bits. No process holds the whole
model.

The fingerprint (model.fingerprint) is the same value a single server computes:
every tensor's bytes in name order, streamed through the hash a slice of rows at a
time (Fingerprint.add_slices), never whole.

A GGUF file is read the same way from its tensor table (gguf_weights.GGUFTensors,
raw_part), its weights served as a single server serves them: a quantized type the
reference multiplies kept as stored (a rank's rows, or its GGUF blocks of each row for a
row-parallel weight, packed as model.shard packs its part), any other converted to bf16
from the rank's bytes only (a row-parallel weight's from the whole blocks around its
columns), llama.cpp's rotary permutation of q and k undone head by head. Its
fingerprint streams the stored bytes in gguf_weights' order.

A mixture of experts is read the same way: each expert as a plain MLP (its rows of
gate and up, its columns of down), from a Hugging Face directory's per-expert tensors or
the fused [experts, rows, columns] ones transformers 5 writes (model.experts: a fused
tensor's part is its expert's rows, read by range), or from a GGUF's stacked
ffn_*_exps tensors (a byte range per expert; quantized experts as stored, a down's
columns by whole blocks); the router whole on every rank, in bf16 (a GGUF's converted,
as loading converts it).
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from gateeng.config import ModelConfig
from gateeng.heap import trim_heap
from gateeng.model import families, shard
from gateeng.model.experts import fused_parts
from gateeng.model.fingerprint import Fingerprint
from gateeng.model.gguf_weights import (SERVED_QUANTIZED, TENSOR_TABLE, GGUFTensors, reading_plan,
                                        unpermute)
from gateeng.model.loader import (Checkpoint, LoadedModel, default_model_path, gguf_header, read_model_config,
                                  row_slices, weight_files)
from gateeng.model.tokenizer import Tokenizer
from gateeng.model.shard import ROW_PARALLEL, ShardLayout, part_rows, shard_name
from gateeng.plans import reference_ops
from gateeng.plans.cpu_linear import Packed, Stacked
from gateeng.plans.tp_shapes import PAIR, k_slice


@dataclass(frozen=True)
class RankShard:
    config: ModelConfig     # the whole model's
    layout: ShardLayout
    tensors: dict           # named as the shard model's parameters (model.shard.build_shard takes them)
    stored_types: dict = field(default_factory=dict)   # a GGUF's types served as stored: {type: tensors}


def _is_gguf(src: Path) -> bool:
    return src.is_file() and src.suffix == ".gguf"


def _config(src: Path) -> ModelConfig:
    return read_model_config(gguf_header(src) if _is_gguf(src) else src)


def source(path) -> Path:
    """The checkpoint a model path names: `path`, or the embedded model's GGUF where it
    is empty (as loader.load reads it)."""
    return Path(path) if path else default_model_path()


def refusal(path, dequantize: bool = False) -> str:
    """Why the checkpoint at `path` (empty: the embedded model) cannot be read by byte
    ranges as it would be served (`dequantize`: --dequantize), else ""."""
    src = source(path)
    if not (src.is_dir() or _is_gguf(src)):
        return f"{src}: a rank's shard is read from a Hugging Face directory or a .gguf file, and this is neither"
    if dequantize and _is_gguf(src):
        return (f"{src.name}: a rank reads a GGUF's weights as stored, and --dequantize (the file converted "
                "whole, then served) is not served with tensor parallelism across nodes")
    return ""


def read_shard(path, size: int, rank: int, finite: bool = False) -> RankShard:
    """Rank `rank` of `size`'s shard of the checkpoint at `path` (empty: the embedded
    model), read by byte ranges. ValueError for a checkpoint not read so (refusal), a
    size the model cannot run at (shard.layout), or a tensor missing or misshaped
    (named); `finite` (a Hugging Face directory's): also for a value of the rank's
    that is NaN or Inf once in bf16 (named)."""
    why = refusal(path)
    if why:
        raise ValueError(why)
    path = source(path)
    if _is_gguf(path):
        if finite:
            raise ValueError(f"{path.name}: a GGUF's values are not checked finite by byte ranges")
        return _GGUFShard(path).read(size, rank)
    cfg = read_model_config(Path(path))
    lay = shard.layout(cfg, size, rank)
    ckpt = _ByRanges(Path(path), cfg)
    block = families.of(cfg).block
    out = {}

    def checked(name: str, shape: tuple) -> str:
        if name not in ckpt:
            raise ValueError(f"the checkpoint has no tensor {name}")
        if ckpt.shape(name) != tuple(shape):
            raise ValueError(f"tensor {name} has shape {ckpt.shape(name)}, expected {tuple(shape)}")
        return name

    def read(name: str, rows: tuple, cols=None) -> torch.Tensor:
        t = _owned(ckpt.part(name, rows, cols).to(torch.bfloat16))
        if finite and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{name}: {bad} of this rank's values are NaN or Inf, or beyond bfloat16's range")
        return t

    def whole(w: families.Weight) -> torch.Tensor:
        shape = w.shapes(cfg)[0]
        return read(checked(w.hf[0], shape), (0, shape[0]))

    out["embed"] = whole(block.embed)
    out["norm"] = whole(block.norm)
    for i, j, w, names in block.tensors(cfg):
        shapes = w.shapes(cfg)
        for name, shape in zip(names, shapes):
            checked(name, shape)
        if w.cols in ROW_PARALLEL:   # its K slice: the layout's columns of every row
            ks = getattr(lay, ROW_PARALLEL[w.cols])
            t = read(names[0], (0, shapes[0][0]), (ks.start, ks.stop))
        else:                        # each stacked part's rows the rank holds, by part
            starts = itertools.accumulate((s[0] for s in shapes), initial=0)
            pieces = [read(name, (start - first, stop - first))
                      for name, first, (start, stop) in zip(names, starts, part_rows(cfg, w, lay))]
            t = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        out[shard_name(i, j, w.attr)] = t
        trim_heap()   # the reader's buffers of this weight go back to the OS, not only to malloc
    head = block.embed if cfg.tie_word_embeddings else block.lm_head
    out["lm_head"] = read(checked(head.hf[0], head.shapes(cfg)[0]), (lay.vocab.start, lay.vocab.stop))
    return RankShard(cfg, lay, out)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous tensor with a storage of its own: the plans resize a plain
    weight's storage to nothing once they packed it (plans.packing), which a tensor over
    a reader's buffer (safetensors', numpy's) does not allow."""
    return t.clone(memory_format=torch.contiguous_format)


def unloaded(path, dequantize: bool = False) -> LoadedModel:
    """The checkpoint at `path` (empty: the embedded model) as loader.load describes it
    (config, tokenizer, the fingerprint a single server computes, source), without its
    weights: `model` is None until the rank's shard is built (tp_processes.start_ranks).
    Refused as `refusal` says (ValueError)."""
    why = refusal(path, dequantize)
    if why:
        raise ValueError(why)
    src = source(path)
    return LoadedModel(None, Tokenizer.from_dir(gguf_header(src) if _is_gguf(src) else src), _config(src),
                       fingerprint(src), str(src))


def fingerprint(path) -> str:
    """The checkpoint's model fingerprint (the value loader.load gives a single server),
    each tensor streamed through the hash a slice of rows at a time."""
    src = source(path)
    if _is_gguf(src):
        return _GGUFShard(src).fingerprint()
    cfg = read_model_config(src)
    ckpt = _ByRanges(src, cfg)
    fp = Fingerprint(cfg)
    for name in ckpt.names:
        slices = ckpt.row_slices(name)
        first = next(slices)   # its dtype names the tensor's kind
        fp.add_slices(name, str(first.dtype), ckpt.shape(name), itertools.chain([first], slices))
    return fp.hexdigest()


class _ByRanges:
    """A Hugging Face directory's tensors by byte ranges under the names the family
    table reads (loader.load's, model.experts.per_expert's): an expert's part of a
    fused tensor read as its rows of that expert's matrix."""

    def __init__(self, src: Path, cfg: ModelConfig):
        self.ckpt = Checkpoint(weight_files(src))
        self.fused = fused_parts(self.ckpt, cfg)   # {per-part name: (fused, its shape, expert, first row, rows)}
        for fused, shape in {(a[0], a[1]) for a in self.fused.values()}:
            if self.ckpt.shape(fused) != shape:
                raise ValueError(f"tensor {fused} has shape {self.ckpt.shape(fused)}, expected {shape}")
        whole = {a[0] for a in self.fused.values()}
        self.names = sorted([n for n in self.ckpt if n not in whole] + list(self.fused))   # the fingerprint's order

    def __contains__(self, name: str) -> bool:
        return name in self.fused or (name in self.ckpt and name not in {a[0] for a in self.fused.values()})

    def shape(self, name: str) -> tuple:
        if name not in self.fused:
            return self.ckpt.shape(name)
        _, shape, _, _, rows = self.fused[name]
        return (rows, shape[-1])

    def part(self, name: str, rows: tuple, cols=None) -> torch.Tensor:
        if name not in self.fused:
            return self.ckpt.part(name, rows, cols)
        fused, _, expert, first, _ = self.fused[name]
        return self.ckpt.part(fused, (first + rows[0], first + rows[1]), cols, expert)

    def row_slices(self, name: str):
        return row_slices(self.shape(name), lambda rows: self.part(name, rows))


class _GGUFShard:
    """A GGUF's weights as one rank reads them: gguf_weights' rules for how each is
    served (GGUFLoad), applied to the rank's bytes only; a stacked expert tensor's
    expert by expert."""

    def __init__(self, src: Path):
        header = gguf_header(src)
        self.cfg = read_model_config(header)
        self.file = GGUFTensors(src, header / TENSOR_TABLE)
        self.plan = reading_plan(families.gguf_family(self.file.architecture, self.cfg.moe is not None), self.cfg)
        self.types = {name: t.type for name, t in self.file.tensors.items()}
        missing = [n for _, names, _, _, _ in self.plan for n in names if n not in self.types]
        if missing:
            raise ValueError(f"{src.name}: tensor {missing[0]} is missing")

    def as_stored(self, names: list, w: families.Weight) -> bool:
        """Whether a weight of these parts is served as stored (GGUFLoad's rule: a
        router never is, its logits are a bf16 matrix's)."""
        router = w.kind == families.MOE and not w.experts
        return not router and all(self.types[n] in SERVED_QUANTIZED for n in names)

    def _blocks(self, name: str) -> tuple:
        """(values, bytes) per stored block of the tensor's type (1 value for a float type)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        return GGML_QUANT_SIZES[GGMLQuantizationType[self.types[name]]]

    def fingerprint(self) -> str:
        """GGUFLoad's: each tensor (a stacked expert tensor's expert, as name[j]) in the
        reading plan's order."""
        fp = Fingerprint(self.cfg)
        for (_, expert, _), names, _, _, w in self.plan:
            how = self.as_stored(names, w)
            for name in names:
                t = self.file.tensors[name]
                shape = t.shape if expert is None else t.shape[1:]
                rows = shape[0] if len(shape) == 2 else int(np.prod(shape))
                step = max(1, (16 << 20) // (t.nbytes // int(np.prod(t.shape[:-1]))))
                slices = (self.file.raw_part(name, (a, min(rows, a + step)), expert=expert)
                          for a in range(0, rows, step))
                fp.add_slices(name if expert is None else f"{name}[{expert}]",
                              f"{t.type}->{t.type if how else 'bf16'}", shape, slices)
        return fp.hexdigest()

    def read(self, size: int, rank: int) -> RankShard:
        cfg, d = self.cfg, self.cfg.head_dim
        ops = None
        if any(self.as_stored(names, w) for _, names, _, _, w in self.plan):
            try:
                ops = reference_ops.load()
            except reference_ops.ReferenceUnavailable as exc:
                raise ValueError(f"{self.file.path.name}'s quantized weights are multiplied only by the reference "
                                 f"kernels, and {exc}") from exc
        units = {"o": set(), "down": set()} | ({"expert_down": set()} if cfg.moe is not None else {})
        for _, names, _, _, w in self.plan:
            if w.cols in ROW_PARALLEL:
                units[ROW_PARALLEL[w.cols]].add(self._blocks(names[0])[0] if self.as_stored(names, w) else PAIR)
        lay = shard.layout(cfg, size, rank, shard.common_units(cfg, size, units))

        def rows(names: list, spans: list, heads: list, k: int, stored: bool, expert=None):
            """Each part's rows [start, stop) (rotary heads unpermuted; of a stacked
            expert tensor, expert `expert`'s), stacked: packed as stored by runs of one
            type (cpu_linear.Stacked where several) where `stored`, else bf16."""
            def raw(name, span, permuted):
                got = self.file.raw_part(name, span, expert=expert)
                return np.ascontiguousarray(unpermute(got, (span[1] - span[0]) // d)) if permuted else got
            if stored:
                packed = []
                for kind, run in itertools.groupby(zip(names, spans, heads), key=lambda e: self.types[e[0]]):
                    got = [raw(n, s, h is not None) for n, s, h in run if s[1] > s[0]]
                    if got:
                        run_rows = np.concatenate(got) if len(got) > 1 else got[0]
                        packed.append(Packed(ops.qpack(torch.from_numpy(run_rows), SERVED_QUANTIZED[kind]),
                                             run_rows.shape[0], k))
                return packed[0] if len(packed) == 1 else Stacked(tuple(packed))
            parts = []
            for n, s, h in zip(names, spans, heads):
                shape = (s[1] - s[0], k) if k else (s[1] - s[0],)
                v = self.file.values(n, self.file.raw_part(n, s, expert=expert), cfg.hidden_size, shape)
                parts.append(unpermute(v, (s[1] - s[0]) // d) if h is not None else v)
            return _owned(parts[0]) if len(parts) == 1 else torch.cat(parts)

        def by_k(name: str, shape: tuple, which: str, stored: bool, expert=None):
            """The rank's columns of every row (of expert `expert`'s matrix): its GGUF
            blocks packed as stored (on the blocks' own split) where `stored`, else the
            bf16 values of the whole blocks around its columns (the layout's slice), cut
            to them."""
            per_block, block_bytes = self._blocks(name)
            if stored:
                ks = k_slice(shape[1], size, rank, per_block)
                got = self.file.raw_part(name, (0, shape[0]), (ks.start // per_block * block_bytes,
                                                               ks.stop // per_block * block_bytes), expert)
                return Packed(ops.qpack(torch.from_numpy(got), SERVED_QUANTIZED[self.types[name]], ks.per),
                              shape[0], ks.stop - ks.start, ks.per)
            ks = getattr(lay, which)
            first, last = ks.start // per_block, -(-ks.stop // per_block)
            got = self.file.raw_part(name, (0, shape[0]), (first * block_bytes, last * block_bytes), expert)
            v = self.file.values(name, got, cfg.hidden_size, (shape[0], (last - first) * per_block))
            return _owned(v[:, ks.start - first * per_block: ks.stop - first * per_block])

        out = {}
        for (layer, expert, attr), names, shapes, heads, w in self.plan:
            if expert in (None, 0):
                for n, shape in zip(names, shapes):
                    if tuple(self.file.tensors[n].shape) != tuple(shape):
                        raise ValueError(f"{self.file.path.name}: tensor {n} has shape "
                                         f"{tuple(self.file.tensors[n].shape)}, expected {tuple(shape)}")
            if expert is not None:   # a stacked expert tensor: one expert's matrix of each part
                shapes = [shape[1:] for shape in shapes]
            k = shapes[0][1] if len(shapes[0]) == 2 else 0
            heads = heads or [None] * len(names)
            stored = self.as_stored(names, w)
            if layer is None:   # the embedding, the final norm, an untied lm_head
                spans = [(lay.vocab.start, lay.vocab.stop)] if attr == "lm_head" else [(0, shapes[0][0])]
                out[attr] = rows(names, spans, heads, k, stored)
            elif w.cols in ROW_PARALLEL:
                out[shard_name(layer, expert, attr)] = by_k(names[0], shapes[0], ROW_PARALLEL[w.cols], stored, expert)
            else:
                starts = itertools.accumulate((s[0] for s in shapes), initial=0)
                spans = [(a - first, b - first) for first, (a, b) in zip(starts, part_rows(cfg, w, lay))]
                out[shard_name(layer, expert, attr)] = rows(names, spans, heads, k, stored, expert)
            trim_heap()   # the stored bytes read for this weight go back to the OS, not only to malloc
        if cfg.tie_word_embeddings:   # the lm_head's rows are the embedding's
            (_, names, shapes, _, w), = [entry for entry in self.plan if entry[0] == (None, None, "embed")]
            out["lm_head"] = rows(names, [(lay.vocab.start, lay.vocab.stop)], [None], shapes[0][1],
                                  self.as_stored(names, w))
        # a stacked expert tensor counts once, as GGUFLoad counts it
        stored = Counter(self.types[n] for (_, expert, _), names, _, _, w in self.plan
                         if expert in (None, 0) and self.as_stored(names, w) for n in names)
        return RankShard(cfg, lay, out, dict(sorted(stored.items())))
