"""Causal attention over the paged KV cache with a fixed split size (prefill and decode).

One program per (query row, head). Row r attends keys 0..positions[r], read
through its block table. Keys are split at fixed absolute positions (multiples of
SPLIT, a multiple of the page size); for each split the program computes the
partial softmax (max, sum, weighted V) in fp32 and merges it into the running
result, splits in increasing order. Nothing depends on the other rows, on how
many queries of the sequence run together, or on which physical pages hold the
keys (a cached prefix and a recomputed one give the same bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_attention_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, o_ptr, scale,
                            stride_qr, stride_qh, stride_kb, stride_ks, stride_kh,
                            stride_bt, stride_or, stride_oh,
                            GROUP: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    pos = tl.load(pos_ptr + r)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + d).to(tl.float32) * scale
    m = -float("inf")
    l = 0.0
    acc = tl.zeros((D,), dtype=tl.float32)
    for j in range(0, pos // SPLIT + 1):
        kpos = j * SPLIT + tl.arange(0, SPLIT)
        valid = kpos <= pos
        page = tl.load(bt_ptr + r * stride_bt + kpos // PAGE, mask=valid, other=0)
        base = page.to(tl.int64) * stride_kb + (kpos % PAGE) * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1), -float("inf"))
        m_j = tl.max(s, axis=0)
        p = tl.exp(s - m_j)
        l_j = tl.sum(p, axis=0)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        o_j = tl.sum(p[:, None] * v, axis=0)
        m_new = tl.maximum(m, m_j)
        a = tl.exp(m - m_new)
        b = tl.exp(m_j - m_new)
        l = l * a + l_j * b
        acc = acc * a + o_j * b
        m = m_new
    tl.store(o_ptr + r * stride_or + h * stride_oh + d, (acc / l).to(o_ptr.dtype.element_ty))


def split_attention(q, k_cache, v_cache, block_tables, positions, split: int, scale: float):
    """Same contract as kernels.fixed_order.split_attention. q: [R, H, D];
    caches [num_blocks, page, Hkv, D]; block_tables [R, W] int; positions [R] int."""
    R, H, D = q.shape
    _, page, hkv, _ = k_cache.shape
    assert split % page == 0 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(q)
    bt = block_tables.to(torch.int32).contiguous()
    pos = positions.to(torch.int32).contiguous()
    _split_attention_kernel[(R, H)](
        q, k_cache, v_cache, bt, pos, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        bt.stride(0), out.stride(0), out.stride(1),
        GROUP=H // hkv, PAGE=page, SPLIT=split, D=D)
    return out
