"""The RoPE tables: cos and sin of position x frequency, per kernels/SPEC.md ("RoPE
tables"), for every plan.

Every value is a fixed sequence of IEEE-754 binary64 additions, multiplications and
divisions (numpy's elementwise ops, never fused), no libm: the frequencies by
bisection and repeated multiplication, the angles' sine and cosine by fdlibm's
reduction and polynomials, each rounded once to the model dtype. So the tables have
the same bits on every machine, which the reference needs, and they are more
accurate than float32 tables (an angle's error stays below 1e-9 rad).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from gateeng.config import ModelConfig

# fdlibm's __kernel_sin / __kernel_cos coefficients and pi/2 in two parts (the first
# 33 bits, so n * PIO2_1 is exact for |n| < 2^20).
S = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
     2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
C = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
     -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)
PIO2_1, PIO2_1T, INV_PIO2 = 1.57079632673412561417e+00, 6.07710050650619224932e-11, 6.36619772367581382433e-01
ROUND = 6755399441055744.0   # 1.5 * 2^52: (t + ROUND) - ROUND is t to the nearest integer, ties to even
MAX_ANGLE = 1.0e6            # n stays below 2^20 (the reduction's exact range)
BISECTIONS = 200


def _power(x: float, n: int) -> float:
    """x^n by n - 1 multiplications, left to right."""
    out = x
    for _ in range(n - 1):
        out = out * x
    return out


def frequency_ratio(theta: float, half: int) -> float:
    """r with r^half = theta (r = theta^(2/d)): bisection on [1, theta], BISECTIONS
    steps, comparing _power(mid, half) with theta; the upper end."""
    lo, hi = 1.0, float(theta)
    for _ in range(BISECTIONS):
        mid = (lo + hi) * 0.5
        if _power(mid, half) < theta:
            lo = mid
        else:
            hi = mid
    return hi


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """binary64 [d / 2]: 1 / r^i, r^i by repeated multiplication, then the config's
    scaling (Llama 3.1's frequency-dependent one, or linear)."""
    half = cfg.head_dim // 2
    r = frequency_ratio(cfg.rope_theta, half)
    inv, power = [], 1.0
    for _ in range(half):
        inv.append(1.0 / power)
        power = power * r
    out = np.array(inv, dtype=np.float64)
    sc = cfg.rope_scaling
    kind = sc.get("rope_type", sc.get("type")) if sc else None
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_len = float(sc["original_max_position_embeddings"])
        wavelen = (2.0 * math.pi) / out
        scaled = np.where(wavelen > old_len / low, out / factor, out)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1.0 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        out = np.where(is_mid, mid, scaled)
    elif kind == "linear":
        out = out / float(sc["factor"])
    return out


def _poly(z: np.ndarray, coefs) -> np.ndarray:
    """c0 + z (c1 + z (c2 + ...)), innermost first."""
    out = np.full_like(z, coefs[-1])
    for c in reversed(coefs[:-1]):
        out = c + z * out
    return out


def sin_cos(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """binary64 sin and cos of a (|a| <= MAX_ANGLE): n = nearest(a 2/pi),
    y = (a - n PIO2_1) - n PIO2_1T, fdlibm's kernels on y, the quadrant n mod 4."""
    if np.abs(a).max(initial=0.0) > MAX_ANGLE:
        raise ValueError(f"RoPE angle beyond {MAX_ANGLE:g} rad: the table's reduction is exact only below it")
    n = (a * INV_PIO2 + ROUND) - ROUND
    y = (a - n * PIO2_1) - n * PIO2_1T
    z = y * y
    s = y + (z * y) * (S[0] + z * _poly(z, S[1:]))
    hz = 0.5 * z
    w = 1.0 - hz
    c = w + (((1.0 - w) - hz) + (z * (z * _poly(z, C))))
    q = n.astype(np.int64) & 3
    sin = np.select([q == 0, q == 1, q == 2], [s, c, -s], -c)
    cos = np.select([q == 0, q == 1, q == 2], [c, -s, -c], s)
    return sin, cos


def round_to(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """binary64 values rounded once (to nearest, ties to even) to dtype."""
    if dtype == torch.bfloat16:
        bits = x.astype(np.float64).view(np.uint64)
        # keep 7 of binary64's 52 fraction bits: the rounding happens here, once
        bits = (bits + np.uint64((1 << 44) - 1) + ((bits >> np.uint64(45)) & np.uint64(1))) & ~np.uint64((1 << 45) - 1)
        return torch.from_numpy(bits.view(np.float64).astype(np.float32)).to(torch.bfloat16)   # both exact
    return torch.from_numpy(x.astype(np.float32)).to(dtype)


def tables(cfg: ModelConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_position, head_dim] in dtype: the angle pos * inv_freq[i]
    (binary64) for columns i and i + d / 2 (rotate-half)."""
    inv = inv_freq(cfg)
    angles = np.arange(cfg.max_position, dtype=np.float64)[:, None] * inv[None, :]
    sin, cos = sin_cos(angles)
    return round_to(np.concatenate([cos, cos], axis=1), dtype), round_to(np.concatenate([sin, sin], axis=1), dtype)
