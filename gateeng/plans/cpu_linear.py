"""x @ w.T on CPU bf16 weights packed once at load.

- The row-invariant C++ kernels (kernels/cpu_ops.cpp; `pack_rowwise`): VDPBF16PS
  where the CPU has AVX-512 BF16 (`cpu_dpbf16`), else AVX2 fused multiply-adds
  (`cpu_fma`). Every output is one fixed chain of multiply-adds over K, so a
  row's bits do not depend on the row count: the invariant plan multiplies its
  real rows, unpadded. On a 2-core AVX-512 BF16 EPYC the VDPBF16PS kernel is also
  faster than oneDNN at every row count from 1 to 512 (bench/RESULTS.md).
- oneDNN's layout (`pack`): a plain bf16 weight is re-laid out for the matrix
  unit on every call, so packing it at load makes the SmolLM2 lm_head at 32 rows
  2-3x faster on AVX-512 BF16 and AMX CPUs. Its kernel and blocking depend on the
  row count, so a row's bits do too: the invariant plan calls it only on groups
  of exactly its row count, where the row-invariant kernels are missing.

`fast_linear` gives the fast plan, per weight, whichever of a row-invariant kernel
and the other (oneDNN, or F.linear on the plain weight) a start-up probe found
faster at the step's row count. Anything else (CUDA, float32, no kernels) gets
F.linear on the plain weight.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

from gateeng.plans.kernel_names import ROWWISE_MATMULS

# Row counts the probe compares the two kernels at (decode batches, then prefill chunks).
PROBE_ROWS = (1, 8, 32, 128, 512)




def _onednn_bf16() -> bool:
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
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not _onednn_bf16():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)

        def onednn(x):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
        return onednn if _agrees(onednn, w) else None
    except (RuntimeError, AttributeError):
        return None


def rowwise_kernel(kernels) -> Optional[str]:
    """The row-invariant matmul these kernels have on this CPU, by its kernel_plan
    name, or None."""
    if kernels is None:
        return None
    return next((name for name, m in ROWWISE_MATMULS.items() if getattr(kernels, m.symbol, False)), None)


def pack_rowwise(w: torch.Tensor, kernels):
    """A function x -> x @ w.T on w packed for the row-invariant kernel
    (rowwise_kernel), or None where there is none or it does not apply."""
    name = rowwise_kernel(kernels)
    if name is None or w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2:
        return None
    if name == "cpu_dpbf16" and w.shape[1] % 2:
        return None   # VDPBF16PS takes K in pairs
    symbol, n = ROWWISE_MATMULS[name].symbol, w.shape[0]
    packed, linear = getattr(kernels, "pack_" + symbol)(w.detach()), getattr(kernels, "linear_" + symbol)

    def rowwise(x):
        return linear(x, packed, n)
    return rowwise if _agrees(rowwise, w) else None


def _best_seconds(fn, x, repeats: int = 5) -> float:
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return best


def rowwise_max_rows(rowwise, other, k: int) -> Optional[int]:
    """The largest probed row count up to which the row-invariant kernel is not
    slower than `other` (within 5%) at every probed count; None when that holds at
    all of them (`other` is then never needed). Timed on one weight, alternating."""
    for rows in PROBE_ROWS:
        x = torch.randn(rows, k).to(torch.bfloat16)
        if _best_seconds(rowwise, x) > 1.05 * _best_seconds(other, x):
            smaller = [r for r in PROBE_ROWS if r < rows]
            return smaller[-1] if smaller else 0
    return None


def fast_linear(rowwise, other, max_rows: Optional[int]):
    """x -> x @ w.T by whichever kernel the probe found faster at x's row count."""
    if rowwise is None or other is None:
        return rowwise or other
    if max_rows is None:
        return rowwise
    if max_rows == 0:
        return other
    return lambda x: rowwise(x) if x.shape[0] <= max_rows else other(x)
