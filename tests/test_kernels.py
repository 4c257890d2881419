"""Triton kernels under TRITON_INTERPRET=1: correctness against float64 references
(relative norm error) and bitwise batch invariance. Fresh random inputs for every
check, outputs poisoned with NaN before each run."""
import pytest
import torch

from gateeng.kernels import fixed_order as ref

triton = pytest.importorskip("triton")
from gateeng.kernels import triton_attention, triton_matmul, triton_rmsnorm, triton_sampling  # noqa: E402

pytestmark = pytest.mark.kernels
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
gen = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def rel_err(got, want):
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite output"
    return ((got - want).norm() / want.norm()).item()


def poisoned(fn):
    """Run fn with torch.empty returning NaN-filled memory, so unwritten outputs fail."""
    real = torch.empty

    def nan_empty(*a, **k):
        t = real(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)
    real_like = torch.empty_like
    torch.empty = nan_empty
    torch.empty_like = lambda t, **k: nan_empty(t.shape, dtype=k.get("dtype", t.dtype), device=t.device)
    try:
        return fn()
    finally:
        torch.empty, torch.empty_like = real, real_like


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_correct(dtype, bias):
    x, w = rand(37, 96, dtype=dtype), rand(160, 96, dtype=dtype)
    b = rand(160, dtype=dtype) if bias else None
    got = poisoned(lambda: triton_matmul.matmul(x, w, b))
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_batch_invariant(dtype):
    x, w = rand(70, 96, dtype=dtype), rand(130, 96, dtype=dtype)
    full = triton_matmul.matmul(x, w)
    assert torch.equal(triton_matmul.matmul(x[:1], w), full[:1])
    perm = torch.randperm(70, generator=gen)
    assert torch.equal(triton_matmul.matmul(x[perm], w), full[perm])
    other = torch.cat([rand(40, 96, dtype=dtype), x[5:6]])
    assert torch.equal(triton_matmul.matmul(other, w)[-1], full[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_correct_and_invariant(dtype):
    x, w = rand(9, 1500, dtype=dtype), rand(1500, dtype=dtype)
    got = poisoned(lambda: triton_rmsnorm.rms_norm(x, w, 1e-5))
    xd = x.double()
    want = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel_err(got, want) < TOL[dtype]
    assert torch.equal(triton_rmsnorm.rms_norm(x[3:4], w, 1e-5)[0], got[3])
    assert torch.equal(triton_rmsnorm.rms_norm(x.flip(0), w, 1e-5), got.flip(0))


PAGE, SPLIT, HKV, H, D = 4, 8, 2, 4, 16


def paged(length, dtype, nblocks=40):
    """One sequence's K/V scattered over random pages of a fresh cache."""
    k_cache, v_cache = rand(nblocks, PAGE, HKV, D, dtype=dtype), rand(nblocks, PAGE, HKV, D, dtype=dtype)
    pages = (torch.randperm(nblocks - 1, generator=gen) + 1)[: -(-length // PAGE)]
    slots = (pages[:, None] * PAGE + torch.arange(PAGE)).view(-1)[:length]
    k = k_cache.view(-1, HKV, D)[slots]
    v = v_cache.view(-1, HKV, D)[slots]
    return k_cache, v_cache, pages, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [3, 8, 9, 29])   # 1, 1, 2 and 4 splits
def test_attention_correct(dtype, length):
    k_cache, v_cache, pages, k, v = paged(length, dtype)
    pos = torch.arange(length)
    q = rand(length, H, D, dtype=dtype)
    tables = pages[None].expand(length, -1)
    got = poisoned(lambda: triton_attention.split_attention(q, k_cache, v_cache, tables, pos, SPLIT, D ** -0.5))
    want = ref.attention_float64(q, k, v, pos, D ** -0.5)
    assert rel_err(got, want) < TOL[dtype]
    cpu = ref.split_attention(q, k_cache, v_cache, tables, pos, SPLIT, D ** -0.5)
    assert rel_err(cpu, want) < TOL[dtype]


def test_attention_batch_invariant():
    dtype = torch.bfloat16
    length = 27
    k_cache, v_cache, pages, _, _ = paged(length, dtype)
    q = rand(length, H, D, dtype=dtype)
    pos = torch.arange(length)
    tables = pages[None].expand(length, -1)
    many = triton_attention.split_attention(q, k_cache, v_cache, tables, pos, SPLIT, 0.25)
    # 1 query vs many, at several split counts
    for p in (0, 7, 8, 20, 26):
        one = triton_attention.split_attention(q[p:p + 1], k_cache, v_cache, tables[:1], pos[p:p + 1], SPLIT, 0.25)
        assert torch.equal(one[0], many[p]), p
    # row moved, among rows of another sequence
    k2, v2, pages2, _, _ = paged(15, dtype)
    perm = torch.randperm(length, generator=gen)
    assert torch.equal(triton_attention.split_attention(q[perm], k_cache, v_cache, tables[perm], pos[perm],
                                                        SPLIT, 0.25), many[perm])
    # cached vs uncached prefix: the same KV in other physical pages gives the same bits
    k_fresh, v_fresh = k_cache.clone(), v_cache.clone()
    moved = pages.clone()
    free = [b for b in range(1, 40) if b not in set(pages.tolist())]
    for i in range(3):   # first three pages "recomputed" into fresh pages
        k_fresh[free[i]] = k_cache[pages[i]]
        v_fresh[free[i]] = v_cache[pages[i]]
        moved[i] = free[i]
    again = triton_attention.split_attention(q, k_fresh, v_fresh, moved[None].expand(length, -1), pos, SPLIT, 0.25)
    assert torch.equal(again, many)


def test_sampling_greedy_matches_reference_and_ties():
    logits = rand(6, 3000)
    logits[2, 10] = logits[2, 2000] = logits[2].max() + 1   # tie across chunks
    tok, mar = poisoned(lambda: triton_sampling.sample(logits, [0.0] * 6, [0] * 6, [0] * 6))
    want_tok, want_mar = ref.argmax_margin(logits)
    assert torch.equal(tok, want_tok) and torch.equal(mar, want_mar)
    assert tok[2] == 10 and mar[2] == 0
    t1, m1 = triton_sampling.sample(logits[4:5], [0.0], [0], [0])
    assert t1[0] == tok[4] and m1[0] == mar[4]


def test_sampling_seeded_matches_cpu_hash():
    logits = rand(4, 2500)
    seeds, positions = [1, 2, 3, 2 ** 40 + 5], [0, 17, 17, 99]
    tok, mar = triton_sampling.sample(logits, [0.8] * 4, seeds, positions)
    for i in range(4):
        scores = logits[i] / 0.8 + ref.gumbel_noise(seeds[i], positions[i], 2500)
        t, m = ref.argmax_margin(scores)
        assert tok[i] == t
        assert abs(mar[i] - m) < 1e-5
    again, _ = triton_sampling.sample(logits[[3, 0]], [0.8] * 2, [seeds[3], seeds[0]], [positions[3], positions[0]])
    assert again.tolist() == [tok[3], tok[0]]
