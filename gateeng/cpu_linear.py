"""x @ w.T with the weight packed once into oneDNN's layout (CPU, bfloat16).

A plain bf16 weight is re-laid out for the matrix unit on every call; packing it
at load time makes the SmolLM2 lm_head at 32 rows 2-3x faster on AVX-512 BF16 and
AMX CPUs. The fast plan calls it at any row count; the invariant plan only on
groups of exactly its row count, so oneDNN always runs the same kernel for it.
Anything else (CUDA, float32, a torch without oneDNN bf16) gets F.linear on the
plain weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_bf16() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):
        return False


def pack(w: torch.Tensor, rows_hint: int = 32):
    """A function x -> x @ w.T (x: [rows, in]) on oneDNN's packed copy of w, or None
    where w cannot be packed here (not a CPU bf16 weight, no oneDNN bf16, or the
    packed product disagrees with F.linear on a probe)."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not _onednn_bf16():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)
        probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        want = F.linear(probe, w).float()
        if not torch.allclose(got.float(), want, rtol=2 ** -6, atol=1e-2 * float(want.abs().max()) + 1e-6):
            return None
    except (RuntimeError, AttributeError):
        return None

    def fast(x):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
    return fast
