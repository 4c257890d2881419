"""Batch-invariant matmul: y = x @ w.T (+ bias), a persistent Triton kernel.

Reduction order: each program walks output tiles (tile = pid, pid + P, ...); a
tile reduces the whole K dimension itself, in BLOCK_K steps from k = 0 upwards,
into one fp32 accumulator. No split-K, no stream-K, no autotuning: the tile shape
is fixed per dtype. So an output element's bits depend only on its row of x and
its column of w, never on M or on which program computed the tile.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Under TRITON_INTERPRET (CPU tests) tl.dot is numpy BLAS: it mishandles bf16 and its
# result for a row depends on the row's place in the tile. The kernel then reduces
# with an explicit fp32 product-and-sum instead; on a GPU it uses tl.dot (MMA).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) per dtype; fixed, never autotuned.
CONFIGS = {
    torch.bfloat16: (64, 128, 64, 4),
    torch.float16: (64, 128, 64, 4),
    torch.float32: (32, 64, 32, 4),
}


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                   stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, NUM_PROGS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * num_n
    for tile in range(pid, num_tiles, NUM_PROGS):
        offs_m = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            b = tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
            if INTERPRET:
                # Interpreter: an explicit product-and-sum over k, the same order for every
                # element (numpy's BLAS would round by the row's place in the tile).
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            elif IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _num_programs(device: torch.device, tiles: int) -> int:
    if device.type == "cuda":
        return min(tiles, torch.cuda.get_device_properties(device).multi_processor_count)
    return min(tiles, 4)   # TRITON_INTERPRET on CPU: few programs keep the tests short


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] (nn.Linear layout) -> [M, N] in x's dtype."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    bm, bn, bk, warps = CONFIGS[x.dtype]
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    progs = _num_programs(x.device, tiles)
    _matmul_kernel[(progs,)](
        x, w, out, bias if bias is not None else out, M, N, K,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, INTERPRET=_INTERPRET, NUM_PROGS=progs,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return out
