"""The reference's slow oracle: kernels/SPEC.md (gateeng-ref-1) computed in numpy, one
binary32 operation at a time, written from the spec and not from the kernels.

Every binary32 result goes through `flush` (the spec's denormal rule), every input
through it too. The fused multiply-add of two bf16 values is their exact product
plus the accumulator, rounded once: in binary32 directly where the product is
exact there, else from binary64 with the rounding decided exactly (`_fma_exact`).
Values are numpy arrays: bf16 as uint16 bits, binary32 as float32.
"""
from __future__ import annotations

import numpy as np

F32, F64, U32 = np.float32, np.float64, np.uint32
TINY = F32(2.0 ** -126)
ZERO = F32(0.0)
INF = F32(np.inf)


def flush(x) -> np.ndarray:
    """A new binary32 array of x, its subnormals replaced by zeros of their sign."""
    x = np.array(x, dtype=F32)
    tiny = np.abs(x) < TINY
    if np.count_nonzero(tiny):   # rare: most calls pay for the test only
        x[tiny] = np.copysign(ZERO, x[tiny])
    return x


def bf(bits) -> np.ndarray:
    """bf16 bits -> binary32 values (exact), inputs read as the spec reads them."""
    return flush((np.asarray(bits, dtype=np.uint16).astype(U32) << U32(16)).view(F32))


def to_bf(x) -> np.ndarray:
    """binary32 -> bf16 bits, round to nearest even; NaN stays NaN."""
    u = np.asarray(x, dtype=F32).view(U32)
    rounded = ((u + U32(0x7FFF) + ((u >> U32(16)) & U32(1))) >> U32(16)).astype(np.uint16)
    nan = (u & U32(0x7FFFFFFF)) > U32(0x7F800000)
    return np.where(nan, ((u >> U32(16)) | U32(0x40)).astype(np.uint16), rounded)


def _fma_exact(a, b, c) -> np.ndarray:
    """round32(a * b + c), exact, via binary64: the product is exact there, TwoSum
    gives the sum's error, and only a sum that falls on a binary32 midpoint needs it."""
    p = a.astype(F64) * b.astype(F64)
    c64 = c.astype(F64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    away = np.where(s > r.astype(F64), np.nextafter(r, INF), np.nextafter(r, -INF))
    mid = (r.astype(F64) + away.astype(F64)) * 0.5
    on_mid = (s == mid) & (err != 0)
    toward_away = np.sign(err) == np.sign(away.astype(F64) - s)
    return np.where(on_mid & toward_away, away, r).astype(F32)


def fma(a, b, c) -> np.ndarray:
    """The spec's step acc + a*b (a, b bf16 values): one rounding, then flushed."""
    a, b, c = flush(a), flush(b), flush(c)
    with np.errstate(all="ignore"):
        p = a * b
        exact = p.astype(F64) == a.astype(F64) * b.astype(F64)
        s = c + p
        if np.count_nonzero(exact) != exact.size:   # rare for bf16 values: most products are exact
            s = np.where(exact, s, _fma_exact(*np.broadcast_arrays(a, b, c)))
    return flush(s)


def tree(values: list) -> np.ndarray:
    """The pairwise tree over 16 values (or any power of two of them):
    ((0+1)+(2+3))+..., each add flushed."""
    while len(values) > 1:
        values = [flush(values[i] + values[i + 1]) for i in range(0, len(values), 2)]
    return values[0]


def dot(a, b) -> np.ndarray:
    """The spec's dot over the last axis of bf16 bits a [..., K] and b [..., K]
    (broadcast): 16 blocks of ceil(pairs / 16) pairs, odd element first, the tree."""
    return dot_blocks(a, b, ((a.shape[-1] + 1) // 2 + 15) // 16, 16)


def dot_blocks(a, b, per: int, count: int) -> np.ndarray:
    """The tree over `count` blocks of `per` pairs from the start of a and b: the whole
    dot (dot), or a tensor-parallel rank's subtree over its slice of K."""
    af, bf_ = bf(a), bf(b)
    k = af.shape[-1]
    pairs = (k + 1) // 2
    shape = np.broadcast_shapes(af.shape[:-1], bf_.shape[:-1])
    blocks = []
    for lane in range(count):
        acc = np.zeros(shape, F32)
        for p in range(lane * per, min(pairs, (lane + 1) * per)):
            if 2 * p + 1 < k:
                acc = fma(af[..., 2 * p + 1], bf_[..., 2 * p + 1], acc)
            acc = fma(af[..., 2 * p], bf_[..., 2 * p], acc)
        blocks.append(acc)
    return tree(blocks)


def fsum(x) -> np.ndarray:
    """The spec's sum over the last axis of binary32 x: 16 blocks of ceil(n / 16)
    consecutive values, each a chain from +0, the tree."""
    x = flush(x)
    n = x.shape[-1]
    per = (n + 15) // 16
    blocks = []
    for lane in range(16):
        acc = np.zeros(x.shape[:-1], F32)
        for i in range(lane * per, min(n, (lane + 1) * per)):
            acc = flush(acc + x[..., i])
        blocks.append(acc)
    return tree(blocks)


def exp(x) -> np.ndarray:
    x = flush(x)
    with np.errstate(all="ignore"):
        xc = np.clip(x, F32(-86.0), F32(88.0))
        t = flush(xc * F32(1.44269504088896341))
        k = flush(flush(t + F32(12582912.0)) - F32(12582912.0))
        r = flush(xc - flush(k * F32(0.693359375)))
        r = flush(r - flush(k * F32(-2.12194440e-4)))
        p = np.full_like(r, F32(1.9875691500e-4))
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            p = flush(flush(p * r) + F32(c))
        y = flush(p * flush(r * r))
        y = flush(y + r)
        y = flush(y + F32(1.0))
        scale = ((k.astype(np.int64) + 127).astype(U32) << U32(23)).view(F32)
        out = flush(y * scale)
    out = np.where(x > F32(88.0), INF, out)
    out = np.where(x < F32(-86.0), ZERO, out)
    return np.where(np.isnan(x), x, out).astype(F32)


def log(x) -> np.ndarray:
    x = flush(x)
    with np.errstate(all="ignore"):
        u = np.where(x > 0, x, F32(1.0)).view(U32)
        e = ((u >> U32(23)) & U32(0xFF)).astype(np.int64) - 126
        m = ((u & U32(0x807FFFFF)) | U32(0x3F000000)).view(F32)
        small = m < F32(0.707106781186547524)
        e = np.where(small, e - 1, e)
        m = np.where(small, flush(flush(m + m) - F32(1.0)), flush(m - F32(1.0)))
        z = flush(m * m)
        y = np.full_like(m, F32(7.0376836292e-2))
        for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
                  2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):
            y = flush(flush(y * m) + F32(c))
        y = flush(flush(y * m) * z)
        fe = e.astype(F32)
        y = flush(y + flush(fe * F32(-2.12194440e-4)))
        y = flush(y + flush(F32(-0.5) * z))
        out = flush(m + y)
        out = flush(out + flush(fe * F32(0.693359375)))
    out = np.where(x == INF, INF, out)
    out = np.where(x == 0, -INF, out)
    return np.where((x < 0) | np.isnan(x), F32(np.nan), out).astype(F32)


# ---- the model's operations ---------------------------------------------------------

def linear(x, w, f32: bool = False):
    """x [M, K] @ w [N, K].T (bf16 bits): bf16 bits, or binary32 sums (f32)."""
    s = dot(x[:, None, :], w[None, :, :])
    return s if f32 else to_bf(s)


def rms_norm(x, w, eps: float):
    h = x.shape[-1]
    ms = flush(dot(x, x) / F32(h))
    inv = flush(F32(1.0) / flush(np.sqrt(flush(ms + F32(eps)))))
    normed = to_bf(flush(bf(x) * inv[..., None]))
    return to_bf(flush(bf(w) * bf(normed)))


def add(a, b):
    return to_bf(flush(bf(a) + bf(b)))


def silu_mul(gate_up):
    n = gate_up.shape[-1] // 2
    x, up = bf(gate_up[..., :n]), bf(gate_up[..., n:])
    with np.errstate(all="ignore"):
        s = flush(x / flush(F32(1.0) + exp(-x)))
    return to_bf(flush(bf(to_bf(s)) * up))


def rope(x, cos, sin):
    """x [..., D] bits; cos, sin [..., D] bits (broadcast)."""
    half = x.shape[-1] // 2
    xf = bf(x)
    rot = np.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return to_bf(flush(bf(to_bf(flush(xf * bf(cos)))) + bf(to_bf(flush(rot * bf(sin))))))


def attention(q, keys, values, scale: float):
    """One query row of one head: q [D], keys and values [L, D] (bits) at positions
    0..L-1: chunks of 16 positions, online softmax, the value chain."""
    d = q.shape[-1]
    m, l, acc = -INF, ZERO, np.zeros(d, F32)
    for start in range(0, len(keys), 16):
        n = min(16, len(keys) - start)
        s = np.full(16, -INF, F32)
        s[:n] = flush(dot(q[None, :], keys[start:start + n]) * F32(scale))
        mx = max(m, F32(s[:n].max()))
        with np.errstate(all="ignore"):
            rescale = exp(np.array([m - mx], F32))[0]
            e = exp(flush(s - mx))
        l = flush(flush(l * rescale) + tree([e[i:i + 1] for i in range(16)])[0])
        m = mx
        acc = flush(acc * rescale)
        v = bf(values[start:start + n])
        for t in range(n):
            acc = flush(acc + flush(e[t] * v[t]))
    inv = flush(F32(1.0) / l)
    return to_bf(flush(acc * inv))


# ---- quantized weights (Q8_0, Q4_0, Q4_1; Q4_K, Q5_K, Q6_K) ------------------------

def qdot(x, q, d, m=None) -> np.ndarray:
    """The spec's qdot over the last axis (broadcast): x bf16 bits [..., K], q the
    integers [..., K] (Q4_0's already n - 8), d binary16 scales [..., K/32] and, for
    Q4_1, m binary16 minimums [..., K/32]. Per block of 32 the chain of fma on the
    integers, odd element first; c = d*s (or (d*s) + (m*t), t the plain sum of x);
    16 lanes of ceil(B/16) consecutive blocks, each a chain of adds from +0; the tree."""
    df = flush(np.asarray(d, np.float16).astype(F32))
    mf = None if m is None else -flush(np.asarray(m, np.float16).astype(F32))   # c - (-m)*t is c + m*t, exactly
    return kqdot(x, q, df, mf, 32, 32)


def kqdot(x, q, scale, mins=None, block: int = 256, sub: int = 32) -> np.ndarray:
    """The spec's qdot with sub-blocks (the K-quants): x bf16 bits [..., K], q the
    integers [..., K] (Q6_K's already n - 32), `scale` the binary32 scale of each
    sub-block of `sub` values [..., K/sub] (d * sc), `mins` the binary32 minimum of each
    (dmin * min) or None. Per sub-block the chain of fma on its integers, odd element
    first; c = scale*s, or (scale*s) - (min*t) with t the plain sum of its x; a lane is
    ceil(B/16) consecutive blocks of `block` values, its sum a chain of adds of their
    sub-blocks' c in order from +0; the tree over the 16 lanes."""
    xf = bf(x)
    qf = np.asarray(q).astype(F32)              # |q| <= 128: exact, bf16 values
    sf = flush(np.asarray(scale, F32))
    mf = None if mins is None else flush(np.asarray(mins, F32))
    k = xf.shape[-1]
    assert k % block == 0 and qf.shape[-1] == k and sf.shape[-1] == k // sub
    nb, subs = k // block, block // sub
    shapes = [xf.shape[:-1], qf.shape[:-1], sf.shape[:-1]] + ([] if mf is None else [mf.shape[:-1]])
    shape = np.broadcast_shapes(*shapes)
    per = (nb + 15) // 16
    lanes = []
    for lane in range(16):
        acc = np.zeros(shape, F32)
        for g in range(lane * per, min(nb, (lane + 1) * per)):
            for j in range(g * subs, (g + 1) * subs):
                s = np.zeros(shape, F32)
                t = np.zeros(xf.shape[:-1], F32)
                for p in range(sub // 2):
                    odd, even = sub * j + 2 * p + 1, sub * j + 2 * p
                    s = fma(xf[..., odd], qf[..., odd], s)
                    s = fma(xf[..., even], qf[..., even], s)
                    t = flush(t + xf[..., odd])
                    t = flush(t + xf[..., even])
                c = flush(sf[..., j] * s)
                if mf is not None:
                    c = flush(c - flush(mf[..., j] * t))
                acc = flush(acc + c)
        lanes.append(acc)
    return tree(lanes)


def qlinear(x, q, d, m=None, f32: bool = False):
    """x [M, K] (bf16 bits) @ the quantized W [N, K].T (q [N, K], d and m [N, K/32]):
    bf16 bits, or the binary32 qdots (f32)."""
    s = qdot(x[:, None, :], q[None, :, :], d[None, :, :], None if m is None else m[None, :, :])
    return s if f32 else to_bf(s)


def kqlinear(x, q, scale, mins=None, sub: int = 32, f32: bool = False):
    """x [M, K] (bf16 bits) @ a K-quant W [N, K].T (kqdot's q, scale and mins, [N, ...])."""
    s = kqdot(x[:, None, :], q[None, :, :], scale[None, :, :], None if mins is None else mins[None, :, :], 256, sub)
    return s if f32 else to_bf(s)


K_QUANTS = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}   # bytes per stored super-block of 256 values


def kfields(raw, kind: str) -> tuple:
    """A K-quant's GGUF rows (uint8 [N, blocks * stored bytes]) as kqdot's operands
    (q [N, K], scale [N, K/sub], mins [N, K/sub] or None, sub): ggml's block layouts,
    decoded here on their own (tests check them against the gguf package's
    dequantization). The scales are d * sc and dmin * min in binary32 (exact)."""
    raw = np.asarray(raw, np.uint8)
    n = raw.shape[0]
    b = raw.reshape(n, -1, K_QUANTS[kind])
    nb = b.shape[1]
    half = lambda a: np.ascontiguousarray(a).view(np.float16)[..., 0].astype(F32)   # noqa: E731
    if kind == "Q6_K":
        ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208].view(np.int8), half(b[..., 208:210])
        lo = np.concatenate([ql[..., :64] & 15, ql[..., :64] >> 4, ql[..., 64:] & 15, ql[..., 64:] >> 4], -1)
        hi = np.concatenate([(qh[..., h * 32:(h + 1) * 32] >> (2 * i)) & 3 for h in range(2) for i in range(4)], -1)
        q = (lo | (hi << 4)).astype(np.int64) - 32
        return q.reshape(n, -1), (d[..., None] * sc.astype(F32)).reshape(n, -1), None, 16
    d, dmin, s = half(b[..., 0:2]), half(b[..., 2:4]), b[..., 4:16].astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 48:176] if kind == "Q5_K" else b[..., 16:144]
    q = np.concatenate([(qs[..., (j // 2) * 32:(j // 2 + 1) * 32] >> (4 * (j % 2))) & 15 for j in range(8)], -1)
    q = q.astype(np.int64).reshape(n, nb, 256)
    if kind == "Q5_K":
        qh = b[..., 16:48]
        q = q | (np.concatenate([(qh >> j) & 1 for j in range(8)], -1).astype(np.int64) << 4)
    scale = d[..., None] * sc.astype(F32)
    mins = dmin[..., None] * mn.astype(F32)
    return q.reshape(n, -1), scale.reshape(n, -1), mins.reshape(n, -1), 32


def kvalues(q, scale, mins=None, sub: int = 32):
    """A K-quant table's rows as bf16 bits: bf16(scale*q), or bf16((scale*q) - min)."""
    v = flush(np.repeat(np.asarray(scale, F32), sub, -1) * np.asarray(q).astype(F32))   # exact
    if mins is not None:
        v = flush(v - np.repeat(np.asarray(mins, F32), sub, -1))
    return to_bf(v)


def qvalues(q, d, m=None):
    """A quantized table's rows as bf16 bits: bf16(d*q), or bf16((d*q) + m) (Q4_1)."""
    qf = np.asarray(q).astype(F32)
    df = np.repeat(flush(np.asarray(d, np.float16).astype(F32)), 32, axis=-1)
    v = flush(df * qf)                            # exact: 11 x 8 significant bits
    if m is not None:
        v = flush(v + np.repeat(flush(np.asarray(m, np.float16).astype(F32)), 32, axis=-1))
    return to_bf(v)


# ---- token choice -------------------------------------------------------------------

_M = 0xFFFFFFFF


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> int:
    s = _mix(((seed & _M) ^ _mix((seed >> 32) & _M)) & _M)
    return _mix(s ^ (position & _M))


def gumbel(key: int, vocab: int):
    x = (np.arange(vocab, dtype=np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(_M)
    x = x.astype(U32) ^ U32(key)
    x = x ^ (x >> U32(16))
    x = x * U32(0x7FEB352D)
    x = x ^ (x >> U32(15))
    x = x * U32(0x846CA68B)
    x = x ^ (x >> U32(16))
    u = flush(((x >> U32(9)) * U32(2) + U32(1)).astype(F32) * F32(2.0 ** -24))
    return flush(-log(flush(-log(u))))


def sample_scores(z, temperature: float, top_k: int, top_p: float):
    s = flush(flush(z) / F32(temperature))
    v = len(s)
    if 0 < top_k < v:
        kth = np.sort(s)[::-1][top_k - 1]
        s = np.where(s < kth, -INF, s).astype(F32)
    if F32(top_p) < F32(1.0):
        order = np.argsort(-s, kind="stable")
        with np.errstate(all="ignore"):
            e = exp(flush(s[order] - s[order[0]]))
        total = fsum(e)
        before = ZERO
        drop = np.zeros(v, bool)
        for j in range(v):
            p = flush(e[j] / total)
            drop[order[j]] = before > F32(top_p)
            before = flush(before + p)
        s = np.where(drop, -INF, s).astype(F32)
    return s


def moe_route(z, k: int, softmax_first: bool, renorm: bool):
    """A mixture of experts' routing of one row of binary32 router logits z [E]
    (SPEC.md, "Mixture of experts"): (the k chosen ids ascending, their weights, the
    router margin)."""
    z = flush(np.asarray(z, F32))
    e = z.shape[0]
    if softmax_first:
        ex = exp(flush(z - z.max()))
        score = flush(ex / fsum(ex))
    else:
        score = z
    ranked = sorted(range(e), key=lambda j: (-float(score[j]), j))   # higher first, lower id among ties
    margin = flush(score[ranked[k - 1]] - score[ranked[k]]) if k < e else INF
    ids = sorted(ranked[:k])
    if softmax_first:
        w = [score[j] for j in ids]
        if renorm:
            t = ZERO
            for v in w:
                t = flush(t + v)
            w = [flush(v / t) for v in w]
    else:
        mx = max(z[j] for j in ids)
        w = [exp(flush(z[j] - mx)) for j in ids]
        t = ZERO
        for v in w:
            t = flush(t + v)
        w = [flush(v / t) for v in w]
    return ids, np.array(w, F32), F32(margin)


def moe_combine(y, w):
    """bf16 bits of one row's experts' outputs y [k, H] (bf16 bits) weighted by w [k]
    and summed in order: acc = +0, acc = acc + w*y, then bf16."""
    acc = np.zeros(np.asarray(y).shape[1], F32)
    for s in range(len(w)):
        acc = flush(acc + flush(F32(w[s]) * bf(y[s])))
    return to_bf(acc)


def argmax_margin(s):
    s = flush(s)
    best = int(np.argmax(s))   # the first (lowest) id of the largest value
    rest = np.delete(s, best)
    return best, float(flush(s[best] - rest.max()))


def log_softmax(s):
    s = flush(s)
    mx = s.max()
    with np.errstate(all="ignore"):
        shifted = flush(s - mx)
        lz = log(fsum(exp(shifted))[None])[0]
        return flush(shifted - lz)


# ---- the RoPE tables (binary64: Python floats, one operation at a time) ------------

_S = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
      2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
_C = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
      -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)


def _horner(z: float, coefs) -> float:
    out = coefs[-1]
    for c in reversed(coefs[:-1]):
        out = c + z * out
    return out


def sin_cos(a: float) -> tuple[float, float]:
    n = (a * 6.36619772367581382433e-01 + 6755399441055744.0) - 6755399441055744.0
    y = (a - n * 1.57079632673412561417e+00) - n * 6.07710050650619224932e-11
    z = y * y
    s = y + (z * y) * (_S[0] + z * _horner(z, _S[1:]))
    hz = 0.5 * z
    w = 1.0 - hz
    c = w + (((1.0 - w) - hz) + (z * (z * _horner(z, _C))))
    q = int(n) & 3
    return [(s, c), (c, -s), (-s, -c), (-c, s)][q]


def inv_freq(theta: float, d: int) -> list:
    half = d // 2
    lo, hi = 1.0, float(theta)
    for _ in range(200):
        mid = (lo + hi) * 0.5
        power = mid
        for _ in range(half - 1):
            power = power * mid
        if power < theta:
            lo = mid
        else:
            hi = mid
    out, power = [], 1.0
    for _ in range(half):
        out.append(1.0 / power)
        power = power * hi
    return out


def bf16_of_double(x: float) -> int:
    """binary64 -> bf16 bits, rounded once to nearest even."""
    b = np.array([x], F64).view(np.uint64)[0]
    b = (int(b) + (1 << 44) - 1 + ((int(b) >> 45) & 1)) & ~((1 << 45) - 1)
    return int(to_bf(np.array([b], np.uint64).view(F64).astype(F32))[0])


def rope_row(position: int, inv: list):
    """(cos, sin) bf16 bits [D] at one position (rotate-half: each frequency twice)."""
    pairs = [sin_cos(position * f) for f in inv]
    cos = [bf16_of_double(c) for s, c in pairs]
    sin = [bf16_of_double(s) for s, c in pairs]
    return np.array(cos + cos, np.uint16), np.array(sin + sin, np.uint16)


# ---- a whole decode ---------------------------------------------------------------

class Model:
    """A Llama-family model's bf16 weights as bits, from a gateeng LlamaModel, and the
    spec's forward over them (no KV paging: the spec's attention does not see it)."""

    def __init__(self, model):
        import torch

        def b(t):
            return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)
        cfg = model.cfg
        self.cfg = cfg
        self.embed, self.norm, self.lm_head = b(model.embed), b(model.norm), b(model.lm_head)
        self.layers = [dict(input_norm=b(layer.input_norm), qkv=b(layer.qkv), o=b(layer.o),
                            post_norm=b(layer.post_norm), gate_up=b(layer.gate_up), down=b(layer.down),
                            qkv_bias=None if layer.qkv_bias is None else b(layer.qkv_bias))
                       for layer in model.layers]
        self.inv = inv_freq(cfg.rope_theta, cfg.head_dim)
        self.keys = [[] for _ in self.layers]
        self.values = [[] for _ in self.layers]

    def forward(self, ids: list, start: int):
        """The logits (binary32 [rows, vocab]) of tokens ids at positions start..; their
        keys and values are appended to the cache first, as a prefill does."""
        cfg = self.cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rows = len(ids)
        tables = [rope_row(start + r, self.inv) for r in range(rows)]
        cos = np.stack([c for c, s in tables])
        sin = np.stack([s for c, s in tables])
        h = self.embed[ids]
        x = rms_norm(h, self.layers[0]["input_norm"], cfg.rms_norm_eps)
        norms = [layer["input_norm"] for layer in self.layers[1:]] + [self.norm]
        for i, layer in enumerate(self.layers):
            qkv = linear(x, layer["qkv"])
            if layer["qkv_bias"] is not None:
                qkv = add(qkv, layer["qkv_bias"][None, :])
            q = rope(qkv[:, :hq * d].reshape(rows, hq, d), cos[:, None, :], sin[:, None, :])
            k = rope(qkv[:, hq * d:(hq + hkv) * d].reshape(rows, hkv, d), cos[:, None, :], sin[:, None, :])
            v = qkv[:, (hq + hkv) * d:].reshape(rows, hkv, d)
            self.keys[i].extend(k)
            self.values[i].extend(v)
            keys, values = np.stack(self.keys[i]), np.stack(self.values[i])
            attn = np.empty((rows, hq, d), np.uint16)
            for r in range(rows):
                for head in range(hq):
                    kvh = head // (hq // hkv)
                    attn[r, head] = attention(q[r, head], keys[:start + r + 1, kvh], values[:start + r + 1, kvh],
                                              1.0 / np.sqrt(d))
            o = linear(attn.reshape(rows, hq * d), layer["o"])
            h = add(h, o)
            x = rms_norm(h, layer["post_norm"], cfg.rms_norm_eps)
            mlp = linear(silu_mul(linear(x, layer["gate_up"])), layer["down"])
            h = add(h, mlp)
            x = rms_norm(h, norms[i], cfg.rms_norm_eps)
        return linear(x, self.lm_head, f32=True)

    def decode(self, prompt: list, n: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0) -> tuple[list, list]:
        """n tokens after prompt: (token ids, the float32 bits of each token's logprob)."""
        self.keys = [[] for _ in self.layers]
        self.values = [[] for _ in self.layers]
        logits = self.forward(prompt, 0)[-1]
        tokens, lps = [], []
        for step in range(n):
            position = len(prompt) + step
            if temperature == 0.0:
                scores = logits
                tok, _ = argmax_margin(logits)
            else:
                scores = sample_scores(logits, temperature, top_k, top_p)
                tok, _ = argmax_margin(flush(scores + gumbel(row_key(seed, position), len(scores))))
            tokens.append(tok)
            lps.append(int(log_softmax(scores)[tok:tok + 1].view(U32)[0]))
            if step + 1 < n:
                logits = self.forward([tok], position)[-1]
        return tokens, lps
