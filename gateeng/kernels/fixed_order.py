"""Plain-torch kernels with a fixed reduction order, used by the CPU invariant plan.

Invariance comes from shapes: every function here is called on tensors whose
shapes do not depend on the batch (the plan pads rows to a fixed count), and torch
CPU kernels are run-to-run deterministic at a fixed shape and thread count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_M32 = 0xFFFFFFFF


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T. Invariant only when x has a fixed row count (the plan's job)."""
    return F.linear(x, w)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-row RMSNorm in float32 (the Llama/HF convention), cast back to x's dtype."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, for gate and up stacked on the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention (transformers' Llama): x [R, H, D],
    cos and sin [R, 1, D] for the rows' positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# Keys gathered at once per row (bounds the float32 copies of K and V: about
# 1.5 KB per key for Hkv * D = 192).
SPLIT_BATCH_KEYS = 1 << 15


def split_attention(q, k_cache, v_cache, block_tables, positions, split: int, scale: float):
    """Causal attention over a paged KV cache with key splits at fixed absolute positions.

    q: [R, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [R, W] (block ids per row); positions: [R] (absolute query positions).
    Row r attends keys 0..positions[r]. Keys are split at multiples of `split`; each
    split's partial softmax (max, sum, weighted V) is computed at shape [R, split]
    and merged in split order, so a row's bits depend only on its own keys and
    position, never on how many splits the batch needed. The plan calls it on a
    fixed number of rows R. Masked keys contribute exact zeros. Arithmetic in
    float32. The splits' partials are computed by one batched matmul pair (their
    count only changes the batch dimension, never a row's reduction), and K and V
    are gathered and converted in one copy laid out for those matmuls.
    """
    R, H, D = q.shape
    nb, bs, Hkv, _ = k_cache.shape
    G = H // Hkv
    bps = split // bs
    width = block_tables.shape[1]
    kflat = k_cache.view(nb * bs, Hkv, D)
    vflat = v_cache.view(nb * bs, Hkv, D)
    dev = q.device
    qf = (q.float() * scale).view(R * Hkv, G, D)
    m = torch.full((R, Hkv, G, 1), float("-inf"), device=dev)
    l = torch.zeros((R, Hkv, G, 1), device=dev)
    acc = torch.zeros((R, Hkv, G, D), device=dev)
    in_block = torch.arange(bs, device=dev)
    zero = torch.zeros((), device=dev)
    n_splits = int(positions.max()) // split + 1
    per_gather = max(1, SPLIT_BATCH_KEYS // (R * split))

    def gather(flat_cache, slots, ns):
        x = flat_cache.index_select(0, slots).view(R, ns * split, Hkv, D).transpose(1, 2)
        out = torch.empty(R, Hkv, ns * split, D, dtype=torch.float32, device=dev)
        return out.copy_(x).view(R * Hkv, ns, split, D)   # one copy: gather layout and dtype

    for j0 in range(0, n_splits, per_gather):
        ns = min(per_gather, n_splits - j0)
        cols = torch.arange(j0 * bps, (j0 + ns) * bps, device=dev).clamp(max=width - 1)
        slots = (block_tables[:, cols, None] * bs + in_block).reshape(-1)
        k, v = gather(kflat, slots, ns), gather(vflat, slots, ns)              # [R*Hkv, ns, S, D]
        # Each split's partials at once: one [G, D] x [D, S] and one [G, S] x [S, D]
        # product per (row, head, split), reductions over the split's S keys only.
        keys = torch.arange(j0 * split, (j0 + ns) * split, device=dev).view(ns, split)
        valid = keys[None] <= positions[:, None, None]                           # [R, ns, S]
        qs = qf[:, None].expand(R * Hkv, ns, G, D).reshape(R * Hkv * ns, G, D)
        s = torch.bmm(qs, k.view(R * Hkv * ns, split, D).transpose(1, 2)).view(R, Hkv, ns, G, split)
        s = s.masked_fill(~valid[:, None, :, None, :], float("-inf"))
        active = (positions[:, None] >= keys[None, :, 0])[:, None, :, None, None]   # [R, 1, ns, 1, 1]
        m_s = torch.where(active, s.amax(-1, keepdim=True), zero)
        p = torch.exp(s - m_s)
        l_s = p.sum(-1, keepdim=True)
        o_s = torch.bmm(p.view(R * Hkv * ns, G, split), v.view(R * Hkv * ns, split, D)).view(R, Hkv, ns, G, D)
        for jj in range(ns):   # merge in split order
            m_j, act = m_s[:, :, jj], active[:, :, jj]
            m_new = torch.maximum(m, m_j)
            a, b = torch.exp(m - m_new), torch.exp(m_j - m_new)
            m = torch.where(act, m_new, m)
            l = torch.where(act, l * a + l_s[:, :, jj] * b, l)
            acc = torch.where(act, acc * a + o_s[:, :, jj] * b, acc)
    return (acc / l).view(R, H, D).to(q.dtype)


def attention_float64(q, k, v, positions, scale: float):
    """Dense float64 causal attention for one sequence, the ground truth in tests.

    q: [R, H, D] at absolute `positions`; k, v: [L, Hkv, D] for positions 0..L-1.
    """
    H, Hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(H // Hkv, dim=1)
    v = v.double().repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("rhd,lhd->rhl", q.double() * scale, k)
    mask = torch.arange(k.shape[0], device=positions.device)[None, :] <= positions[:, None]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("rhl,lhd->rhd", torch.softmax(s, -1), v)


# ---- seeded sampling ---------------------------------------------------------
# The Gumbel noise for (seed, position, vocab id) comes from a 32-bit integer hash
# (Wellons' lowbias32), written so Triton's uint32 arithmetic gives the same bits.

def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> int:
    """32-bit key of one sampling row; the same on CPU and in the Triton kernel."""
    s = _mix32_int(((seed & _M32) ^ _mix32_int((seed >> 32) & _M32)) & _M32)
    return _mix32_int(s ^ (position & _M32))


def uniform_bits(key: int, vocab_size: int) -> torch.Tensor:
    """24 random bits per vocab id, as int64 in [0, 2^24)."""
    ids = torch.arange(vocab_size, dtype=torch.int64)
    return _mix32(((ids * 0x9E3779B1) & _M32) ^ key) >> 8


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise for one row, float32 [vocab]. Always computed at shape
    [vocab] so its bits never depend on the batch."""
    u = (uniform_bits(row_key(seed, position), vocab_size).double() + 0.5) * 2.0 ** -24
    return (-torch.log(-torch.log(u))).float()


def argmax_margin(scores: torch.Tensor):
    """Token (lowest id among ties) and top-1 minus top-2, over the last dim, float32."""
    scores = scores.float()
    top2 = torch.topk(scores, 2, dim=-1).values
    return torch.argmax(scores, dim=-1), top2[..., 0] - top2[..., 1]
