"""The Triton reference kernels (kernels/triton_reference.py) give ref_ops.cpp's bits,
under TRITON_INTERPRET=1, on random inputs (small shapes: the interpreter is slow)."""
import pytest
import torch

from gateeng.kernels import triton_reference as tr
from gateeng.plans import reference_ops

pytestmark = pytest.mark.kernels


@pytest.fixture(scope="module")
def ops():
    return reference_ops.load()


def randn(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(view), b.contiguous().view(view))


@pytest.mark.parametrize("m,n,k", [(3, 37, 96), (17, 40, 34)])
def test_matmul(ops, m, n, k):
    x, w = randn(m, k, seed=1), randn(n, k, seed=2)
    packed = ops.pack(w)
    assert same(tr.matmul(x, w, f32=True), ops.linear(x, packed, n, True))
    assert same(tr.matmul(x, w), ops.linear(x, packed, n, False))


def test_matmul_flushes_as_the_cpu_does(ops):
    x, w = reference_ops.probe_inputs()
    assert same(tr.matmul(x, w, f32=True), ops.linear(x, ops.pack(w), w.shape[0], True))


def test_rms_norm_and_silu(ops):
    x, w = randn(5, 96, seed=3, scale=4.0), randn(96, seed=4)
    assert same(tr.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5))
    x = randn(3, 70, seed=8)   # an odd pair count: the last block is short
    assert same(tr.rms_norm(x, randn(70, seed=9), 1e-6), ops.rms_norm(x, randn(70, seed=9), 1e-6))
    gate_up = randn(4, 2 * 300, seed=5, scale=30.0)
    assert same(tr.silu_mul(gate_up), ops.silu_mul(gate_up))


def test_exp_and_log(ops):
    special = [0.0, -0.0, 1.0, 88.0, 88.5, -86.0, -86.5, 2.0 ** -130, 1e-30, float("inf"), float("-inf"), 3.4e38]
    x = torch.cat([torch.tensor(special), torch.linspace(-90, 90, 1001),
                   torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 10]).float()
    for which in (0, 1):
        assert same(tr.map_f32(x, bool(which)), ops.map_f32(x, which)), which


@pytest.mark.parametrize("d,block_size", [(32, 16), (16, 4)])
def test_attention_with_chunks_over_blocks(ops, d, block_size):
    hq, hkv, nblocks = 4, 2, 12
    gen = torch.Generator().manual_seed(d)
    k_cache = (torch.randn(nblocks, block_size, hkv, d, generator=gen) * 2).to(torch.bfloat16)
    v_cache = torch.randn(nblocks, block_size, hkv, d, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([1, 17, 40])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(nblocks, generator=gen)[:width] for _ in lens])
    q = randn(3, hq, d, seed=6, scale=3.0)
    assert same(tr.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5),
                ops.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5))


def test_gumbel_noise(ops):
    from gateeng.kernels.fixed_order import row_key
    key = row_key(2 ** 40 + 7, 19)
    assert same(tr.gumbel(key, 3000), ops.gumbel(key, 3000))


def test_the_triton_plan_gives_the_cpu_references_bits():
    """TritonReferencePlan (the CUDA invariant plan of a bf16 model), run on CPU tensors in
    the interpreter: the same hidden states and logits as ReferencePlan, for a prefill of
    two sequences and then a decode step of both."""
    from gateeng.model.llama import KVCache
    from gateeng.plans.gpu import TritonReferencePlan
    from gateeng.plans.reference import ReferencePlan
    from gateeng.plans.rows import Rows
    from tests.tiny import spec_tiny
    model = spec_tiny(head_dim=16).model
    outs = []
    for plan in (ReferencePlan(model, reference_ops.load(), 4), TritonReferencePlan(4)):
        kv = KVCache(model.cfg, 16, 4, torch.bfloat16, "cpu")
        tables = [[3, 7], [5]]
        got = []
        for chunks in ([(list(range(60, 65)), 0), ([9, 200], 0)], [([42], 5), ([7], 2)]):
            rows = Rows([], [], [], [], [])
            for (ids, first), table in zip(chunks, tables):
                start = rows.add_chunk(ids, first, table, 4)
                rows.sample_rows.append(start + len(ids) - 1)
            hidden = plan.hidden(model, kv, rows)
            got += [hidden, plan.full_logits(model, hidden)]
        outs.append(got)
    for cpu, gpu in zip(*outs):
        assert same(gpu, cpu)
