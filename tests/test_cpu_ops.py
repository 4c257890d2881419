"""The fast plan's fused CPU kernels against the torch ops they replace."""
import math

import pytest
import torch

from gateeng.plans import cpu_ops
from gateeng.kernels import fixed_order as ref


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    if module is None:
        pytest.skip("the CPU kernels could not be built here (a C++ compiler is needed; see the log)")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_reference(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    got, want = ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    # bf16: the normalized row is rounded before the weight multiplies it, as in the
    # reference, so the float32 sum's order rarely changes a bit.
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def _gathered_attention(q, k_cache, v_cache, tables, lens, scale):
    """Each row's keys gathered, float32 softmax attention: what the kernel must equal."""
    nb, bs, hkv, d = k_cache.shape
    hq = q.shape[1]
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = (tables[b][:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
        k = k_cache.reshape(-1, hkv, d)[slots].float()
        v = v_cache.reshape(-1, hkv, d)[slots].float()
        s = torch.einsum("hgd,lhd->hgl", q[b].float().view(hkv, hq // hkv, d), k) * scale
        out.append(torch.einsum("hgl,lhd->hgd", s.softmax(-1), v).reshape(hq, d))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 24])   # 64 and 128 are specialized, others generic
def test_decode_attention_reads_the_paged_cache_like_a_gather(ops, dtype, head_dim):
    gen = torch.Generator().manual_seed(1)
    nb, bs, hq, hkv = 30, 16, 6, 2
    k_cache = torch.randn(nb, bs, hkv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([1, 15, 16, 17, 64, 80])   # one key, block edges, several blocks
    tables = torch.stack([torch.randperm(nb, generator=gen)[:5] for _ in lens])
    q = (torch.randn(len(lens), hq, head_dim, generator=gen) * 2).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    got = ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)
    want = _gathered_attention(q, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7   # bf16: the output's rounding
    assert torch.allclose(got.float(), want, rtol=tol, atol=tol)


def test_decode_attention_refuses_tables_that_leave_the_cache(ops):
    k = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="names block 9 of 4"):
        ops.decode_attention(q, k, k, torch.tensor([[9]]), torch.tensor([3]), 0.125)
    with pytest.raises(RuntimeError, match="outside its block table"):
        ops.decode_attention(q, k, k, torch.tensor([[0]]), torch.tensor([17]), 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(ops, dtype):
    gen = torch.Generator().manual_seed(2)
    h = (torch.randn(19, 576, generator=gen) * 3).to(dtype)
    add = torch.randn(19, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    got_h, got_x = ops.add_rms_norm(h, add, w, 1e-5)
    assert torch.equal(got_h, h + add)   # the add rounds as torch's does
    assert torch.equal(got_x, ops.rms_norm(h + add, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_the_torch_ops(ops, dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(13, 2 * 1536, generator=gen) * 4).to(dtype)
    got, want = ops.silu_mul(gate_up), ref.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    # bf16: the silu may round one step apart, and the product rounds again
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_and_stores_like_the_torch_ops(ops, dtype):
    gen = torch.Generator().manual_seed(4)
    rows, hq, hkv, d, nb, bs = 11, 6, 2, 64, 8, 4
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    angle = torch.rand(rows, d, generator=gen) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:rows]
    slots[3] = -1   # a padding row stores nothing
    k_cache, v_cache = torch.zeros(nb, bs, hkv, d, dtype=dtype), torch.zeros(nb, bs, hkv, d, dtype=dtype)
    q = ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, hq)
    qk = ref.rope(qkv[:, :(hq + hkv) * d].reshape(rows, hq + hkv, d), cos[:, None], sin[:, None])
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    real = slots >= 0
    want_k.view(-1, hkv, d)[slots[real]] = qk[real, hq:]
    want_v.view(-1, hkv, d)[slots[real]] = qkv[real, (hq + hkv) * d:].reshape(-1, hkv, d)
    if dtype == torch.bfloat16:   # each product and the sum rounded as the torch ops round them
        assert torch.equal(q, qk[:, :hq]) and torch.equal(k_cache, want_k)
    else:   # float32: the compiler may fuse a product into the add
        assert torch.allclose(q, qk[:, :hq], atol=1e-6) and torch.allclose(k_cache, want_k, atol=1e-6)
    assert torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="names slot 32 of 32"):
        ops.rope_store(qkv, cos, sin, k_cache, v_cache, torch.full((rows,), nb * bs), hq)


@pytest.fixture(scope="module")
def dpbf16(ops):
    """(pack, linear) of the VDPBF16PS matmul, which reads the reference's packed layout,
    or skip where this CPU lacks it."""
    if not ops.dpbf16:
        pytest.skip("this CPU lacks AVX-512 BF16 (the VDPBF16PS matmul)")
    from gateeng.plans import reference_ops
    return reference_ops.load().pack, ops.linear_dpbf16


@pytest.mark.parametrize("n, k, m", [(960, 576, 1), (577, 576, 5), (3072, 576, 13), (33, 64, 40)])
def test_rowwise_linear_is_x_times_w_transposed(dpbf16, n, k, m):
    pack, linear = dpbf16
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    got = linear(x, pack(w), n)
    want = x.float() @ w.float().T
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # float32 sums of exact products, one bf16 rounding of the output
    assert torch.allclose(got.float(), want, rtol=2 ** -7, atol=1e-3 * float(want.abs().max()))


def test_rowwise_linear_gives_a_row_the_same_bits_at_any_row_count(dpbf16):
    pack, linear = dpbf16
    gen = torch.Generator().manual_seed(6)
    w = pack(torch.randn(200, 96, generator=gen).to(torch.bfloat16))
    x = torch.randn(37, 96, generator=gen).to(torch.bfloat16)
    full = linear(x, w, 200)
    for rows in (slice(5, 6), slice(0, 9), slice(20, 37)):   # alone, a whole tile, a partial tile
        assert torch.equal(linear(x[rows], w, 200), full[rows])
