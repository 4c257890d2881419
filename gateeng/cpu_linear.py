"""x @ w.T on CPU bf16 weights packed once at load, in two layouts.

- oneDNN's (`pack`): a plain bf16 weight is re-laid out for the matrix unit on
  every call, so packing it at load makes the SmolLM2 lm_head at 32 rows 2-3x
  faster on AVX-512 BF16 and AMX CPUs. Its kernel and blocking depend on the row
  count, so a row's bits do too: the invariant plan calls it only on groups of
  exactly its row count.
- VDPBF16PS's (`pack_dpbf16`, kernels/cpu_ops.cpp, CPUs with AVX-512 BF16): a
  row's bits do not depend on the row count at all, so the invariant plan calls
  it on its real rows, unpadded. On a 2-core AVX-512 BF16 EPYC it is also the
  faster of the two at every row count from 1 to 512 (bench/RESULTS.md).

`fast_linear` gives the fast plan, per weight, whichever of the two a start-up
probe found faster at the step's row count. Anything else (CUDA, float32, a
torch without oneDNN bf16, no kernels) gets F.linear on the plain weight.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

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


def pack_dpbf16(w: torch.Tensor, kernels):
    """A function x -> x @ w.T on w packed for the VDPBF16PS kernel (row-invariant at
    any row count), or None where that kernel is missing or does not apply."""
    if (kernels is None or not getattr(kernels, "dpbf16", False) or w.device.type != "cpu"
            or w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] % 2):
        return None
    packed, n = kernels.pack_dpbf16(w.detach()), w.shape[0]

    def dpbf16(x):
        return kernels.linear_dpbf16(x, packed, n)
    return dpbf16 if _agrees(dpbf16, w) else None


def _best_seconds(fn, x, repeats: int = 5) -> float:
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return best


def dpbf16_max_rows(dpbf16, onednn, k: int) -> Optional[int]:
    """The largest probed row count up to which the dpbf16 kernel is not slower than
    oneDNN (within 5%) at every probed count; None when that holds at all of them
    (the oneDNN copy is then never needed). Timed on one weight, alternating."""
    for rows in PROBE_ROWS:
        x = torch.randn(rows, k).to(torch.bfloat16)
        if _best_seconds(dpbf16, x) > 1.05 * _best_seconds(onednn, x):
            smaller = [r for r in PROBE_ROWS if r < rows]
            return smaller[-1] if smaller else 0
    return None


def fast_linear(dpbf16, onednn, max_rows: Optional[int]):
    """x -> x @ w.T by whichever kernel the probe found faster at x's row count."""
    if dpbf16 is None or onednn is None:
        return dpbf16 or onednn
    if max_rows is None:
        return dpbf16
    if max_rows == 0:
        return onednn
    return lambda x: dpbf16(x) if x.shape[0] <= max_rows else onednn(x)
