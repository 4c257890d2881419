"""The reference (gateeng-ref-1, kernels/SPEC.md) in Triton: the same operations as
kernels/ref_ops.cpp, in the same order, for the GPU.

Every kernel keeps the spec's rules: a fused multiply-add (tl.fma) only on two bf16
values, every other product and sum separate (launched with enable_fp_fusion=False,
so the compiler fuses nothing), division and square root correctly rounded
(tl.div_rn, tl.sqrt_rn), the spec's own exp and log, bf16 rounding on the bits, and
denormals flushed after every operation (`_flush`), since a GPU's flush mode is not
the CPU's. No tensor-core MMA: a dot product is the spec's 16 block chains. Under
TRITON_INTERPRET=1 (CPU tests) tl.fma is an exact fused multiply-add too, so
tests/test_triton_reference.py holds these kernels to ref_ops.cpp bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gateeng.kernels.triton_sampling import mix32   # the spec's lowbias32 hash

TINY = 1.1754943508222875e-38   # 2^-126: below it a binary32 value is flushed to zero
OPTIONS = dict(enable_fp_fusion=False)
# The dot's blocks of K (SPEC.md, "dot"), as ref_ops.cpp and plans/tp_shapes.py
# name it (tests/test_one_owner.py holds them equal); _fold and _tree16 are written
# for it. A constexpr, so the kernels may read it.
DOT_BLOCKS = tl.constexpr(16)


@triton.jit
def _flush(x):
    return tl.where(tl.abs(x) < 1.1754943508222875e-38, x * 0.0, x)


@triton.jit
def _bf(bits):
    """bf16 bits (int16) -> binary32, read as the spec reads inputs (flushed)."""
    return _flush((bits.to(tl.uint16).to(tl.uint32) << 16).to(tl.float32, bitcast=True))


@triton.jit
def _to_bf(x):
    """binary32 -> bf16 bits (int16), round to nearest even; NaN stays NaN."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (u >> 16) | 0x40, rounded).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _fold(l: tl.constexpr, acc, lv0, lv1, lv2, lv3):
    """The pairwise tree, one block result at a time (block l): lvI holds the finished
    subtree of 2^I blocks waiting for its right neighbour. Returns the levels and,
    after block 15, the sum (else acc unchanged)."""
    if l % 2 == 0:
        lv0 = acc
    else:
        t = _flush(lv0 + acc)
        if l % 4 == 1:
            lv1 = t
        else:
            t = _flush(lv1 + t)
            if l % 8 == 3:
                lv2 = t
            else:
                t = _flush(lv2 + t)
                if l % 16 == 7:
                    lv3 = t
                else:
                    acc = _flush(lv3 + t)
    return acc, lv0, lv1, lv2, lv3


@triton.jit
def _tree16(v):
    """tree() over a [16] tensor: neighbours pairwise, level by level."""
    a, b = tl.split(tl.reshape(v, (8, 2)))
    v = _flush(a + b)
    a, b = tl.split(tl.reshape(v, (4, 2)))
    v = _flush(a + b)
    a, b = tl.split(tl.reshape(v, (2, 2)))
    v = _flush(a + b)
    a, b = tl.split(tl.reshape(v, (1, 2)))
    return tl.reshape(_flush(a + b), ())


@triton.jit
def _exp(x):
    xc = tl.minimum(tl.maximum(x, -86.0), 88.0)
    t = _flush(xc * 1.44269504088896341)
    k = _flush(_flush(t + 12582912.0) - 12582912.0)
    r = _flush(xc - _flush(k * 0.693359375))
    r = _flush(r - _flush(k * -2.12194440e-4))
    p = r * 0.0 + 1.9875691500e-4
    p = _flush(_flush(p * r) + 1.3981999507e-3)
    p = _flush(_flush(p * r) + 8.3334519073e-3)
    p = _flush(_flush(p * r) + 4.1665795894e-2)
    p = _flush(_flush(p * r) + 1.6666665459e-1)
    p = _flush(_flush(p * r) + 5.0000001201e-1)
    y = _flush(p * _flush(r * r))
    y = _flush(y + r)
    y = _flush(y + 1.0)
    scale = ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    out = _flush(y * scale)
    out = tl.where(x > 88.0, float("inf"), out)
    out = tl.where(x < -86.0, 0.0, out)
    return tl.where(x != x, x, out)


@triton.jit
def _log(x):
    ok = x > 0.0
    u = tl.where(ok, x, 1.0).to(tl.uint32, bitcast=True)
    e = ((u >> 23) & 0xFF).to(tl.int32) - 126
    m = ((u & 0x807FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)
    small = m < 0.707106781186547524
    e = tl.where(small, e - 1, e)
    m = tl.where(small, _flush(_flush(m + m) - 1.0), _flush(m - 1.0))
    z = _flush(m * m)
    y = m * 0.0 + 7.0376836292e-2
    y = _flush(_flush(y * m) - 1.1514610310e-1)
    y = _flush(_flush(y * m) + 1.1676998740e-1)
    y = _flush(_flush(y * m) - 1.2420140846e-1)
    y = _flush(_flush(y * m) + 1.4249322787e-1)
    y = _flush(_flush(y * m) - 1.6668057665e-1)
    y = _flush(_flush(y * m) + 2.0000714765e-1)
    y = _flush(_flush(y * m) - 2.4999993993e-1)
    y = _flush(_flush(y * m) + 3.3333331174e-1)
    y = _flush(_flush(y * m) * z)
    fe = e.to(tl.float32)
    y = _flush(y + _flush(fe * -2.12194440e-4))
    y = _flush(y + _flush(-0.5 * z))
    out = _flush(m + y)
    out = _flush(out + _flush(fe * 0.693359375))
    out = tl.where(x == float("inf"), float("inf"), out)
    out = tl.where(x == 0.0, -float("inf"), out)
    return tl.where((x < 0.0) | (x != x), float("nan"), out)


# ---- the matmul -------------------------------------------------------------------

@triton.jit
def _store_out(out_ptr, acc, rows, cols, rmask, cmask, N, F32: tl.constexpr):
    """A matmul tile's binary32 sums into out [M, N]: as they are (F32), else rounded to bf16."""
    where = out_ptr + rows[:, None] * N + cols[None, :]
    mask = rmask[:, None] & cmask[None, :]
    if F32:
        tl.store(where, acc, mask=mask)
    else:
        tl.store(where, _to_bf(acc), mask=mask)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """out[m, n] = dot(x[m], w[n]): per output one lane, its 16 block chains in order,
    each pair's odd element first, folded by the tree."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < N
    pairs = K // 2
    per = (pairs + DOT_BLOCKS - 1) // DOT_BLOCKS
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    lv0, lv1, lv2, lv3 = zero, zero, zero, zero
    acc = zero
    for l in tl.static_range(DOT_BLOCKS):
        acc = zero
        for p in range(l * per, tl.minimum(pairs, (l + 1) * per)):
            xo = _bf(tl.load(x_ptr + rows * K + 2 * p + 1, mask=rmask, other=0))
            wo = _bf(tl.load(w_ptr + cols * K + 2 * p + 1, mask=cmask, other=0))
            acc = _flush(tl.fma(xo[:, None], wo[None, :], acc))
            xe = _bf(tl.load(x_ptr + rows * K + 2 * p, mask=rmask, other=0))
            we = _bf(tl.load(w_ptr + cols * K + 2 * p, mask=cmask, other=0))
            acc = _flush(tl.fma(xe[:, None], we[None, :], acc))
        acc, lv0, lv1, lv2, lv3 = _fold(l, acc, lv0, lv1, lv2, lv3)
    _store_out(out_ptr, acc, rows, cols, rmask, cmask, N, F32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def matmul(x: torch.Tensor, w: torch.Tensor, f32: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T, bf16 in (K even): bf16 out, or the binary32 sums (f32)."""
    assert x.dtype == w.dtype == torch.bfloat16 and x.shape[1] == w.shape[1] and x.shape[1] % 2 == 0
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32 if f32 else torch.bfloat16, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 32))
    _matmul_kernel[grid](_bits(x), _bits(w), out if f32 else out.view(torch.int16), m, n, k, F32=f32,
                         BM=16, BN=32, **OPTIONS)
    return out


@triton.jit
def _qscale(d_ptr, m_ptr, sc_ptr, mn_ptr, cols, cmask, nb, g, ns, sj, MIN: tl.constexpr, KQ: tl.constexpr):
    """Columns' scale and minimum of sub-block sj (of block g): d and m; a K-quant's
    D = d*sc and M = dmin*mn, one binary32 multiply each (exact)."""
    d = _flush(tl.load(d_ptr + cols * nb + g, mask=cmask, other=0).to(tl.float32))
    mn = d
    if MIN:
        mn = _flush(tl.load(m_ptr + cols * nb + g, mask=cmask, other=0).to(tl.float32))
    if KQ:
        d = _flush(d * tl.load(sc_ptr + cols * ns + sj, mask=cmask, other=0).to(tl.float32))
        if MIN:
            mn = _flush(mn * tl.load(mn_ptr + cols * ns + sj, mask=cmask, other=0).to(tl.float32))
    return d, mn


@triton.jit
def _qmatmul_kernel(x_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, out_ptr, M, N, K, MIN: tl.constexpr,
                    KQ: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, F32: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    """out[m, n] = qdot(x[m], W[n]) of a quantized W (SPEC.md, "Quantized weights"): per
    sub-block of SUB values the chain on the integers, odd element first, then c = d*s
    (MIN: plus m*t, t the sub-block's plain sum of x); a K-quant (KQ): c = D*s (MIN:
    minus M*t); 16 lanes of whole blocks of BLOCK values (32; a K-quant's super-block:
    256), each a chain of adds of their sub-blocks' c from +0, folded by the tree."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rmask, cmask = rows < M, cols < N
    nb, ns = K // BLOCK, K // SUB
    per = (nb + DOT_BLOCKS - 1) // DOT_BLOCKS
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    lv0, lv1, lv2, lv3 = zero, zero, zero, zero
    acc = zero
    for l in tl.static_range(DOT_BLOCKS):
        acc = zero
        for g in range(l * per, tl.minimum(nb, (l + 1) * per)):
            for j in range(BLOCK // SUB):
                s = zero
                t = tl.zeros((BM,), dtype=tl.float32)
                for p in range(SUB // 2):
                    i = BLOCK * g + SUB * j + 2 * p
                    xo = _bf(tl.load(x_ptr + rows * K + i + 1, mask=rmask, other=0))
                    qo = tl.load(q_ptr + cols * K + i + 1, mask=cmask, other=0).to(tl.float32)
                    s = _flush(tl.fma(xo[:, None], qo[None, :], s))
                    xe = _bf(tl.load(x_ptr + rows * K + i, mask=rmask, other=0))
                    qe = tl.load(q_ptr + cols * K + i, mask=cmask, other=0).to(tl.float32)
                    s = _flush(tl.fma(xe[:, None], qe[None, :], s))
                    if MIN:
                        t = _flush(t + xo)
                        t = _flush(t + xe)
                d, mn = _qscale(d_ptr, m_ptr, sc_ptr, mn_ptr, cols, cmask, nb, g, ns, g * (BLOCK // SUB) + j,
                                MIN, KQ)
                c = _flush(d[None, :] * s)
                if MIN:
                    mt = _flush(mn[None, :] * t[:, None])
                    c = _flush(c - mt) if KQ else _flush(c + mt)
                acc = _flush(acc + c)
        acc, lv0, lv1, lv2, lv3 = _fold(l, acc, lv0, lv1, lv2, lv3)
    _store_out(out_ptr, acc, rows, cols, rmask, cmask, N, F32)


def _quant_args(q: torch.Tensor, d: torch.Tensor, m, sc, mn) -> tuple:
    """A quantized weight's tensors as the kernels take them, and its constexprs (MIN,
    KQ, BLOCK, SUB); see qmatmul."""
    n, k = q.shape
    kq = sc is not None
    block = 256 if kq else 32
    sub = k // sc.shape[1] if kq else 32
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and k % block == 0 and d.shape == (n, k // block)
    assert m is None or (m.dtype == torch.float16 and m.shape == d.shape)
    assert not kq or (sub in (16, 32) and sc.shape == (n, k // sub) and sc.dtype == torch.int8)
    assert (mn is None) == (not kq or m is None) and (mn is None or (mn.shape == sc.shape and mn.dtype == torch.int8))
    d = d.contiguous()
    sc = sc.contiguous() if kq else d
    tensors = (q.contiguous(), d, d if m is None else m.contiguous(), sc, sc if mn is None else mn.contiguous())
    return tensors, dict(MIN=m is not None, KQ=kq, BLOCK=block, SUB=sub)


def qmatmul(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m=None, f32: bool = False, sc=None,
            mn=None) -> torch.Tensor:
    """x [M, K] (bf16) @ W.T for a quantized W [N, K]: q int8 [N, K], the integers (Q4_0's
    n - 8, Q6_K's n - 32); Q8_0, Q4_0, Q4_1 (K a multiple of 32): d float16 [N, K/32]
    the block scales, m float16 [N, K/32] the Q4_1 minimums, or None; a K-quant (K a
    multiple of 256): d and m float16 [N, K/256] each super-block's d and dmin (Q6_K: m
    None), sc int8 [N, K/S] each sub-block's scale (S = 32, Q6_K's 16) and mn int8
    [N, K/S] its minimum (Q6_K: None). bf16 out, or the binary32 qdots (f32)."""
    mm, k = x.shape
    n = q.shape[0]
    assert x.dtype == torch.bfloat16 and q.shape == (n, k)
    tensors, kinds = _quant_args(q, d, m, sc, mn)
    out = torch.empty(mm, n, dtype=torch.float32 if f32 else torch.bfloat16, device=x.device)
    grid = (triton.cdiv(mm, 16), triton.cdiv(n, 32))
    _qmatmul_kernel[grid](_bits(x), *tensors, out if f32 else out.view(torch.int16), mm, n, k, F32=f32,
                          BM=16, BN=32, **kinds, **OPTIONS)
    return out


@triton.jit
def _qrows_kernel(ids_ptr, q_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, out_ptr, K, MIN: tl.constexpr, KQ: tl.constexpr,
                  BLOCK: tl.constexpr, SUB: tl.constexpr, WIDTH: tl.constexpr):
    """One embedding row of a quantized table: bf16(d*q), or bf16((d*q) + m) (MIN); a
    K-quant's bf16(D*q), or bf16((D*q) - M)."""
    row = tl.program_id(0)
    src = tl.load(ids_ptr + row).to(tl.int64)
    offs = tl.program_id(1) * WIDTH + tl.arange(0, WIDTH)
    mask = offs < K
    q = tl.load(q_ptr + src * K + offs, mask=mask, other=0).to(tl.float32)
    d, mn = _qscale(d_ptr, m_ptr, sc_ptr, mn_ptr, src, mask, K // BLOCK, offs // BLOCK, K // SUB, offs // SUB,
                    MIN, KQ)
    v = _flush(d * q)   # exact: 18 x 8 significant bits at most
    if MIN:
        v = _flush(v - mn) if KQ else _flush(v + mn)
    tl.store(out_ptr + row * K + offs, _to_bf(v), mask=mask)


def qrows(q: torch.Tensor, d: torch.Tensor, m, ids: torch.Tensor, sc=None, mn=None) -> torch.Tensor:
    """The rows `ids` of a quantized table (q, d, m, sc, mn as qmatmul takes them), as
    bf16 (SPEC.md, "Embedding rows")."""
    k = q.shape[1]
    tensors, kinds = _quant_args(q, d, m, sc, mn)
    out = torch.empty(ids.shape[0], k, dtype=torch.bfloat16, device=q.device)
    _qrows_kernel[(ids.shape[0], triton.cdiv(k, 256))](ids.contiguous(), *tensors, out.view(torch.int16), k,
                                                      WIDTH=256, **kinds, **OPTIONS)
    return out


# ---- the row-wise ops -------------------------------------------------------------

@triton.jit
def _dot_row(a_ptr, b_ptr, k):
    """dot(a, b) of one row pair: lanes are the 16 blocks, each lane's chain in order
    (a block's missing pairs are not computed), then the tree."""
    lane = tl.arange(0, DOT_BLOCKS)
    pairs = (k + 1) // 2
    per = (pairs + DOT_BLOCKS - 1) // DOT_BLOCKS
    acc = tl.zeros((DOT_BLOCKS,), dtype=tl.float32)
    for j in range(0, per):
        p = lane * per + j
        live = p < pairs
        odd = live & (2 * p + 1 < k)
        ao = _bf(tl.load(a_ptr + 2 * p + 1, mask=odd, other=0))
        bo = _bf(tl.load(b_ptr + 2 * p + 1, mask=odd, other=0))
        acc = tl.where(odd, _flush(tl.fma(ao, bo, acc)), acc)
        ae = _bf(tl.load(a_ptr + 2 * p, mask=live, other=0))
        be = _bf(tl.load(b_ptr + 2 * p, mask=live, other=0))
        acc = tl.where(live, _flush(tl.fma(ae, be, acc)), acc)
    return _tree16(acc)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ms = _flush(tl.div_rn(_dot_row(x_ptr + row * H, x_ptr + row * H, H), H.to(tl.float32)))
    inv = _flush(tl.div_rn(1.0, _flush(tl.sqrt_rn(_flush(ms + eps)))))
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = _bf(tl.load(x_ptr + row * H + offs, mask=mask, other=0))
    w = _bf(tl.load(w_ptr + offs, mask=mask, other=0))
    normed = _bf(_to_bf(_flush(x * inv)))
    tl.store(out_ptr + row * H + offs, _to_bf(_flush(w * normed)), mask=mask)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // h
    _rms_norm_kernel[(rows,)](_bits(x), _bits(w), out.view(torch.int16), h, eps,
                              BLOCK=triton.next_power_of_2(h), **OPTIONS)
    return out


@triton.jit
def _silu_kernel(g_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _bf(tl.load(g_ptr + row * 2 * n + offs, mask=mask, other=0))
    up = _bf(tl.load(g_ptr + row * 2 * n + n + offs, mask=mask, other=0))
    s = _flush(tl.div_rn(x, _flush(1.0 + _exp(-x))))
    tl.store(out_ptr + row * n + offs, _to_bf(_flush(_bf(_to_bf(s)) * up)), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    _silu_kernel[(rows, triton.cdiv(n, 256))](_bits(gate_up), out.view(torch.int16), n, BLOCK=256, **OPTIONS)
    return out


@triton.jit
def _map_kernel(x_ptr, out_ptr, n, LOG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _flush(tl.load(x_ptr + offs, mask=mask, other=1.0))
    tl.store(out_ptr + offs, _log(x) if LOG else _exp(x), mask=mask)


def map_f32(x: torch.Tensor, log: bool) -> torch.Tensor:
    """The spec's exp (or log), elementwise, binary32."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _map_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), LOG=log, BLOCK=1024, **OPTIONS)
    return out


@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, b_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = _bf(tl.load(a_ptr + row * n + offs, mask=mask, other=0))
    b = _bf(tl.load(b_ptr + row * b_stride + offs, mask=mask, other=0))
    tl.store(out_ptr + row * n + offs, _to_bf(_flush(a + b)), mask=mask)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16(a + b); b [n] broadcasts over a's rows."""
    n = a.shape[-1]
    rows = a.numel() // n
    out = torch.empty_like(a)
    _add_kernel[(rows, triton.cdiv(n, 256))](_bits(a), _bits(b), out.view(torch.int16), n,
                                             0 if b.numel() == n else n, BLOCK=256, **OPTIONS)
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, width, heads_offset, out_heads, D: tl.constexpr):
    """One row and head of qkv [rows, width]: y = bf16(bf16(x cos) + bf16(rot(x) sin)),
    written to out [rows, out_heads, D]."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, D)
    src = x_ptr + row * width + (heads_offset + head) * D
    x = _bf(tl.load(src + i))
    other = _bf(tl.load(src + (i + D // 2) % D))
    rot = tl.where(i < D // 2, -other, other)
    c = _bf(tl.load(cos_ptr + row * D + i))
    s = _bf(tl.load(sin_ptr + row * D + i))
    y = _to_bf(_flush(_bf(_to_bf(_flush(x * c))) + _bf(_to_bf(_flush(rot * s)))))
    tl.store(out_ptr + (row * out_heads + head) * D + i, y)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, first: int, heads: int, d: int) -> torch.Tensor:
    """RoPE of heads first..first+heads-1 of qkv [rows, (Hq + 2 Hkv) D]: [rows, heads, D]."""
    rows = qkv.shape[0]
    out = torch.empty(rows, heads, d, dtype=qkv.dtype, device=qkv.device)
    _rope_kernel[(rows, heads)](_bits(qkv), _bits(cos), _bits(sin), out.view(torch.int16), qkv.shape[1], first,
                                heads, D=d, **OPTIONS)
    return out


# ---- attention --------------------------------------------------------------------

@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, HQ, HKV, W, BS, scale,
                      D: tl.constexpr):
    """One query row and head: chunks of 16 absolute positions; per chunk the scores
    (lanes are the keys, each lane the spec's dot), an online-softmax step and the
    value chain key by key (a multiply, then an add)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // (HQ // HKV)
    length = tl.load(lens_ptr + row)
    q_row = q_ptr + (row * HQ + head) * D
    t16 = tl.arange(0, 16)
    dd = tl.arange(0, D)
    per: tl.constexpr = (D // 2 + 15) // 16
    m = tl.full((), -float("inf"), tl.float32)
    l_sum = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((D,), dtype=tl.float32)
    for start in range(0, length, 16):
        pos = start + t16
        live = pos < length
        block = tl.load(tables_ptr + row * W + pos // BS, mask=live, other=0)
        base = ((block * BS + pos % BS) * HKV + kvh) * D   # [16] element offsets of each key
        zero = tl.zeros((16,), dtype=tl.float32)
        lv0, lv1, lv2, lv3 = zero, zero, zero, zero
        s = zero
        for blk in tl.static_range(16):
            s = zero
            for j in tl.static_range(per):
                p = blk * per + j
                if p < D // 2:
                    qo = _bf(tl.load(q_row + 2 * p + 1))
                    ko = _bf(tl.load(k_ptr + base + 2 * p + 1, mask=live, other=0))
                    s = _flush(tl.fma(qo, ko, s))
                    qe = _bf(tl.load(q_row + 2 * p))
                    ke = _bf(tl.load(k_ptr + base + 2 * p, mask=live, other=0))
                    s = _flush(tl.fma(qe, ke, s))
            s, lv0, lv1, lv2, lv3 = _fold(blk, s, lv0, lv1, lv2, lv3)
        s = _flush(s * scale)
        mx = tl.maximum(m, tl.max(tl.where(live, s, -float("inf")), axis=0))
        rescale = _exp(_flush(m - mx))
        e = tl.where(live, _exp(_flush(s - mx)), 0.0)
        l_sum = _flush(_flush(l_sum * rescale) + _tree16(e))
        m = mx
        acc = _flush(acc * rescale)
        for t in range(0, 16):
            if start + t < length:
                e_t = tl.sum(tl.where(t16 == t, e, 0.0), axis=0)   # one value, the rest +0: exact
                b_t = tl.load(tables_ptr + row * W + (start + t) // BS)
                v = _bf(tl.load(v_ptr + ((b_t * BS + (start + t) % BS) * HKV + kvh) * D + dd))
                acc = _flush(acc + _flush(e_t * v))
    inv = _flush(tl.div_rn(1.0, l_sum))
    tl.store(out_ptr + (row * HQ + head) * D + dd, _to_bf(_flush(acc * inv)))


def decode_attention(q, k_cache, v_cache, tables, lens, scale: float) -> torch.Tensor:
    """q [B, Hq, D] (one query row per call row); the paged cache [blocks, block_size,
    Hkv, D]; tables [B, W]; lens [B]: keys each row attends (its position + 1)."""
    b, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    _attention_kernel[(b, hq)](_bits(q), _bits(k_cache), _bits(v_cache), tables.contiguous(), lens.contiguous(),
                               out.view(torch.int16), hq, hkv, tables.shape[1], bs, scale, D=d, **OPTIONS)
    return out


# ---- token choice -----------------------------------------------------------------

@triton.jit
def _gumbel_kernel(out_ptr, key, vocab, BLOCK: tl.constexpr):
    ids = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = mix32((ids.to(tl.uint32) * 0x9E3779B1) ^ key.to(tl.uint32))
    u = _flush(((h >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08)   # (2 (h >> 9) + 1) 2^-24
    tl.store(out_ptr + ids, _flush(-_log(_flush(-_log(u)))), mask=ids < vocab)


def gumbel(key: int, vocab: int, device="cpu") -> torch.Tensor:
    """The spec's Gumbel noise of one row, from its 32-bit key."""
    out = torch.empty(vocab, dtype=torch.float32, device=device)
    _gumbel_kernel[(triton.cdiv(vocab, 1024),)](out, key, vocab, BLOCK=1024, **OPTIONS)
    return out


# ---- mixture of experts (SPEC.md, "Mixture of experts") ----------------------------
# The router's logits are matmul(x, router, f32=True): the binary32 dots themselves.
# Routing takes BM rows per program, each row's experts along the second axis.

@triton.jit
def _lane(v, hit):
    """Per row, v at the one column where hit is true, bit for bit (-0 kept): every
    other value the max sees is -inf."""
    return tl.max(tl.where(hit, v, -float("inf")), axis=1)


@triton.jit
def _sum_lanes(v, idx, n, BM: tl.constexpr):
    """Per row, the spec's sum of v[row, 0..n-1]: its 16 blocks of ceil(n/16), each a
    chain of adds in order from +0, folded by the tree."""
    per = (n + DOT_BLOCKS - 1) // DOT_BLOCKS
    zero = tl.zeros((BM,), dtype=tl.float32)
    lv0, lv1, lv2, lv3 = zero, zero, zero, zero
    acc = zero
    for l in tl.static_range(DOT_BLOCKS):
        acc = zero
        for j in range(l * per, tl.minimum(n, (l + 1) * per)):
            acc = _flush(acc + _lane(v, idx == j))
        acc, lv0, lv1, lv2, lv3 = _fold(l, acc, lv0, lv1, lv2, lv3)
    return acc


@triton.jit
def _top(s, left, idx, EB: tl.constexpr):
    """Per row, the id of the largest s among `left`, the lowest id among equals (+0 and
    -0 equal); EB where none is left."""
    best = tl.max(tl.where(left, s, -float("inf")), axis=1)
    return tl.min(tl.where(left & (s == best[:, None]), idx, EB), axis=1)


@triton.jit
def _next_chosen(chosen, idx, prev, EB: tl.constexpr):
    """Per row, its lowest chosen expert id above prev."""
    return tl.min(tl.where(chosen & (idx > prev[:, None]), idx, EB), axis=1)


@triton.jit
def _moe_route_kernel(z_ptr, ids_ptr, w_ptr, margin_ptr, M, E, K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                      RENORM: tl.constexpr, BM: tl.constexpr, EB: tl.constexpr):
    """Each row's routing: ranking scores s (the softmax of its logits, or the logits),
    k picks of the largest s left, the lowest id among equals; the margin (the k-th
    pick's s minus the largest s left); then the weights, summed over the chosen in
    ascending id order and divided by that sum (except softmax first without RENORM)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    idx = tl.arange(0, EB)[None, :]
    live = idx < E
    z = _flush(tl.load(z_ptr + rows[:, None] * E + idx, mask=rmask[:, None] & live, other=0.0))
    if SOFTMAX_FIRST:
        mx = tl.max(tl.where(live, z, -float("inf")), axis=1)
        e = _exp(_flush(z - mx[:, None]))
        s = _flush(tl.div_rn(e, _sum_lanes(e, idx, E, BM)[:, None]))
    else:
        s = z
    chosen = (idx < 0) & rmask[:, None]   # [BM, EB], none yet
    kth = tl.zeros((BM,), dtype=tl.float32)
    for _ in tl.static_range(K):
        pick = _top(s, live & ~chosen, idx, EB)
        chosen = chosen | (idx == pick[:, None])
        kth = _lane(s, idx == pick[:, None])
    # The (k+1)-th ranked score is the one at its pick's id: a zero keeps its sign.
    after = _lane(s, idx == _top(s, live & ~chosen, idx, EB)[:, None])
    tl.store(margin_ptr + rows, tl.where(K < E, _flush(kth - after), float("inf")), mask=rmask)
    if SOFTMAX_FIRST:
        u = s
    else:
        m = tl.max(tl.where(chosen, z, -float("inf")), axis=1)
        u = _exp(_flush(z - m[:, None]))
    if RENORM or not SOFTMAX_FIRST:
        t = tl.zeros((BM,), dtype=tl.float32)
        c = tl.full((BM,), -1, tl.int32)
        for _ in tl.static_range(K):
            c = _next_chosen(chosen, idx, c, EB)
            t = _flush(t + _lane(u, idx == c[:, None]))
        u = _flush(tl.div_rn(u, t[:, None]))
    c = tl.full((BM,), -1, tl.int32)
    for i in tl.static_range(K):
        c = _next_chosen(chosen, idx, c, EB)
        tl.store(ids_ptr + rows * K + i, c.to(tl.int64), mask=rmask)
        tl.store(w_ptr + rows * K + i, _lane(u, idx == c[:, None]), mask=rmask)


def moe_route(logits: torch.Tensor, k: int, softmax_first: bool, renorm: bool) -> list:
    """[ids, weights, margins] of each row's routing from its binary32 router logits
    [rows, E], as ref_ops.cpp's moe_route: the k chosen expert ids ascending (int64
    [rows, k]), their binary32 weights [rows, k], the router margin [rows] (+inf when
    k = E). A NaN logit is refused (this reads the logits back to the host)."""
    assert logits.dtype == torch.float32 and logits.dim() == 2 and 1 <= k <= logits.shape[1]
    logits = logits.contiguous()
    nan = torch.isnan(logits)
    if bool(nan.any()):
        r, j = nan.nonzero()[0].tolist()
        raise RuntimeError(f"router logit is NaN (row {r}, expert {j})")
    rows, e = logits.shape
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    margins = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _moe_route_kernel[(triton.cdiv(rows, 16),)](logits, ids, weights, margins, rows, e, K=k,
                                                    SOFTMAX_FIRST=softmax_first, RENORM=renorm, BM=16,
                                                    EB=triton.next_power_of_2(e), **OPTIONS)
    return [ids, weights, margins]


@triton.jit
def _moe_combine_kernel(y_ptr, w_ptr, out_ptr, M, H, K: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr):
    """Each row's outputs: acc = +0, then per expert in order acc = acc + w*y (a
    multiply, then an add), then bf16."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < M
    mask = rmask[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BM, BLOCK), dtype=tl.float32)
    for i in tl.static_range(K):
        w = _flush(tl.load(w_ptr + rows * K + i, mask=rmask, other=0.0))
        y = _bf(tl.load(y_ptr + (rows * K + i)[:, None] * H + cols[None, :], mask=mask, other=0))
        acc = _flush(acc + _flush(w[:, None] * y))
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], _to_bf(acc), mask=mask)


def moe_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row's experts' outputs y [rows, k, H] (bf16, ascending expert id order)
    weighted by weights [rows, k] (binary32) and summed in that order: bf16 [rows, H]."""
    assert y.dtype == torch.bfloat16 and weights.dtype == torch.float32 and y.dim() == 3
    rows, k, h = y.shape
    assert weights.shape == (rows, k)
    out = torch.empty(rows, h, dtype=y.dtype, device=y.device)
    if rows:
        grid = (triton.cdiv(rows, 16), triton.cdiv(h, 128))
        _moe_combine_kernel[grid](_bits(y), weights.contiguous(), out.view(torch.int16), rows, h, K=k, BM=16,
                                  BLOCK=128, **OPTIONS)
    return out
