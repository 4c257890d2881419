"""The oracle's quantized arithmetic (tests/oracle.py: qdot, qlinear, qvalues; SPEC.md,
"Quantized weights") is sane: within rounding of a float64 sum, exact where every step
is, in the spec's order where the order decides, and the embedding values as torch
rounds them. Numpy only."""
import numpy as np
import pytest
import torch

from tests import oracle

KINDS = {"Q8_0": (-128, 128, False), "Q4_0": (-8, 8, False), "Q4_1": (0, 16, True)}


def bits(x) -> np.ndarray:
    return torch.as_tensor(np.asarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def weights(kind: str, n: int, k: int, rng):
    lo, hi, has_min = KINDS[kind]
    q = rng.integers(lo, hi, (n, k)).astype(np.int8)
    d = (rng.standard_normal((n, k // 32)) * 0.02).astype(np.float16)
    m = (rng.standard_normal((n, k // 32)) * 0.1).astype(np.float16) if has_min else None
    return q, d, m


def exact(x, q, d, m):
    """The float64 value of x @ W.T (x bf16 bits [M, K]), block by block."""
    xf = oracle.bf(x).astype(np.float64)
    blocks = np.einsum("mgi,ngi->mng", xf.reshape(len(xf), -1, 32),
                       q.astype(np.float64).reshape(len(q), -1, 32))
    out = (blocks * d.astype(np.float64)[None]).sum(-1)
    absolute = (np.abs(xf)[:, None, :] * np.abs(q * np.repeat(d.astype(np.float64), 32, -1))[None]).sum(-1)
    if m is not None:
        t = xf.reshape(len(xf), -1, 32).sum(-1)
        out = out + (t[:, None, :] * m.astype(np.float64)[None]).sum(-1)
        absolute = absolute + (np.abs(xf)[:, None, :] * np.abs(np.repeat(m.astype(np.float64), 32, -1))[None]).sum(-1)
    return out, absolute


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("k", [64, 96, 576, 1056])   # B = 2, 3, 18 and 33 (lanes of 3 blocks)
def test_qdot_is_the_sum_within_rounding(kind, k):
    rng = np.random.default_rng(k)
    x = bits(rng.standard_normal((3, k)) * 3)
    q, d, m = weights(kind, 11, k, rng)
    got = oracle.qlinear(x, q, d, m, f32=True)
    assert got.dtype == np.float32 and got.shape == (3, 11)
    want, absolute = exact(x, q, d, m)
    # every path from an input to the result is at most 32 + 2 + per + 4 roundings of 2^-24
    bound = (40 + (k // 32 + 15) // 16) * 2.0 ** -24 * absolute
    assert (np.abs(got - want) <= bound).all()
    assert (np.abs(got - want) > 0).any()   # binary32, not float64
    assert np.array_equal(oracle.qlinear(x, q, d, m), oracle.to_bf(got))
    assert np.array_equal(oracle.qdot(x[1], q[4], d[4], None if m is None else m[4]), got[1, 4])


@pytest.mark.parametrize("kind", list(KINDS))
def test_qdot_is_exact_where_every_step_is(kind):
    """Small integers for x and powers of two for the scales: no step rounds."""
    rng = np.random.default_rng(7)
    x = bits(rng.integers(-20, 21, (2, 576)))
    q, _, m = weights(kind, 9, 576, rng)
    d = np.exp2(rng.integers(-6, 3, (9, 18))).astype(np.float16)
    if m is not None:
        m = -np.exp2(rng.integers(-6, 3, (9, 18))).astype(np.float16)
    assert np.array_equal(oracle.qlinear(x, q, d, m, f32=True), exact(x, q, d, m)[0].astype(np.float32))


def test_the_order_is_the_specs():
    """Odd element first in a block's chain (and in t), blocks in order within a lane,
    lanes of ceil(B/16) blocks: each case below gives another value in another order."""
    k = 32 * 33                                   # B = 33: per = 3, lanes 0..10 full
    x = np.zeros(k, np.float32)
    x[1], x[3], x[2] = 2.0 ** 24, 1.0, -(2.0 ** 24)   # block 0: 2^24, then 1 (lost), then -2^24: 0
    q = np.zeros(k, np.int8)
    q[:4] = 1
    d = np.zeros(33, np.float16)
    d[0] = 1.0
    assert oracle.qdot(bits(x), q, d) == 0        # even first: 2^24 - 2^24 + 1 = 1
    m = np.zeros(33, np.float16)
    m[0] = 1.0
    assert oracle.qdot(bits(x), np.zeros(k, np.int8), np.zeros(33, np.float16), m) == 0   # t, the same

    x = np.zeros(k, np.float32)
    x[32 * np.arange(33)] = 1.0                  # s_g = q[32g] = 1: c_g = d_g
    q = np.zeros(k, np.int8)
    q[32 * np.arange(33)] = 1
    d = np.zeros(33, np.float16)
    d[:6] = [2.0 ** 15, -(2.0 ** 15), 2.0 ** -9, 2.0 ** 15, 2.0 ** -9, -(2.0 ** 15)]
    # lane 0: (2^15 - 2^15) + 2^-9 = 2^-9; lane 1: (2^15 + 2^-9) - 2^15 = 0 (a tie, to even)
    assert oracle.qdot(bits(x), q, d) == np.float32(2.0 ** -9)


@pytest.mark.parametrize("kind", list(KINDS))
def test_qvalues_are_the_values_rounded_once(kind):
    rng = np.random.default_rng(3)
    q, d, m = weights(kind, 5, 96, rng)
    values = torch.from_numpy(np.repeat(d, 32, -1)).float() * torch.from_numpy(q).float()   # exact
    if m is not None:
        values = values + torch.from_numpy(np.repeat(m, 32, -1)).float()
    got = oracle.qvalues(q, d, m)
    assert got.dtype == np.uint16 and got.shape == q.shape
    assert np.array_equal(got, values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
