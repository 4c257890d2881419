"""x @ w.T on CPU bf16 weights packed once at load.

One copy: every projection and the lm_head are packed once, in the reference's
layout ([ceil(N/16)][K/2][16][2] pairs: kernels/ref_ops.cpp `pack`, which cpu_ops'
VDPBF16PS kernel reads too), and every CPU plan multiplies that copy:
- the reference (ReferencePlan), with its own matmul (SPEC.md's order);
- the fast plan, with the fastest row-invariant matmul this CPU has on that
  layout (`rowwise_kernel`): VDPBF16PS in fast math (`cpu_dpbf16`, kernels/
  cpu_ops.cpp) where the CPU has AVX-512 BF16, else the reference's own AVX2
  matmul (`ref_avx2`), as fast as a dedicated AVX2 kernel on SmolLM2's shapes
  (bench/RESULTS.md). Every output is one fixed chain over K, so a row's bits do
  not depend on the row count;
- a float32 logits head (`dense_head`): the reference's matmul with binary32
  output on the packed lm_head, as cheap as the bf16 one.

oneDNN's layout (`pack`) is a second copy, kept only where a start-up probe
finds it much faster than the row-invariant kernel at some row count (the
matrix units of AMX CPUs on prefill chunks), or where there is no row-invariant
kernel; the machine-specific invariant plan (float32 models, or no reference
build) multiplies it in row groups of a fixed size.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gateeng.plans.kernel_names import AVX2, CPU_DPBF16, REF_AVX2, REF_LINEAR

# Row counts the probe compares the two kernels at (decode batches, then prefill chunks).
PROBE_ROWS = (1, 8, 32, 128, 512)
# A second copy of every weight must buy at least this much speed at some probed
# row count to be kept, and fit in this share of the memory still available once the
# weights are loaded (the KV cache and the requests need the rest): a model that
# barely fits is served from one copy rather than stopped by the OOM killer.
SECOND_COPY_SPEEDUP = 1.25
SECOND_COPY_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class Packed:
    """One weight in the reference's packed layout: the copy the CPU plans share. `data`
    is bf16 pairs (pack), or uint8 records of a quantized weight (ref_ops.cpp `qpack`)."""
    data: torch.Tensor
    n: int   # output columns (the weight's rows)
    k: int
    # A quantized weight's lanes: 0 for its own K's (ceil(blocks / 16) blocks each), else
    # those of the whole K a tensor-parallel rank's slice of K belongs to (model.shard).
    per: int = 0


@dataclass(frozen=True)
class Stacked:
    """A stacked projection (q, k and v; gate and up) whose parts a GGUF stores in
    different quantized types (llama.cpp's Q4_K_M: v in Q6_K beside q and k in Q4_K):
    each run of parts of one type is its own Packed, in row order, and x @ w.T is their
    products side by side. Each output of the reference's dot is a function of x and
    its own column's weights only (kernels/SPEC.md), so a stack multiplied part by part
    has the bits of the same columns multiplied together."""
    parts: tuple   # of Packed

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k


def parts(p) -> tuple:
    """The Packed weights of a Packed or Stacked copy, in row order."""
    return p.parts if isinstance(p, Stacked) else (p,)


def side_by_side(p, product: Callable) -> torch.Tensor:
    """product(part) for each part of p (Packed or Stacked), the outputs side by side
    (along the last dimension: the weight's rows)."""
    if not isinstance(p, Stacked):
        return product(p)
    return torch.cat([product(q) for q in p.parts], dim=-1)


def is_packed(t) -> bool:
    """Whether t is a packed copy (Packed or Stacked), not a plain tensor."""
    return isinstance(t, (Packed, Stacked))


def quantized(p) -> bool:
    """Whether a packed copy (Packed or Stacked) holds a quantized weight's records."""
    return p is not None and parts(p)[0].data.dtype == torch.uint8


def packable(w: torch.Tensor, ref) -> bool:
    """Whether the reference takes w (ref: the reference kernels, plans.reference_ops):
    a CPU bf16 [N, K] matrix with K even."""
    return (ref is not None and w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 2
            and w.shape[1] % 2 == 0)


def shared_pack(w: torch.Tensor, ref) -> Optional[Packed]:
    """w in the reference's layout, or None where the reference does not take it."""
    return Packed(ref.pack(w.detach()), w.shape[0], w.shape[1]) if packable(w, ref) else None


def unpack(p: Packed) -> torch.Tensor:
    """The plain [n, k] weight back from its packed copy, exactly: the layout
    [ceil(n/16)][k/2][16][2] only moves values (w[16b + r, 2j + t] sits at [b, j, r, t])."""
    return p.data.permute(0, 2, 1, 3).reshape(-1, p.k)[:p.n].contiguous()


def rowwise_kernel(kernels, ref) -> Optional[str]:
    """The fast plan's row-invariant matmul on the shared layout, by its kernel_plan
    name, or None (no C++ kernels, or no such matmul on this CPU)."""
    if kernels is None or ref is None:
        return None
    if getattr(kernels, "dpbf16", False):
        return CPU_DPBF16
    if getattr(ref, "isa", None) == AVX2:
        return REF_AVX2
    return None


def rowwise(name: str, p: Packed, kernels, ref) -> Callable:
    """x -> x @ w.T (bf16) by the row-invariant matmul `name` on the packed w
    (REF_AVX2, REF_LINEAR: the reference's own)."""
    if name == CPU_DPBF16:
        return lambda x: kernels.linear_dpbf16(x, p.data, p.n)
    assert name in (REF_AVX2, REF_LINEAR), name
    return lambda x: side_by_side(p, lambda q: ref.linear(x, q.data, q.n, False, q.per))


def dense_head(p: Packed, ref) -> Callable:
    """hidden -> float32 logits [rows, vocab]: the reference's matmul with binary32
    output (bf16 x bf16 products, exact in binary32) on the packed lm_head."""
    return lambda h: side_by_side(p, lambda q: ref.linear(h.contiguous(), q.data, q.n, True, q.per))


def onednn_available() -> bool:
    """Whether oneDNN multiplies bf16 here (its packed copy can be made)."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def _agrees(fn, w: torch.Tensor) -> bool:
    """fn(x) is x @ w.T to bf16 accuracy on a probe."""
    probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    got, want = fn(probe).float(), F.linear(probe, w).float()
    return bool(torch.allclose(got, want, rtol=2 ** -6, atol=1e-2 * float(want.abs().max()) + 1e-6))


def pack(w: torch.Tensor, rows_hint: int = 32):
    """A function x -> x @ w.T (x: [rows, in]) on oneDNN's packed copy of w, or None
    where w cannot be packed here (not a CPU bf16 weight, no oneDNN bf16, or the
    packed product disagrees with F.linear on a probe)."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not onednn_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)

        def onednn(x):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
        return onednn if _agrees(onednn, w) else None
    except (RuntimeError, AttributeError):
        return None


def checked(fn, w: torch.Tensor):
    """fn where it agrees with F.linear on w to bf16 accuracy, else None."""
    return fn if _agrees(fn, w) else None


def _best_seconds(fn, x, repeats: int = 5) -> float:
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return best


def rowwise_max_rows(rowwise_fn, other, k: int) -> Optional[int]:
    """The largest probed row count up to which `other` does not beat the
    row-invariant kernel by SECOND_COPY_SPEEDUP; None when it never does (`other`,
    a second copy of the weights, is then not kept). Timed on one weight, alternating."""
    for rows in PROBE_ROWS:
        x = torch.randn(rows, k).to(torch.bfloat16)
        if _best_seconds(rowwise_fn, x) > SECOND_COPY_SPEEDUP * _best_seconds(other, x):
            smaller = [r for r in PROBE_ROWS if r < rows]
            return smaller[-1] if smaller else 0
    return None


def available_bytes() -> Optional[int]:
    """Memory this process may still take: the kernel's MemAvailable, capped by a
    cgroup v2 limit where one is set; None where neither can be read."""
    found = []
    try:
        found += [int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemAvailable:")]
    except (OSError, ValueError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def second_copy_fits(nbytes: int) -> bool:
    """Whether a second copy of nbytes of weights fits (SECOND_COPY_MEMORY_SHARE)."""
    available = available_bytes()
    return available is None or nbytes <= SECOND_COPY_MEMORY_SHARE * available


def fast_linear(rowwise_fn, other, max_rows: Optional[int]):
    """x -> x @ w.T by whichever kernel the probe found faster at x's row count."""
    if rowwise_fn is None or other is None:
        return rowwise_fn or other
    if max_rows is None:
        return rowwise_fn
    if max_rows == 0:
        return other
    return lambda x: rowwise_fn(x) if x.shape[0] <= max_rows else other(x)
