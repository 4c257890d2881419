"""The fast plan's fused CPU kernels against the torch ops they replace."""
import math

import pytest
import torch

from gateeng import cpu_ops
from gateeng.kernels import reference as ref


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
