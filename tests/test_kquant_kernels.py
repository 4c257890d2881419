"""The K-quants (Q4_K, Q5_K, Q6_K) multiplied as stored (kernels/SPEC.md, "Quantized
weights"): random GGUF blocks as raw bytes, decoded by the oracle as the gguf package
dequantizes them; the oracle's kqdot within rounding of a float64 sum; every CPU
build's qlinear equal to the oracle bit for bit, its embedding rows the gguf
package's values rounded to bf16, qunpack qpack's inverse, and a tensor-parallel
split by whole super-blocks the bits of one device."""
import numpy as np
import pytest
import torch

from gateeng.plans import reference_ops
from gateeng.plans.kernel_names import REFERENCE_ISAS
from test_quantized import tiny_normal
from tests import oracle

K_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BUILDS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in reference_ops.runnable(),
                                                      reason=f"this CPU cannot run the {isa} build"))
          for isa in REFERENCE_ISAS]


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF rows [n, k/256 * stored bytes] of random bytes, with finite scales of a
    plausible size (d, dmin random binary16 values; row 1's near binary16's smallest)."""
    rng = np.random.default_rng(seed)
    size = oracle.K_QUANTS[kind]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // 256, 2)) * 0.01).astype(np.float16)
    scales[1] *= np.float16(2.0 ** -10)       # subnormal binary16 scales
    at = 208 if kind == "Q6_K" else 0
    raw[..., at:at + (2 if kind == "Q6_K" else 4)] = scales[..., :1 if kind == "Q6_K" else 2].view(np.uint8)
    return np.ascontiguousarray(raw.reshape(n, -1))


@pytest.mark.parametrize("kind", list(K_TYPES))
def test_the_oracles_decoding_is_the_gguf_packages(kind):
    from gguf import GGMLQuantizationType, quants
    raw = random_blocks(kind, 5, 512, seed=1)
    q, scale, mins, sub = oracle.kfields(raw, kind)
    values = np.repeat(scale, sub, -1) * q.astype(np.float32)
    if mins is not None:
        values = values - np.repeat(mins, sub, -1)
    want = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(5, -1)
    assert np.array_equal(values.view(np.uint32), want.astype(np.float32).view(np.uint32))


def exact(x, q, scale, mins, sub):
    """The float64 value of x @ W.T and the sum of the absolute products."""
    xf = oracle.bf(x).astype(np.float64)
    w = np.repeat(scale.astype(np.float64), sub, -1) * q
    if mins is not None:
        w = w - np.repeat(mins.astype(np.float64), sub, -1)
    return xf @ w.T, np.abs(xf) @ np.abs(w).T + (0 if mins is None else
                                                  np.abs(xf) @ np.repeat(np.abs(mins.astype(np.float64)), sub, -1).T)


@pytest.mark.parametrize("kind", list(K_TYPES))
@pytest.mark.parametrize("k", [256, 768, 4608])   # B = 1, 3, 18 super-blocks (lanes of 2)
def test_kqdot_is_the_sum_within_rounding(kind, k):
    rng = np.random.default_rng(k)
    x = oracle.to_bf(rng.standard_normal((3, k)).astype(np.float32) * 3)
    q, scale, mins, sub = oracle.kfields(random_blocks(kind, 7, k, seed=k), kind)
    got = oracle.kqlinear(x, q, scale, mins, sub, f32=True)
    want, absolute = exact(x, q, scale, mins, sub)
    # every path from an input to the result is at most 32 + 2 + 8 * per + 4 + 8 roundings of 2^-24
    bound = (48 + 8 * (k // 256 + 15) // 16) * 2.0 ** -24 * absolute
    assert (np.abs(got - want) <= bound).all()
    assert (np.abs(got - want) > 0).any()   # binary32, not float64


def test_kqdot_subtracts_the_minimums_after_the_scaled_sum():
    """c = (scale*s) - (min*t), t the sub-block's plain sum of x: the sign of the
    minimum's term, on values where no step rounds."""
    k = 256
    x = np.zeros(k, np.float32)
    x[0] = 1.0
    x[2] = 3.0
    q = np.zeros(k, np.int64)
    q[0] = 1
    scale = np.zeros(8, np.float32)
    scale[0] = 2.0 ** 24
    mins = np.zeros(8, np.float32)
    mins[0] = -1.0                                 # t = 4, min*t = -4: c = 2^24 + 4
    got = oracle.kqdot(oracle.to_bf(x), q, scale, mins)
    assert got == np.float32(2.0 ** 24 + 4)
    mins[0] = 1.0                                  # c = 2^24 - 4
    assert oracle.kqdot(oracle.to_bf(x), q, scale, mins) == np.float32(2.0 ** 24 - 4)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("kind", list(K_TYPES))
def test_every_build_multiplies_k_quants_as_the_oracle(kind, isa):
    from gguf import GGMLQuantizationType, quants
    ops = reference_ops.load(isa)
    for n, k, m in ((37, 512, 3), (21, 4608, 2)):
        raw = random_blocks(kind, n, k, seed=n)
        q, scale, mins, sub = oracle.kfields(raw, kind)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        x[0, :7] = 2.0 ** -128                    # denormal inputs: read as zero
        x[1, 256:512] = x[1, :256]                # cancellations across super-blocks
        x[1, 7:9] = 2.0 ** -114                   # the smallest inputs the AVX2 4-bit kernel scales
        packed = ops.qpack(torch.from_numpy(raw), K_TYPES[kind])
        assert ops.qtype(packed) == K_TYPES[kind]
        assert torch.equal(ops.qunpack(packed, n, 0), torch.from_numpy(raw))
        blocks = reference_ops.exact_block_inputs(k, seed=n).split(1)   # each path of the AVX2 one-row tiles
        cases = [(x, True), (x, False), (tiny_normal(x), True)] + [(b, f32) for b in blocks for f32 in (True, False)]
        for x, f32 in cases:
            xb = x.view(torch.int16).numpy().view(np.uint16)
            got = ops.qlinear(x, packed, n, f32)
            want = oracle.kqlinear(xb, q, scale, mins, sub, f32=f32)
            assert np.array_equal(got.view(torch.int32 if f32 else torch.int16).numpy(),
                                  np.asarray(want).view(np.int32 if f32 else np.int16)), (kind, n, k, f32)
            assert torch.equal(got, ops.linear(x, packed, n, f32, 0))
            assert torch.equal(got, ops.qlinear(x, packed, n, f32, True))   # the portable loops
        rows = ops.qrows(packed, torch.arange(n))
        assert np.array_equal(rows.view(torch.int16).numpy(), oracle.kvalues(q, scale, mins, sub).view(np.int16))
        deq = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)).to(torch.bfloat16)
        assert torch.equal(rows, deq)             # the embedding rows: the dequantized file's values


@pytest.mark.parametrize("kind", list(K_TYPES))
def test_a_split_by_whole_super_blocks_gives_the_bits_of_one_device(kind):
    """Rank r of `size` holds lanes r*16/size.. of the whole K's (whole super-blocks),
    packed with the whole K's per; its subtree, combined by the tree, is the whole dot."""
    ops = reference_ops.load()
    n, k = 19, 256 * 33                            # B = 33: per = 3, the last lanes short
    raw = random_blocks(kind, n, k, seed=5)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = ops.qlinear(x, ops.qpack(torch.from_numpy(raw), K_TYPES[kind]), n, True)
    size_bytes, per = oracle.K_QUANTS[kind], 3
    for size in (2, 4, 16):
        parts = []
        for r in range(size):
            first, last = min(33, r * (16 // size) * per), min(33, (r + 1) * (16 // size) * per)
            part = np.ascontiguousarray(raw[:, first * size_bytes:last * size_bytes])
            xs = x[:, first * 256:last * 256].contiguous()
            packed = ops.qpack(torch.from_numpy(part), K_TYPES[kind], per)
            parts.append(ops.linear_partial(xs, packed, n, per, 16 // size))
        combined = ops.combine_partials(torch.stack(parts), True)
        assert torch.equal(combined.view(torch.int32), whole.view(torch.int32)), (kind, size)



def _k_int8():
    from gateeng.plans import cpu_ops
    return getattr(cpu_ops.load(), "qavx2", False)


@pytest.mark.skipif(not _k_int8(), reason="this CPU has no AVX2: the fast plan takes the reference's matmul")
@pytest.mark.parametrize("kind", list(K_TYPES))
def test_the_fast_plans_int8_matmul_on_k_quants_is_row_invariant_and_close_to_the_reference(kind):
    """cpu_ops' qlinear_k_avx2: a row's bits do not depend on the rows beside it, within
    2% of the reference (its inputs quantized to int8 per block of 32), its bf16 output
    its binary32 one rounded."""
    from gateeng.plans import cpu_ops
    kernels, ops = cpu_ops.load(), reference_ops.load()
    raw = torch.from_numpy(random_blocks(kind, 40, 1024, seed=3))
    packed = ops.qpack(raw, K_TYPES[kind])
    x = torch.randn(9, 1024, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = ops.qlinear(x, packed, 40, True)
    many = kernels.qlinear_k_avx2(x, packed, 40, True)
    for r in (0, 4, 8):
        assert torch.equal(kernels.qlinear_k_avx2(x[r:r + 1].contiguous(), packed, 40, True)[0], many[r])
    for rows in (6, 7):   # the tiles of 2 and 3 rows after one of 4
        assert torch.equal(kernels.qlinear_k_avx2(x[:rows].contiguous(), packed, 40, True), many[:rows])
    assert float((many - want).norm()) <= 0.02 * float(want.norm())
    assert torch.equal(kernels.qlinear_k_avx2(x, packed, 40, False), many.to(torch.bfloat16))



@pytest.mark.skipif(not _k_int8(), reason="this CPU has no AVX2: the fast plan takes the reference's matmul")
def test_the_int8_matmul_by_record_is_each_records_own_kernel():
    """cpu_ops' qlinear_int8 (the one-call decode layers' matmul where a model's layers
    mix record types): each packed weight's bits from the int8 kernel of its record."""
    from gguf import GGMLQuantizationType, quants
    from gateeng.plans import cpu_ops
    kernels, ops = cpu_ops.load(), reference_ops.load()
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    own = kernels.qlinear_vnni if kernels.qvnni else kernels.qlinear_avx2
    w = np.random.default_rng(5).standard_normal((24, 512)).astype(np.float32)
    q4_0 = ops.qpack(torch.from_numpy(quants.quantize(w, GGMLQuantizationType.Q4_0).view(np.uint8)), 2)
    cases = [(q4_0, own)] + [(ops.qpack(torch.from_numpy(random_blocks(kind, 24, 512, seed=5)), K_TYPES[kind]),
                              kernels.qlinear_k_avx2) for kind in K_TYPES]
    for packed, kernel in cases:
        for f32 in (True, False):
            assert torch.equal(kernels.qlinear_int8(x, packed, 24, f32), kernel(x, packed, 24, f32))


def _k_vnni() -> bool:
    from gateeng.plans import cpu_ops
    return hasattr(cpu_ops.load(), "qlinear_k_vnni")


@pytest.mark.skipif(not _k_vnni(), reason="this CPU has no AVX-512 VNNI: the fast plan takes qlinear_k_avx2")
@pytest.mark.parametrize("kind", list(K_TYPES))
def test_the_vnni_k_quant_matmul_has_the_avx2_kernels_bits(kind):
    """cpu_ops' qlinear_k_vnni: qlinear_k_avx2's bits, at 1 to 9 rows (tiles of 1 to 4
    rows), binary32 and bf16 out, over a whole K and over a tensor-parallel rank's
    slice of it (packed with the whole K's per), 37 columns (a short column block)."""
    from gateeng.plans import cpu_ops
    kernels, ops = cpu_ops.load(), reference_ops.load()
    n, k, per = 37, 256 * 33, 3                     # B = 33: per = 3, the last lanes short
    raw = random_blocks(kind, n, k, seed=11)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    x[2] *= 2.0 ** -118                             # inputs whose int8 scales are tiny
    size_bytes = oracle.K_QUANTS[kind]
    cases = [(x, ops.qpack(torch.from_numpy(raw), K_TYPES[kind]), 0)]
    for first, last in ((0, 24), (24, 33)):        # rank 0 and 1 of 2: 8 lanes each
        part = np.ascontiguousarray(raw[:, first * size_bytes:last * size_bytes])
        cases.append((x[:, first * 256:last * 256].contiguous(), ops.qpack(torch.from_numpy(part), K_TYPES[kind], per),
                       per))
    for xs, packed, whole_per in cases:
        for rows in (1, 2, 3, 4, 5, 9):
            for f32 in (True, False):
                want = kernels.qlinear_k_avx2(xs[:rows].contiguous(), packed, n, f32, whole_per)
                got = kernels.qlinear_k_vnni(xs[:rows].contiguous(), packed, n, f32, whole_per)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (kind, rows, f32, whole_per)

def kquant_case(kind: str):
    """Raw GGUF rows of a K-quant W [21, 512] (B = 2; row 1's scales binary16 subnormals)
    and x [3, 512]: row 0 with denormal inputs (read as zero), row 1 with a cancellation
    across super-blocks, row 2 near 2^-120, so that sub-block values and sums flush."""
    raw = random_blocks(kind, 21, 512, seed=7)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    x[2] *= 2.0 ** -118
    x = x.to(torch.bfloat16)
    x[0, :7] = 2.0 ** -128
    x[1, 256:512] = x[1, :256]
    return raw, x


@pytest.mark.kernels
@pytest.mark.parametrize("kind", list(K_TYPES))
def test_the_triton_reference_multiplies_k_quants_as_the_cpu_build(kind):
    """triton_reference's qmatmul and qrows on the blocks as the loader splits them
    (gguf_weights.split_blocks), under TRITON_INTERPRET=1: the CPU build's bits on the
    raw GGUF rows (kquant_case; one partly masked column tile, to keep the interpreter
    quick)."""
    from gateeng.kernels import triton_reference as tr
    from gateeng.model.gguf_weights import split_blocks
    ops = reference_ops.load()
    raw, x = kquant_case(kind)
    n, k = raw.shape[0], x.shape[1]
    packed = ops.qpack(torch.from_numpy(raw), K_TYPES[kind])
    b = split_blocks(raw, kind, k).to("cpu")
    for f32 in (True, False):
        got, want = tr.qmatmul(x, b.q, b.d, b.m, f32, b.sc, b.mn), ops.qlinear(x, packed, n, f32)
        view = torch.int32 if f32 else torch.int16
        assert torch.equal(got.view(view), want.view(view)), (kind, f32)
    ids = torch.tensor([1, 0, 20, 1])
    assert torch.equal(tr.qrows(b.q, b.d, b.m, ids, b.sc, b.mn).view(torch.int16),
                       ops.qrows(packed, ids).view(torch.int16))


@pytest.mark.parametrize("kind", list(K_TYPES))
def test_the_k_quant_case_reaches_what_it_tests(kind, monkeypatch):
    """kquant_case's row 2 makes results below 2^-126 (flushing changes the answer)
    beside normal ones; row 1's second super-block repeats its first's inputs."""
    raw, x = kquant_case(kind)
    q, scale, mins, sub = oracle.kfields(raw, kind)
    xb = x.view(torch.int16).numpy().view(np.uint16)
    flushed = oracle.kqlinear(xb, q, scale, mins, sub, f32=True)
    with monkeypatch.context() as mp:
        mp.setattr(oracle, "flush", lambda v: np.asarray(v, np.float32))
        kept = oracle.kqlinear(xb, q, scale, mins, sub, f32=True)
    assert (flushed[2] != kept[2]).any() and (np.abs(flushed[2]) >= 2.0 ** -126).any(), kind
    assert (flushed[:2] != 0).all(), kind
