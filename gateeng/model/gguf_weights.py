"""A GGUF file's weights, read natively and served as stored.

The `gguf` package's reader gives the header (names, types, shapes, offsets: read
once, in the child process that converts the config, and cached); each
tensor's bytes are then read from the file on their own, converted and packed, and
dropped before the next one is read: loading holds the model's packed weights plus one
tensor (a stacked expert tensor is read one expert at a time, and a matrix served as
stored SLICE_ROWS rows at a time, packed into its place: the output matrix of a large
vocabulary is never whole twice). An untied embedding served quantized is the
exception: it is looked up, never multiplied whole, so it stays in the file, and the rows of
the tokens a batch looks up are read then (GGUFTensors.stored_rows, packing.StoredRows).

Q8_0, Q4_0, Q4_1 and the K-quants Q4_K, Q5_K and Q6_K stay quantized (kernels/SPEC.md,
"Quantized weights"), in the reference kernels' packed layout (ref_ops.cpp `qpack`),
repacked once at load. F32, F16 and BF16 tensors, and every other quantized type
(Q5_0, Q5_1, the IQ types, ...), are converted to bf16; each such quantized type is
named in the start-up log. A stacked projection (q, k and v; gate and up) whose parts
are stored in different such types (llama.cpp's Q4_K_M: v in Q6_K beside q and k in
Q4_K) is served as stored too, each run of parts of one type packed on its own
(cpu_linear.Stacked). The Triton reference (`blocks_on`) takes the same types as
stored, a stack of several types run by run as well (packing.StackedBlocks).
"""
from __future__ import annotations

import functools
import itertools
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from gateeng.model import families
from gateeng.model.families import GGUF_EXPERTS
from gateeng.model.fingerprint import Fingerprint
from gateeng.plans import packing
from gateeng.plans.cpu_linear import Packed, Stacked
from gateeng.plans.packing import QuantBlocks, StackedBlocks

# The types multiplied as stored, by GGML type id (ref_ops.cpp's QTYPES), on the CPU
# reference kernels and on the Triton reference (QuantBlocks).
SERVED_QUANTIZED = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
K_QUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}   # bytes per stored super-block of 256 values
PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}   # type: its bytes' dtype
# The GGUF architectures read natively, and their tensors' names, are the families'
# (gateeng.model.families). llama.cpp's converter permutes some families' q and k rows
# (rotary pairs interleaved), which loading undoes as transformers does.


# The tensor table a header conversion writes beside the config (gateeng.model.cache).
TENSOR_TABLE = "gguf_tensors.json"
# Rows of a matrix served as stored read, hashed and packed at a time: a multiple of the
# 16 rows of a packed record (ref_ops.cpp qpack), so each slice packs to its own records.
SLICE_ROWS = 4096


@dataclass(frozen=True)
class StoredTensor:
    name: str
    type: str            # the GGML type's name (Q4_0, F32, ...)
    shape: tuple         # (rows, columns), or (n,) for a vector
    offset: int          # in the file
    nbytes: int


def read_table(path: Path) -> tuple:
    """(architecture, {name: StoredTensor}, the architecture's metadata {key below
    "<architecture>.": scalar value}) from a GGUF file's header, by the `gguf` package's
    reader. A tensor's shape is numpy's: (rows, columns), (n,) for a vector, and
    (experts, rows, columns) for a mixture of experts' stacked experts."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else ""
    tensors = {t.name: StoredTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                                    int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    prefix = architecture + "."
    meta = {key[len(prefix):]: f.contents() for key, f in reader.fields.items()
            if key.startswith(prefix) and len(f.types) == 1}   # scalars and strings, not arrays
    return architecture, tensors, meta   # the reader's memory map of the whole file goes with it


def read_each_file_once() -> None:
    """For a conversion's own child process: every later read of a GGUF's header in this
    process, ours and transformers', shares one parse. transformers parses the whole
    header through gguf's GGUFReader once per call it makes (a config, a tokenizer, the
    weights), and builds gguf's tensor-name map once per module of the model: for the
    embedded model, four parses of its 49152-token vocabulary and 397 maps. Shared, a
    full conversion took 26 s where it took 51 s, a header's 17 s where it took 30 s
    (2-core AVX2 EPYC). Both are functions of their arguments alone, and every reader
    here only reads their results (the memory-mapped file is opened read-only), so each
    is made once per process. Not for a serving process: a cached reader keeps its
    parse alive (about 160 MB for a 1.17B model's header: GGUFTensors)."""
    import gguf
    parse = functools.lru_cache(maxsize=None)(gguf.GGUFReader)

    def reader(path, mode: str = "r"):   # one key per file, however its path is written
        return parse(os.path.realpath(path), mode)
    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


def write_table(out_dir: Path, architecture: str, tensors: dict) -> None:
    """Record a GGUF file's tensor table (read_table's) as TENSOR_TABLE in `out_dir`."""
    rows = [dict(name=t.name, type=t.type, shape=list(t.shape), offset=t.offset, nbytes=t.nbytes)
            for t in tensors.values()]
    (Path(out_dir) / TENSOR_TABLE).write_text(json.dumps({"architecture": architecture, "tensors": rows}))


def has_experts(meta: dict) -> bool:
    """Whether a GGUF's metadata (read_table's) says it is a mixture of experts."""
    return int(meta.get(GGUF_EXPERTS) or 0) > 0


class GGUFTensors:
    """The tensors of a GGUF file by name, each read from the file when asked for.
    `table`: the file's tensor table as write_table recorded it, read instead of the
    file's header (the header's reader holds about 160 MB while it parses a 1.17B
    model's vocabulary, and the serving process never imports it)."""

    def __init__(self, path: Path, table: Optional[Path] = None):
        self.path = Path(path)
        if table is None:
            self.architecture, self.tensors, _ = read_table(self.path)
        else:
            data = json.loads(Path(table).read_text())
            self.architecture = data["architecture"]
            self.tensors = {t["name"]: StoredTensor(t["name"], t["type"], tuple(t["shape"]), t["offset"], t["nbytes"])
                            for t in data["tensors"]}

    def types(self) -> dict:
        """{stored type: tensor count}."""
        return dict(sorted(Counter(t.type for t in self.tensors.values()).items()))

    def raw(self, name: str, expert: Optional[int] = None) -> np.ndarray:
        """The stored bytes, uint8 [rows, bytes per row] (a vector: [1, bytes]); of a
        stacked expert tensor, expert `expert`'s matrix only."""
        t = self.tensors[name]
        nbytes, offset = t.nbytes, t.offset
        if expert is not None:
            nbytes //= t.shape[0]
            offset += expert * nbytes
        buf = np.empty(nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset)
            if f.readinto(memoryview(buf)) != nbytes:
                raise ValueError(f"{self.path.name} is truncated: tensor {name} ends past the end of the file")
        rows = t.shape[-2] if len(t.shape) >= 2 else 1
        return buf.reshape(rows, -1)

    def raw_part(self, name: str, rows: tuple, cols: Optional[tuple] = None,
                 expert: Optional[int] = None) -> np.ndarray:
        """Rows [start, stop) of the stored bytes, uint8 [rows, bytes per row] (a vector's
        values as rows of one; of a stacked expert tensor, expert `expert`'s matrix's
        rows), and of each row only bytes [start, stop) where `cols` is given: only
        those byte ranges are read from the file."""
        t = self.tensors[name]
        offset, nbytes, shape = t.offset, t.nbytes, t.shape
        if expert is not None:
            nbytes //= shape[0]
            offset, shape = offset + expert * nbytes, shape[1:]
        n = shape[0] if len(shape) == 2 else int(np.prod(shape))
        row_bytes = nbytes // n
        if t.offset + t.nbytes > self.path.stat().st_size:
            raise ValueError(f"{self.path.name} is truncated: tensor {name} ends past the end of the file")
        start, stop = cols or (0, row_bytes)
        out = np.empty((rows[1] - rows[0], stop - start), dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            if cols is None:   # one range
                f.seek(offset + rows[0] * row_bytes)
                f.readinto(memoryview(out).cast("B"))
            else:              # a range per row
                for i, row in enumerate(range(*rows)):
                    f.seek(offset + row * row_bytes + start)
                    f.readinto(memoryview(out[i]))
        return out

    def stored_rows(self, name: str, ggml: int) -> packing.StoredRows:
        """A matrix's stored rows, read from the file (opened here) when looked up
        (packing.StoredRows): nothing is read here."""
        t = self.tensors[name]
        rows = t.shape[0] if len(t.shape) == 2 else 1
        if self.path.stat().st_size < t.offset + t.nbytes:
            raise ValueError(f"{self.path.name} is truncated: tensor {name} ends past the end of the file")
        return packing.StoredRows(open(self.path, "rb", buffering=0), t.offset, rows, t.nbytes // rows, ggml)

    def values(self, name: str, raw: np.ndarray, rows_per_slice: int = SLICE_ROWS, shape: Optional[tuple] = None) -> torch.Tensor:
        """The tensor's values rounded to bf16, from its stored bytes: F32, F16 and BF16
        as they are (rounded to nearest even, as every torch build rounds); other types
        by the gguf package's dequantization (numpy binary32 arithmetic, the same bits
        everywhere), a slice of rows at a time, so a large tensor is never whole in
        binary32. `shape`: of a part of the tensor's rows and blocks (raw_part's), not
        the whole."""
        t = self.tensors[name]
        shape = shape or t.shape[-2:]   # a stacked expert tensor's raw is one expert's; a part's its own
        if t.type in PLAIN_TYPES:
            stored = torch.from_numpy(raw).view(PLAIN_TYPES[t.type])
            return stored.to(torch.bfloat16).reshape(shape)
        from gguf import GGMLQuantizationType, quants
        kind = GGMLQuantizationType[t.type]
        out = torch.empty(raw.shape[0], int(np.prod(shape)) // raw.shape[0], dtype=torch.bfloat16)
        for start in range(0, raw.shape[0], rows_per_slice):
            part = quants.dequantize(raw[start:start + rows_per_slice], kind).astype(np.float32, copy=False)
            out[start:start + part.shape[0]] = torch.from_numpy(np.ascontiguousarray(part).reshape(part.shape[0], -1))
        return out.reshape(shape)


def split_blocks(raw: np.ndarray, kind: str, k: int) -> QuantBlocks:
    """A quantized tensor's stored rows [N, bytes] as the integers and scales of SPEC.md's
    tables (numpy arrays in a QuantBlocks). Q8_0, Q4_0, Q4_1: a block's record is its
    binary16 d (and, Q4_1, m), then its values: Q8_0's 32 int8; Q4's 16 bytes, byte j
    holding value j in its low nibble and value j + 16 in its high one (Q4_0 stores
    n = q + 8). The K-quants: split_k_blocks."""
    if kind in K_QUANT_BYTES:
        return split_k_blocks(raw, kind, k)
    rows = raw.shape[0]
    rec = raw.reshape(rows, k // 32, -1)
    d = np.ascontiguousarray(rec[:, :, 0:2]).view(np.float16)[..., 0]
    if kind == "Q8_0":
        return QuantBlocks(np.ascontiguousarray(rec[:, :, 2:]).view(np.int8).reshape(rows, k), d, None)
    nibbles = rec[:, :, 4 if kind == "Q4_1" else 2:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int8).reshape(rows, k)
    if kind == "Q4_0":
        return QuantBlocks(q - np.int8(8), d, None)
    return QuantBlocks(q, d, np.ascontiguousarray(rec[:, :, 2:4]).view(np.float16)[..., 0])


def split_k_blocks(raw: np.ndarray, kind: str, k: int) -> QuantBlocks:
    """A K-quant's stored rows [N, bytes] (ggml's block_q4_K, block_q5_K, block_q6_K;
    SPEC.md's byte layouts) as QuantBlocks: q int8 [N, k] (Q6_K's n - 32), d and dmin
    float16 [N, k/256], the sub-blocks' sc and mn int8 [N, k/S] (S = 32; Q6_K: 16, no
    minimum). The 6-bit scales and minimums are unpacked by the gguf package's
    get_scale_min_k4."""
    from gguf.quants import Q4_K
    rows = raw.shape[0]
    b = raw.reshape(rows, k // 256, K_QUANT_BYTES[kind])
    half = lambda a: np.ascontiguousarray(a).view(np.float16)[..., 0]   # noqa: E731
    if kind == "Q6_K":
        ql, qh = b[..., :128], b[..., 128:192]
        lo = np.concatenate([ql[..., :64] & 15, ql[..., :64] >> 4, ql[..., 64:] & 15, ql[..., 64:] >> 4], -1)
        hi = np.concatenate([(qh[..., h * 32:(h + 1) * 32] >> (2 * i)) & 3 for h in range(2) for i in range(4)], -1)
        q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
        return QuantBlocks(q.reshape(rows, k), half(b[..., 208:210]), None, sc.reshape(rows, -1))
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    qs = b[..., 48:176] if kind == "Q5_K" else b[..., 16:144]
    q = np.concatenate([(qs[..., (j // 2) * 32:(j // 2 + 1) * 32] >> (4 * (j % 2))) & 15 for j in range(8)], -1)
    if kind == "Q5_K":
        q = q | (np.concatenate([(b[..., 16:48] >> j) & 1 for j in range(8)], -1) << 4)
    return QuantBlocks(q.astype(np.int8).reshape(rows, k), half(b[..., 0:2]), half(b[..., 2:4]),
                       sc.astype(np.int8).reshape(rows, -1), mn.astype(np.int8).reshape(rows, -1))


def unpermute(rows, heads: int):
    """Undo llama.cpp's rotary permutation of q or k rows (transformers' reverse_permute_weights)."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def reading_plan(family, cfg) -> list:
    """((layer or None, expert or None, the parameter's name), its parts' GGUF names,
    their shapes in the file, the rotary heads per part or None, its families.Weight)
    for every weight a model of `cfg` takes from a GGUF of `family`, in the file's
    reading order, which is the order its fingerprint hashes them: keep it so."""
    block = family.block

    def whole(w, attr):
        return ((None, None, attr), list(w.gguf), w.shapes(cfg), None, w)

    plan = [whole(block.embed, "embed")]
    for i in range(cfg.num_layers):
        pre = f"{block.gguf_layers}{i}."
        for w in block.gguf_weights(cfg, i):
            heads = None
            if family.gguf_permuted and w.rotary:
                heads = [n // cfg.head_dim if r else None for n, r in zip(w.parts(cfg), w.rotary)]
            names, shapes = [pre + n for n in w.gguf], w.shapes(cfg)
            if w.experts:   # one [experts, rows, columns] tensor per part
                shapes = [(cfg.moe.num_experts, *shape) for shape in shapes]
            for j in range(cfg.moe.num_experts) if w.experts else (None,):
                plan.append(((i, j, w.attr), names, shapes, heads, w))
    plan.append(whole(block.norm, "norm"))
    if not cfg.tie_word_embeddings:
        plan.append(whole(block.lm_head, "lm_head"))
    return plan


class GGUFLoad:
    """Loads a GGUF file's weights into a LlamaModel, one stored tensor (one expert's
    matrix of a stacked expert tensor) at a time."""

    def __init__(self, tensors: GGUFTensors, cfg, ops, quantized: bool = True, blocks_on: Optional[str] = None):
        self.family = families.gguf_family(tensors.architecture, cfg.moe is not None)
        if self.family.model_type != cfg.architecture:
            raise ValueError(f"{tensors.path.name}: a GGUF of architecture {tensors.architecture!r} is read as "
                             f"{self.family.model_type}, not {cfg.architecture}")
        self.tensors, self.cfg, self.ops, self.quantized = tensors, cfg, ops, quantized
        # Where set, weights served as stored are kept as QuantBlocks on that device (the
        # Triton reference's form), not packed by `ops` (the CPU reference kernels').
        self.blocks_on = blocks_on
        self.fingerprint = Fingerprint(cfg)
        self.served = Counter()        # {how a stored type is served: stored tensor count}
        self.converted = Counter()     # quantized types converted to bf16: {type: stored tensor count}

    def _rows(self, name: str, as_stored: bool, heads: Optional[int] = None, expert: Optional[int] = None):
        """(stored bytes or bf16 values) of one tensor (of a stacked expert tensor, one
        expert's matrix), its rows unpermuted where `heads` (the rotary heads it holds) is
        given; its bytes enter the fingerprint as they are read."""
        t = self.tensors.tensors[name]
        raw = self.tensors.raw(name, expert)
        self._count(t, as_stored, expert)
        how = t.type if as_stored else "bf16"
        self.fingerprint.add(name if expert is None else f"{name}[{expert}]", f"{t.type}->{how}",
                             t.shape if expert is None else t.shape[1:], raw)
        rows = raw if as_stored else self.tensors.values(name, raw, self.cfg.hidden_size)
        if heads is not None:
            rows = unpermute(rows, heads)
            rows = np.ascontiguousarray(rows) if isinstance(rows, np.ndarray) else rows.contiguous()
        return rows

    def _count(self, t: StoredTensor, as_stored: bool, expert: Optional[int]) -> None:
        if expert in (None, 0):        # a stacked expert tensor counts once
            self.served[f"{t.type} as {'stored' if as_stored else 'bf16'}"] += 1
            if not as_stored and t.type not in PLAIN_TYPES:
                self.converted[t.type] += 1

    def _stored_slices(self, name: str, each=None):
        """A matrix served as stored, read SLICE_ROWS rows at a time, its bytes hashed into
        the fingerprint (the same hash as whole, _rows'); `each(start row, slice)` is
        given every slice before the next is read."""
        t = self.tensors.tensors[name]
        self._count(t, True, None)
        rows = t.shape[0]

        def slices():
            for start in range(0, rows, SLICE_ROWS):
                raw = self.tensors.raw_part(name, (start, min(rows, start + SLICE_ROWS)))
                if each is not None:
                    each(start, raw)
                yield raw
        self.fingerprint.add_slices(name, f"{t.type}->{t.type}", t.shape, slices())

    def _packed_in_slices(self, name: str) -> torch.Tensor:
        """qpack's copy of a matrix served as stored, packed SLICE_ROWS rows at a time into
        its place (the same bytes as packed whole: a slice of whole records)."""
        rows, kind = self.tensors.tensors[name].shape[0], SERVED_QUANTIZED[self.tensors.tensors[name].type]
        out = []

        def pack(start: int, raw: np.ndarray) -> None:
            part = self.ops.qpack(torch.from_numpy(raw), kind)
            if not out:
                out.append(torch.empty(((rows + 15) // 16, *part.shape[1:]), dtype=part.dtype))
            out[0][start // 16:start // 16 + part.shape[0]] = part
        self._stored_slices(name, pack)
        return out[0]

    def _fill(self, model, w: torch.Tensor, names: list, heads: Optional[list] = None,
              expert: Optional[int] = None, looked_up: bool = False) -> None:
        """w from the stored tensors `names` (expert `expert`'s matrix of each, for an
        expert's weight), stacked by rows: packed as stored where each is of a type
        served quantized (parts of different types: each run of one type packed on its
        own, a cpu_linear.Stacked; for the Triton reference, a packing.StackedBlocks),
        else converted to bf16. `heads`: per name, the rotary heads whose rows the file
        permuted (None: as stored). A router is always converted: its logits are a bf16
        matrix's (kernels/SPEC.md, "Mixture of experts"). `looked_up`: w is only looked up
        by rows (an untied embedding): served quantized, it stays in the file, read by
        rows as they are looked up (packing.StoredRows)."""
        heads = heads or [None] * len(names)
        kinds = [self.tensors.tensors[n].type for n in names]
        if (self.quantized and all(k in SERVED_QUANTIZED for k in kinds)
                and not any(w is r for r in model.routers())):
            if (self.blocks_on is None and len(names) == 1 and heads[0] is None and expert is None
                    and len(self.tensors.tensors[names[0]].shape) == 2):   # one matrix as stored: in slices
                if looked_up:
                    self._stored_slices(names[0])
                    packing.set_stored_rows(model, w, self.tensors.stored_rows(names[0], SERVED_QUANTIZED[kinds[0]]), self.ops)
                else:
                    packed = Packed(self._packed_in_slices(names[0]), w.shape[0], w.shape[1])
                    packing.set_packed(model, w, packed, self.ops)
                return
            runs = [(kind, [self._rows(n, True, h, expert) for _, n, h in run])
                    for kind, run in itertools.groupby(zip(kinds, names, heads), key=lambda entry: entry[0])]
            if self.blocks_on is not None:
                blocks = tuple(split_blocks(np.concatenate(rows) if len(rows) > 1 else rows[0], kind,
                                            w.shape[1]).to(self.blocks_on) for kind, rows in runs)
                packing.set_blocks(model, w, blocks[0] if len(blocks) == 1 else StackedBlocks(blocks))
                return
            packed = []
            while runs:   # each run's stored rows let go once packed
                kind, rows = runs.pop(0)
                raw = np.concatenate(rows) if len(rows) > 1 else rows[0]
                del rows
                packed.append(Packed(self.ops.qpack(torch.from_numpy(raw), SERVED_QUANTIZED[kind]), raw.shape[0],
                                     w.shape[1]))
                del raw
            packing.set_packed(model, w, packed[0] if len(packed) == 1 else Stacked(tuple(packed)), self.ops)
            return
        with torch.no_grad():
            start = 0
            for n, h in zip(names, heads):   # one part at a time, in slices of rows: never a whole one in binary32
                part = self._rows(n, False, h, expert)
                w[start:start + part.shape[0]].copy_(part.reshape(-1, *w.shape[1:]))
                start += part.shape[0]

    def _plan(self, model) -> list:
        """(the parameter, its parts' GGUF names, their shapes in the file, the rotary heads
        per part or None, the expert or None) for every weight the model takes from the
        file, in the file's reading order (the fingerprint's: reading_plan)."""
        def target(layer, expert, attr):
            owner = model if layer is None else model.layers[layer]
            return getattr(owner if expert is None else owner.experts[expert], attr)
        return [(target(*where), names, shapes, heads, where[1])
                for where, names, shapes, heads, _ in reading_plan(self.family, self.cfg)]

    def _check(self, plan: list) -> None:
        """Refuse (ValueError naming the tensor) a file that lacks a tensor the model
        takes, holds one it does not take, or holds one in another shape."""
        file, have = self.tensors.path.name, self.tensors.tensors
        want = {n: shape for _, names, shapes, _, _ in plan for n, shape in zip(names, shapes)}
        for name in have:
            if name not in want:
                raise ValueError(f"{file}: tensor {name} is not part of a {self.tensors.architecture} "
                                 f"{'mixture of experts' if self.cfg.moe else 'decoder'} gateeng serves")
        for name, shape in want.items():
            if name not in have:
                raise ValueError(f"{file}: tensor {name} is missing")
            if tuple(have[name].shape) != tuple(shape):
                raise ValueError(f"{file}: tensor {name} has shape {tuple(have[name].shape)}, expected {tuple(shape)} "
                                 "(numpy's order: the reverse of GGUF's)")

    def into(self, model) -> None:
        plan = self._plan(model)
        self._check(plan)
        for target, names, _, heads, expert in plan:
            looked_up = target is model.embed and not self.cfg.tie_word_embeddings
            self._fill(model, target, names, heads, expert, looked_up)
        packing.of(model).stored_types = {t.split(" as ")[0]: n for t, n in sorted(self.served.items())
                                          if t.endswith("stored") and t.split(" as ")[0] in SERVED_QUANTIZED}

    def describe(self) -> str:
        """What serving the file does to its weights, in words, for the start-up log."""
        kept = ", ".join(f"{n} {t.split(' as ')[0]}" for t, n in sorted(self.served.items())
                         if t.endswith("stored"))
        parts = [f"{self.tensors.path.name}: " + (f"{kept} tensors served as stored" if kept else "no tensor served as stored")]
        if self.converted:
            parts.append("dequantized to bf16 (not served as stored): "
                         + ", ".join(f"{n} {t}" for t, n in sorted(self.converted.items())))
        plain = sum(n for t, n in self.served.items() if t.split(" as ")[0] in PLAIN_TYPES)
        if plain:
            parts.append(f"{plain} F32/F16/BF16 tensors in bf16")
        return "; ".join(parts)

