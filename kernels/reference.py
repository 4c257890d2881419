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


def split_attention(q, k_cache, v_cache, block_tables, positions, split: int, scale: float):
    """Causal attention over a paged KV cache with key splits at fixed absolute positions.

    q: [R, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [R, W] (block ids per row); positions: [R] (absolute query positions).
    Row r attends keys 0..positions[r]. Keys are split at multiples of `split`; each
    split's partial softmax (max, sum, weighted V) is computed at shape [R, split]
    and merged in split order, so a row's bits depend only on its own keys and
    position, never on other rows or on how many splits the batch needed. Masked
    keys contribute exact zeros. Arithmetic in float32.
    """
    R, H, D = q.shape
    nb, bs, Hkv, _ = k_cache.shape
    G = H // Hkv
    bps = split // bs
    width = block_tables.shape[1]
    kflat = k_cache.view(nb * bs, Hkv, D)
    vflat = v_cache.view(nb * bs, Hkv, D)
    dev = q.device
    qf = (q.float() * scale).view(R, Hkv, G, D)
    m = torch.full((R, Hkv, G, 1), float("-inf"), device=dev)
    l = torch.zeros((R, Hkv, G, 1), device=dev)
    acc = torch.zeros((R, Hkv, G, D), device=dev)
    in_block = torch.arange(bs, device=dev)
    key_off = torch.arange(split, device=dev)
    zero = torch.zeros((), device=dev)
    n_splits = int(positions.max()) // split + 1
    for j in range(n_splits):
        cols = torch.arange(j * bps, (j + 1) * bps, device=dev).clamp(max=width - 1)
        slots = (block_tables[:, cols, None] * bs + in_block).view(R, split)
        valid = (j * split + key_off)[None, :] <= positions[:, None]          # [R, split]
        flat = slots.view(-1)   # index_select: the same gather as kflat[slots], far cheaper on CPU
        k = kflat.index_select(0, flat).view(R, split, Hkv, D).float().permute(0, 2, 3, 1)   # [R, Hkv, D, S]
        v = vflat.index_select(0, flat).view(R, split, Hkv, D).float().permute(0, 2, 1, 3)   # [R, Hkv, S, D]
        s = torch.matmul(qf, k).masked_fill(~valid[:, None, None, :], float("-inf"))
        active = (positions >= j * split)[:, None, None, None]                  # row has keys here
        m_j = torch.where(active, s.amax(-1, keepdim=True), zero)
        p = torch.exp(s - m_j)
        l_j = p.sum(-1, keepdim=True)
        o_j = torch.matmul(p, v)
        m_new = torch.maximum(m, m_j)
        a, b = torch.exp(m - m_new), torch.exp(m_j - m_new)
        m = torch.where(active, m_new, m)
        l = torch.where(active, l * a + l_j * b, l)
        acc = torch.where(active, acc * a + o_j * b, acc)
    return (acc / l).view(R, H, D).to(q.dtype)


def attention_float64(q, k, v, positions, scale: float):
    """Dense float64 causal attention for one sequence, the ground truth in tests.

    q: [R, H, D] at absolute `positions`; k, v: [L, Hkv, D] for positions 0..L-1.
    """
    H, Hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(H // Hkv, dim=1)
    v = v.double().repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("rhd,lhd->rhl", q.double() * scale, k)
    mask = torch.arange(k.shape[0])[None, :] <= positions[:, None]
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
