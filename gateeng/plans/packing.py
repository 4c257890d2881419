"""How a model's weights are stored for the plans: packed once, released, or kept
quantized as a GGUF stores them. The model (model.llama) says what the network
computes; this module owns every other form of its weights, as llama.cpp's ggml
owns how a weight is stored and multiplied apart from the graph.

Per model, one PackedWeights (`of`) holds, by id of the model's weight:
- `shared`: the one packed copy of every projection and the lm_head, in the
  reference kernels' layout (plans.cpu_linear.Packed): the reference multiplies it,
  and the fast plan too where it can (`pack_shared`, `pack_fast`); a GGUF's
  quantized weight arrives as such a copy (`set_packed`);
- `blocks`: a quantized weight as the Triton reference reads it (`set_blocks`);
- `stored_rows`: an untied quantized embedding as the GGUF file stores it, read
  from the file row by row as it is looked up (`set_stored_rows`);
- the fast plan's matmuls (`packed`), its float32 logits head (`dense_head`), its
  bf16 candidate head (`lm_head_bf16`), one-call decode layers (`fused_layers`) and
  one-call routing layers' experts (`expert_layers`),
  and the machine-specific invariant plan's matmuls (`invariant_packed`);
- what `pack_fast`'s probe chose, and the cached float32 lm_head.
A weight whose one copy is packed keeps its shape and dtype, its storage emptied, so
a stray use fails loudly; `plain` reads it back. plans.factory calls the packing,
the loaders (model.gguf_weights, model.shard) set what arrives stored, and the plans
read the result. The PackedWeights sits on the model (`LlamaModel.stored`), refers
to no model, and goes with the weights when new ones are loaded.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch

from gateeng.config import SOFTMAX_TOPK
from gateeng.heap import trim_heap
from gateeng.logs import log
from gateeng.plans import cpu_linear, kernel_names

# The GGML types whose values are d * q, without a minimum.
NO_MINIMUM = ("Q4_0", "Q8_0", "Q6_K")


@dataclass(frozen=True)
class QuantBlocks:
    """A quantized weight [N, K] as its integers and scales (kernels/SPEC.md, "Quantized
    weights"), on any device (torch tensors, or numpy arrays before `to`): q int8 [N, K]
    (Q4_0's n - 8, Q6_K's n - 32). Q8_0, Q4_0, Q4_1: d float16 [N, K/32], m float16
    [N, K/32] for Q4_1, else None; sc and mn None. A K-quant: d and m float16 [N, K/256]
    (each super-block's d and dmin; Q6_K: m None), sc int8 [N, K/S] the sub-blocks'
    scales (S = 32; Q6_K: 16), mn int8 [N, K/S] their minimums (Q6_K: None)."""
    q: torch.Tensor
    d: torch.Tensor
    m: Optional[torch.Tensor]
    sc: Optional[torch.Tensor] = None
    mn: Optional[torch.Tensor] = None

    def _parts(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))   # not astuple: it deep-copies

    def to(self, device) -> "QuantBlocks":
        """The same blocks as torch tensors on `device`."""
        return QuantBlocks(*(None if a is None else torch.as_tensor(a).to(device) for a in self._parts()))

    def rows(self, n: int) -> "QuantBlocks":
        """The first n rows' blocks."""
        return QuantBlocks(*(None if a is None else a[:n] for a in self._parts()))


@dataclass(frozen=True)
class StackedBlocks:
    """A stacked projection whose parts a GGUF stores in different quantized types, as
    the Triton reference reads it: each run of parts of one type its own QuantBlocks, in
    row order, multiplied part by part and side by side, as cpu_linear.Stacked is (each
    output of the reference's dot is its own column's, so these are the stack's bits)."""
    parts: tuple   # of QuantBlocks


def block_parts(blocks) -> tuple:
    """The QuantBlocks of a QuantBlocks or StackedBlocks weight, in row order."""
    return blocks.parts if isinstance(blocks, StackedBlocks) else (blocks,)


@dataclass(frozen=True)
class StoredRows:
    """A quantized embedding [N, K] as its GGUF file stores it: `rows` rows of
    `row_bytes` bytes from byte `offset` of `file` (opened at load, so the rows are the
    loaded file's even if its path is replaced), `ggml` its GGML type id. An embedding
    is looked up, never multiplied whole, so the rows of the tokens a batch looks up
    are read from the file then (`take`, a pread per distinct row) and dropped with the
    batch: the process holds none of the table (the OS's page cache keeps what is read
    often).
    A memory map of the table became the process's own pages as rows were looked up,
    64 KiB around each (the kernel's fault-around), so serving a few hundred distinct
    tokens made most of a 1.17B Llama's 79 MiB Q6_K embedding resident."""
    file: io.FileIO
    offset: int
    rows: int
    row_bytes: int
    ggml: int

    def _read(self, out: np.ndarray, at: int, what: str) -> None:
        if os.preadv(self.file.fileno(), [out], self.offset + at) != out.nbytes:
            raise ValueError(f"{Path(self.file.name).name} is truncated: {what} ends past the end of the file")

    def take(self, ids) -> torch.Tensor:
        """uint8 [len(ids), row_bytes]: the stored rows of token ids `ids` (a sequence or
        an integer tensor), in their order; each distinct row read once."""
        distinct, where = torch.unique(torch.as_tensor(ids, dtype=torch.int64, device="cpu").reshape(-1),
                                       return_inverse=True)
        out = torch.empty(len(distinct), self.row_bytes, dtype=torch.uint8)
        view = out.numpy()
        for j, i in enumerate(distinct.tolist()):
            if not 0 <= i < self.rows:
                raise IndexError(f"token id {i} is out of range for an embedding of {self.rows} rows")
            self._read(view[j], i * self.row_bytes, f"embedding row {i}")
        return out[where]

    def whole(self) -> torch.Tensor:
        """uint8 [rows, row_bytes]: every stored row, read at once."""
        out = torch.empty(self.rows, self.row_bytes, dtype=torch.uint8)
        self._read(out.numpy().reshape(-1), 0, "the embedding")
        return out


class FusedLayers(NamedTuple):
    """What FastPlan.decode_layers hands cpu_ops.cpp's decode_layers: every layer's qkv,
    o, gate_up and down in the reference kernels' layout, a Stacked matrix's parts one
    after the other, a routing layer's gate_up and down with no parts."""
    packed: list         # every part's packed data, in that order
    out_sizes: list      # each part's output size
    parts: list          # how many parts each matrix has (4 a layer)
    norms: list          # each layer's post-attention norm and the norm after its MLP
    qk_norms: list       # each layer's q and k norms, or empty (no q/k norms)
    routing: Any         # the routing layers' routers and experts (cpu_ops MoeLayers), or None
    matmul: Optional[Callable]   # None: cpu_ops' own VDPBF16PS; else linear(x, data, n, f32, per)


class PackedWeights:
    """One model's weights as the plans hold them (see the module doc)."""

    def __init__(self, lm_head: torch.Tensor):
        self.packed = {}   # id(weight) -> x @ weight.T for the fast plan (pack_fast)
        self.shared = {}   # id(weight) -> cpu_linear.Packed: the one packed copy (pack_shared, set_packed)
        self.blocks = {}   # id(weight) -> QuantBlocks or StackedBlocks: a quantized weight on a device (set_blocks)
        self.stored_rows = {}   # id(weight) -> StoredRows: an untied embedding as stored (set_stored_rows)
        # Weights served as stored in a GGUF file (model.gguf_weights): {type: tensors}, and
        # the reference kernels their packed copies need (embedding rows, plain copies).
        self.stored_types, self.quant_ops = {}, None
        self.fast_quantized_matmul = None   # the fast plan's matmul on them, by kernel_plan name (pack_fast)
        self.invariant_packed = {}   # the same for the machine-specific invariant plan, whose bits
        self.invariant_matmul = kernel_names.TORCH_MM   # depend on the kernel: its name in kernel_plan
        # pack_fast's probe: the fast plan takes the row-invariant kernel up to this many
        # rows and the other one above (None: the row-invariant kernel at every row count).
        self.fast_rowwise_max_rows = None
        self.dense_head = None   # hidden -> float32 logits on the packed lm_head (pack_fast)
        # dense_head where it is cpu_ops' int8 kernel on a quantized lm_head of one part
        # whose values are d * q (no minimum): the reference's greedy candidate search
        # bounds its error (plans.head.int8_logit_bound; pack_fast).
        self.int8_head = None
        self.lm_head_abs_sum = None   # int8_head's weight bound, made on first use (lm_head_abs_sum)
        self.plain_needed = True   # whether a plan multiplies the plain weights (pack_fast)
        self.freed_bytes = 0       # plain weights freed once packed (pack_shared, release_plain_weights)
        # pack_shared's check of each weight's row-invariant matmul (id -> the matmul, or
        # None where it disagreed), and that matmul's name.
        self.rowwise_checked, self.rowwise_checked_name = {}, None
        self.fused_layers = None   # FusedLayers: the one-call decode layers (pack_fast)
        # id(expert 0's gate_up) -> (every expert's gate_up data, down data, gate_up's and
        # down's output sizes) for FastPlan.moe_layer (pack_fast, quantized experts).
        self.expert_layers = {}
        self.lm_head_bf16 = lambda x: torch.nn.functional.linear(x, lm_head)   # the greedy candidate search
        self.lm_head_f32 = None       # the float32 lm_head, made on first use (lm_head_f32)
        self.lm_head_max_norm = None  # its largest row norm, made on first use (lm_head_max_norm)

    @property
    def quantized(self) -> bool:
        """Whether some weights are served quantized, as stored (set_packed, set_blocks)."""
        return (bool(self.blocks) or bool(self.stored_rows)
                or any(cpu_linear.quantized(p) for p in self.shared.values()))


def of(model) -> PackedWeights:
    """The model's PackedWeights, made on first use (as LlamaModel.stored)."""
    if model.stored is None:
        model.stored = PackedWeights(model.lm_head)
    return model.stored


def quantized(model) -> bool:
    """Whether some of the model's weights are served quantized, as stored."""
    return of(model).quantized


def _released(t: torch.Tensor) -> bool:
    """Whether release_plain_weights emptied t's storage."""
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _release(t: torch.Tensor) -> int:
    """Empty t's storage (its shape and dtype stay; a stray use fails loudly); the bytes freed."""
    freed = t.untyped_storage().nbytes()
    t.untyped_storage().resize_(0)
    return freed


def lm_head_f32(model) -> torch.Tensor:
    """The lm_head in float32, made on first use: only the plans that take logits
    from a float32 matmul read it (the machine-specific invariant plan, the exact
    top-2 of plans.head). A float32 model's is its lm_head itself."""
    s = of(model)
    if s.lm_head_f32 is None:
        s.lm_head_f32 = model.lm_head.detach().float()
    return s.lm_head_f32


def lm_head_abs_sum(model) -> float:
    """An upper bound on every row's sum of |w| of a quantized lm_head (int8_head's):
    each value's bf16 rounding (qrows) is within 2^-9 of it, so the sum of the rounded
    magnitudes, in float64, times 1 + 2^-8 is at least the true sum (the float64 sum's
    own rounding is far below that slack)."""
    s = of(model)
    if s.lm_head_abs_sum is None:
        p = s.shared[id(model.lm_head)]
        best = 0.0
        for ids in torch.arange(p.n).split(4096):
            best = max(best, float(s.quant_ops.qrows(p.data, ids, p.per).double().abs().sum(-1).max()))
        s.lm_head_abs_sum = best * (1 + 2.0 ** -8)
    return s.lm_head_abs_sum


def lm_head_max_norm(model) -> float:
    """The largest row norm of the lm_head: bounds the bf16 lm_head's error (plans.head)."""
    s = of(model)
    if s.lm_head_max_norm is None:
        s.lm_head_max_norm = max(float(rows.float().norm(dim=-1).max())
                                 for rows in model.lm_head.detach().split(4096))
    return s.lm_head_max_norm


def set_blocks(model, w: torch.Tensor, blocks) -> None:
    """w's one copy is `blocks`, a quantized weight as the Triton reference reads it
    (QuantBlocks, or a StackedBlocks of parts stored in different types;
    kernels/triton_reference.py qmatmul, qrows): w keeps its shape, without storage.
    Call after LlamaModel.finalize."""
    _release(w)
    of(model).blocks[id(w)] = blocks


def set_packed(model, w: torch.Tensor, packed, ops) -> None:
    """w's one copy is `packed`, a quantized weight in the reference kernels' layout
    (cpu_linear.Packed, or a Stacked of parts stored in different types; `ops`: their
    module, which reads it): w keeps its shape, without storage. Call after
    LlamaModel.finalize."""
    _release(w)
    s = of(model)
    s.shared[id(w)] = packed
    s.quant_ops = ops


def set_stored_rows(model, w: torch.Tensor, rows: StoredRows, ops) -> None:
    """w's one copy is `rows`, an embedding as its GGUF file stores it, read by the
    reference kernels' module `ops` (embed_rows): w keeps its shape, without storage."""
    _release(w)
    s = of(model)
    s.stored_rows[id(w)] = rows
    s.quant_ops = ops


def pack_shared(model, ref, release: bool = False, kernels=None) -> None:
    """The one packed copy of every projection and the lm_head, in the reference
    kernels' layout (`ref`: plans.reference_ops' module), as `shared`: the
    reference multiplies it, and the fast plan too where it can (pack_fast).
    Nothing where the reference does not take this model's weights.
    `release` (a model no one else holds, as for release_plain_weights): each plain
    weight is freed as soon as its packed copy exists, so start-up never holds the
    weights twice, only one weight more than once. pack_fast reads a freed weight
    back from its packed copy where it needs it (plain), and puts every plain
    weight back where a plan multiplies them after all (restore_plain_weights).
    With `kernels` (the C++ kernels pack_fast will get), each weight's row-invariant
    matmul is checked against F.linear here, while its plain copy is still at hand."""
    s = of(model)
    every = [w for w in model.projections() + [model.lm_head] if id(w) not in s.shared]
    if not every or ref is None:
        return
    if not all(cpu_linear.packable(w, ref) for w in every):
        return
    name = cpu_linear.rowwise_kernel(kernels, ref)
    for w in every:
        p = s.shared[id(w)] = cpu_linear.shared_pack(w, ref)
        if name is not None:
            s.rowwise_checked[id(w)] = cpu_linear.checked(cpu_linear.rowwise(name, p, kernels, ref), w)
        if release:
            s.freed_bytes += _release(w)
            # glibc keeps a freed block of up to 32 MiB for reuse, and the packed copies
            # do not all fit the plain weights' blocks: without handing each back, the
            # process's peak held the plain weights and the packed copies at once.
            trim_heap()
    s.rowwise_checked_name = name
    if release:
        s.lm_head_f32 = None


def plain(model, w: torch.Tensor) -> torch.Tensor:
    """w, or where pack_shared freed it, an exact copy read back from its packed copy
    (a quantized weight: its values in bf16, kernels/SPEC.md)."""
    if not _released(w):
        return w
    s = of(model)
    p = s.shared[id(w)]
    if cpu_linear.quantized(p):
        return torch.cat([s.quant_ops.qrows(q.data, torch.arange(q.n), q.per) for q in cpu_linear.parts(p)])
    return cpu_linear.unpack(p)


def restore_plain_weights(model) -> None:
    """Every freed plain weight back, read from its packed copy (its own storage
    again, so every reference to the weight sees it)."""
    s = of(model)
    if s.quantized:
        raise RuntimeError("quantized weights have no plain copy to restore")
    with torch.no_grad():
        for w in model.projections() + [model.lm_head]:
            if _released(w):
                values = cpu_linear.unpack(s.shared[id(w)])
                w.untyped_storage().resize_(values.numel() * values.element_size())
                w.copy_(values)
    s.freed_bytes = 0


def pack_fast(model, kernels=None, ref=None) -> None:
    """The fast plan's matmuls (`packed`, plans.cpu_linear says which): with the C++
    kernels (`kernels`), a row-invariant matmul on the shared copy (pack_shared),
    with float32 logits from the same packed lm_head (`dense_head`); a start-up
    probe keeps oneDNN's packed copy too only where it is much faster at some row
    count. Without a row-invariant matmul, oneDNN's copy (or the plain weights),
    which the machine-specific invariant plan multiplies in fixed row groups."""
    s = of(model)
    if s.packed:
        return
    weights = model.projections()
    every = weights + [model.lm_head]
    if s.quantized:
        return _pack_quantized(model, s, kernels, ref)
    name = cpu_linear.rowwise_kernel(kernels, ref) if s.shared else None
    rowwise = {}
    if name is not None:   # each weight checked on its own, by pack_shared or here (plain: read back)
        done = s.rowwise_checked if s.rowwise_checked_name == name else {}
        rowwise = {id(w): done[id(w)] if id(w) in done else
                   cpu_linear.checked(cpu_linear.rowwise(name, s.shared[id(w)], kernels, ref), plain(model, w))
                   for w in every}
        if not all(rowwise.values()):   # a kernel that disagrees with F.linear is never used
            rowwise, name = {}, None
    onednn = cpu_linear.onednn_available()

    def other(w):   # the fast plan's alternative to the row-invariant kernel
        values = plain(model, w)   # (a copy read back only for the probe: `others` come after a restore)
        return cpu_linear.pack(values) if onednn else (lambda x: torch.nn.functional.linear(x, values))
    copy_bytes = sum(w.numel() * w.element_size() for w in every)
    if rowwise and not cpu_linear.second_copy_fits(copy_bytes):
        log(f"fast plan: no second copy of the weights is tried ({copy_bytes / 2**20:.0f} MiB would not fit "
            "in the memory available)")
    elif rowwise:
        probe = model.first_mlp()[0]
        s.fast_rowwise_max_rows = cpu_linear.rowwise_max_rows(rowwise[id(probe)], other(probe), probe.shape[1])
    need_other = not rowwise or s.fast_rowwise_max_rows is not None   # it serves some row counts
    s.plain_needed = not rowwise or (need_other and not onednn)
    if s.plain_needed:
        restore_plain_weights(model)
    others = {id(w): other(w) for w in every} if need_other and (rowwise or onednn) else {}
    fast = {id(w): cpu_linear.fast_linear(rowwise.get(id(w)), others.get(id(w)), s.fast_rowwise_max_rows)
            for w in every}
    s.packed = {id(w): fast[id(w)] for w in weights if fast[id(w)] is not None}
    s.lm_head_bf16 = fast[id(model.lm_head)] or s.lm_head_bf16
    # Only weights really packed: the invariant plan's description says which kernel.
    if rowwise:
        s.dense_head = cpu_linear.dense_head(s.shared[id(model.lm_head)], ref)
        s.invariant_packed = {id(w): rowwise[id(w)] for w in weights}
        s.invariant_matmul = name
    elif s.packed:
        s.invariant_packed, s.invariant_matmul = dict(s.packed), kernel_names.ONEDNN_PACKED
    # The C++ one-call decode layers (FastPlan.decode_layers) take the row-invariant
    # matmul (VDPBF16PS, or the reference's AVX2 build) at the row counts it serves,
    # and layers without biases (routing layers: only on quantized experts).
    if rowwise and _plain_layers(model, s):   # (not a shard: its o and down sum over the ranks)
        s.fused_layers = _fused_layers(model, s, None if name == kernel_names.CPU_DPBF16 else ref.linear, kernels)


def _pack_quantized(model, s: PackedWeights, kernels, ref) -> None:
    """pack_fast for weights served as stored: the fast plan multiplies them with
    cpu_ops' int8 kernels where the CPU has them (Q8_0, Q4_0, Q4_1 and the K-quants:
    AVX-512 VNNI, else AVX2), each its own arithmetic, else with the reference's
    matmul, the one kernel that takes every layout (bf16 weights beside them too)."""
    from gguf import GGMLQuantizationType   # (a GGUF's weights: the package is loaded already)

    weights = model.projections()
    ref = ref or s.quant_ops   # the build that packed them reads them in any case
    avx2 = getattr(kernels, "qavx2", False)
    int8, kint8, name = ((kernels.qlinear_vnni, kernels.qlinear_k_vnni, kernel_names.CPU_QVNNI)
                         if getattr(kernels, "qvnni", False) else
                         (kernels.qlinear_avx2, kernels.qlinear_k_avx2, kernel_names.CPU_QAVX2) if avx2 else
                         (None, None, kernel_names.REF_LINEAR))

    def kernel(data: torch.Tensor):
        """The fast matmul of one packed weight."""
        if data.dtype != torch.uint8:
            return ref.linear
        return (int8 if ref.qblock(data) == 32 else kint8) or ref.linear
    every = [q for w in weights + [model.lm_head] for q in cpu_linear.parts(s.shared[id(w)])]
    used = {kernel(p.data) for p in every}
    s.fast_quantized_matmul = kernel_names.REF_LINEAR if used == {ref.linear} else name

    def fast(w, f32=False):
        p = s.shared[id(w)]
        fns = {id(q): kernel(q.data) for q in cpu_linear.parts(p)}

        def run(x):
            x = x.contiguous()
            return cpu_linear.side_by_side(p, lambda q: fns[id(q)](x, q.data, q.n, f32, q.per))
        return run
    s.packed = {id(w): fast(w) for w in weights}
    s.lm_head_bf16 = fast(model.lm_head)
    s.dense_head = fast(model.lm_head, True)
    head = cpu_linear.parts(s.shared[id(model.lm_head)])
    if (len(head) == 1 and head[0].data.dtype == torch.uint8 and kernel(head[0].data) in (int8, kint8)
            and GGMLQuantizationType(ref.qtype(head[0].data)).name in NO_MINIMUM):
        s.int8_head = s.dense_head
    s.invariant_packed = {id(w): cpu_linear.rowwise(kernel_names.REF_LINEAR, s.shared[id(w)], kernels, ref)
                          for w in weights}
    s.invariant_matmul = kernel_names.REF_LINEAR
    s.plain_needed = False
    if avx2 and model.tp is None:
        s.expert_layers = _expert_layers(model, s, lambda data: kernel(data) is not ref.linear)
    if _plain_layers(model, s):
        kernels_used = {kernel(q.data) for q in _layer_parts(model, s)}
        # Layers of several record types (a Q4_K_M file's Q4_K and Q6_K): the one C++
        # matmul that picks `kernel`'s int8 kernel by record, so no Python runs per matmul.
        matmul = (next(iter(kernels_used)) if len(kernels_used) == 1 else
                  kernels.qlinear_int8 if ref.linear not in kernels_used else
                  lambda x, data, n, f32, per: kernel(data)(x, data, n, f32, per))
        s.fused_layers = _fused_layers(model, s, matmul, kernels)


def _expert_layers(model, s: PackedWeights, int8) -> dict:
    """The routing layers cpu_ops' moe_layer runs in one call (their experts on moe_experts): each
    expert's gate_up and down one packed weight (not a Stacked), of K's own lanes, that
    an int8 kernel takes (`int8(data)`); keyed by id of expert 0's gate_up."""
    out = {}
    for layer in model.step_layers:
        if layer.experts is None:
            continue
        copies = [[s.shared.get(id(w)) for w in pair] for pair in layer.experts]
        if all(isinstance(p, cpu_linear.Packed) and p.per == 0 and p.data.dtype == torch.uint8 and int8(p.data)
               for pair in copies for p in pair):
            out[id(layer.experts[0][0])] = ([g.data for g, _ in copies], [d.data for _, d in copies],
                                            copies[0][0].n, copies[0][1].n)
    return out


def _plain_layers(model, s: PackedWeights) -> bool:
    """Whether the one-call decode layers can run the model: no biases, every routing
    layer's experts in `expert_layers` (on the int8 kernels) with a bf16 router, and not
    a tensor-parallel shard (whose o and down sum over the ranks)."""
    return model.tp is None and all(
        layer.qkv_bias is None and layer.o_bias is None and
        (layer.experts is None or (id(layer.experts[0][0]) in s.expert_layers and layer.router.dtype == torch.bfloat16))
        for layer in model.step_layers)


def _layer_parts(model, s: PackedWeights) -> list:
    """The packed parts of every layer's qkv, o, gate_up and down (a routing layer's
    gate_up and down: none), in the order the one-call decode layers read them."""
    return [q for lw in model.step_layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down) if w is not None
            for q in cpu_linear.parts(s.shared[id(w)])]


def _fused_layers(model, s: PackedWeights, matmul, kernels) -> FusedLayers:
    """The one-call decode layers of the model's packed weights on `matmul`."""
    every = _layer_parts(model, s)
    steps = model.step_layers
    parts = [0 if w is None else len(cpu_linear.parts(s.shared[id(w)]))
             for lw in steps for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    qk_norms = [w for lw in steps for w in (lw.q_norm, lw.k_norm)] if model.cfg.qk_norm else []
    routing = [lw for lw in steps if lw.experts is not None]
    moe = None
    if routing:
        experts = [s.expert_layers[id(lw.experts[0][0])] for lw in routing]
        rule = model.cfg.moe
        moe = kernels.MoeLayers([lw.router for lw in routing], [e[0] for e in experts], [e[1] for e in experts],
                                experts[0][2], experts[0][3], rule.top_k, rule.routing == SOFTMAX_TOPK,
                                rule.norm_topk_prob, bool(getattr(kernels, "qvnni", False)))
    return FusedLayers([q.data for q in every], [q.n for q in every], parts,
                       [w for lw in steps for w in (lw.post_norm, lw.next_norm)], qk_norms, moe, matmul)


def drop_weight(model, w: torch.Tensor) -> None:
    """Let w's memory go, its plain storage and its packed copy: for a model no one
    else holds whose weights were copied elsewhere (model.shard), which then no
    longer runs."""
    of(model).shared.pop(id(w), None)
    if not _released(w):
        _release(w)


def release_plain_weights(model) -> int:
    """Free the plain projection and lm_head weights where no plan multiplies them
    (pack_fast: the one packed copy serves both plans): each keeps its shape and
    dtype, its storage emptied, so a stray use fails loudly ("setStorage ...
    requiring a storage size") instead of reading anything. A tied embedding's
    rows then come from the packed lm_head (embed_rows). Returns the bytes freed.
    Only for a model no one else holds (the engine that loaded it): a released
    model no longer runs on torch ops. Counts the weights pack_shared freed too."""
    s = of(model)
    if s.plain_needed or not s.shared:
        return 0
    # An untied embedding is not in this list: its plain rows stay (looked up, not multiplied).
    for w in model.projections() + [model.lm_head]:
        s.freed_bytes += _release(w)
    s.lm_head_f32 = None
    return s.freed_bytes


def quantized_embedding(model) -> Optional[cpu_linear.Packed]:
    """The embedding's whole quantized packed copy (ref_ops.cpp qpack), packed from the
    file's rows where it is served from them; None where it is not quantized."""
    s = of(model)
    stored = s.stored_rows.get(id(model.embed))
    if stored is not None:
        return cpu_linear.Packed(s.quant_ops.qpack(stored.whole(), stored.ggml), *model.embed.shape)
    p = s.shared.get(id(model.embed))
    return p if p is not None and cpu_linear.quantized(p) else None


def embed_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """The embeddings of token ids: rows of the embedding, or of the packed lm_head
    when they are tied and the plain copy was released (the pairs of a row sit at
    [id // 16, :, id % 16, :] of the packed layout)."""
    if not _released(model.embed):
        return model.embed[ids]
    s = of(model)
    stored = s.stored_rows.get(id(model.embed))
    if stored is not None:   # qrows reads each row alone: the rows packed apart give the same values
        packed = s.quant_ops.qpack(stored.take(ids), stored.ggml)
        return s.quant_ops.qrows(packed, torch.arange(ids.shape[0]), 0)
    packed = s.shared[id(model.embed)].data
    if packed.dtype == torch.uint8:
        return s.quant_ops.qrows(packed, ids, s.shared[id(model.embed)].per)
    return packed[ids // 16, :, ids % 16, :].reshape(ids.shape[0], -1)
