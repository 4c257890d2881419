"""Argmax / seeded-Gumbel sampling with the top-1/top-2 margin, one row per program.

Reduction order: the vocabulary is scanned in fixed BLOCK chunks from id 0
upwards, carrying (top-1 score, its id, top-2 score); ties keep the lower id and
make the margin 0. The Gumbel noise uses the same 32-bit hash as
kernels.fixed_order (row key from (seed, position), mixed with the vocab id), so a
seed means the same thing on CPU and GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gateeng.kernels.fixed_order import row_key

BLOCK = 1024


@triton.jit
def mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(logits_ptr, keys_ptr, inv_temp_ptr, tok_ptr, margin_ptr, V, stride,
                   SEEDED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    inv_t = tl.load(inv_temp_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    t1 = -float("inf")
    t2 = -float("inf")
    i1 = 0
    for off in range(0, V, BLOCK):
        ids = off + tl.arange(0, BLOCK)
        mask = ids < V
        s = tl.load(logits_ptr + row * stride + ids, mask=mask, other=-float("inf")).to(tl.float32)
        if SEEDED:
            h = mix32((ids.to(tl.uint32) * 0x9E3779B1) ^ key)
            u = ((h >> 8).to(tl.float64) + 0.5) * (1.0 / 16777216.0)
            g = (-tl.log(-tl.log(u))).to(tl.float32)
            s = tl.where(mask, s * inv_t + g, -float("inf"))
        c1 = tl.max(s, axis=0)
        ci = tl.argmax(s, axis=0, tie_break_left=True)
        c2 = tl.max(tl.where(tl.arange(0, BLOCK) == ci, -float("inf"), s), axis=0)
        better = c1 > t1
        tie = c1 == t1
        new_t2 = tl.where(better, tl.maximum(t1, c2), tl.where(tie, t1, tl.maximum(t2, c1)))
        i1 = tl.where(better, off + ci, i1)
        t1 = tl.where(better, c1, t1)
        t2 = new_t2
    tl.store(tok_ptr + row, i1)
    tl.store(margin_ptr + row, t1 - t2)


def sample(logits: torch.Tensor, temperatures: list, seeds: list, positions: list):
    """logits [R, V] float32. temperature 0 = greedy argmax of the logits; > 0 =
    argmax of logits / T + Gumbel(seed, position). Returns (tokens int64 [R], margins fp32 [R])."""
    R, V = logits.shape
    seeded = any(t > 0 for t in temperatures)
    if seeded and not all(t > 0 for t in temperatures):
        raise ValueError("call greedy and sampled rows separately")
    dev = logits.device
    inv_t = torch.tensor([1.0 / t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32, device=dev)
    keys = torch.tensor([row_key(s, p) for s, p in zip(seeds, positions)], dtype=torch.int64, device=dev)
    tok = torch.empty(R, dtype=torch.int32, device=dev)
    margin = torch.empty(R, dtype=torch.float32, device=dev)
    _sample_kernel[(R,)](logits, keys, inv_t, tok, margin, V, logits.stride(0), SEEDED=seeded, BLOCK=BLOCK)
    return tok.long(), margin
