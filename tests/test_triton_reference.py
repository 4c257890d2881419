"""The Triton reference kernels (kernels/triton_reference.py) give ref_ops.cpp's bits,
under TRITON_INTERPRET=1, on random inputs (small shapes: the interpreter is slow)."""
import pytest
import torch

from gateeng.kernels import triton_reference as tr
from gateeng.plans import packing, reference_ops
from gateeng.plans.kernel_names import REFERENCE

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


def two_steps(model, plan):
    """The hidden states of a prefill of two sequences, then of a decode step of both."""
    from gateeng.model.llama import KVCache
    from gateeng.plans.rows import Rows
    kv = KVCache(model.cfg, 16, 4, torch.bfloat16, "cpu")
    tables = [[3, 7], [5]]
    got = []
    for chunks in ([(list(range(60, 65)), 0), ([9, 200], 0)], [([42], 5), ([7], 2)]):
        rows = Rows([], [], [], [], [])
        for (ids, first), table in zip(chunks, tables):
            start = rows.add_chunk(ids, first, table, 4)
            rows.sample_rows.append(start + len(ids) - 1)
        got.append(plan.hidden(model, kv, rows))
    return got


def test_the_triton_plan_gives_the_cpu_references_bits():
    """TritonReferencePlan (the CUDA invariant plan of a bf16 model), run on CPU tensors in
    the interpreter: the same hidden states and logits as ReferencePlan, for a prefill of
    two sequences and then a decode step of both."""
    from gateeng.plans.gpu import TritonReferencePlan
    from gateeng.plans.reference import ReferencePlan
    from tests.tiny import spec_tiny
    model = spec_tiny(head_dim=16, layers=1).model      # every kernel runs in one layer
    outs = []
    for plan in (ReferencePlan(model, reference_ops.load(), 4), TritonReferencePlan(4)):
        outs.append([out for hidden in two_steps(model, plan) for out in (hidden, plan.full_logits(model, hidden))])
    for cpu, gpu in zip(*outs):
        assert same(gpu, cpu)


@pytest.mark.parametrize("qtype,tie", [("Q4_0", False), ({"token_embd.weight": "Q8_0", "*": "Q4_1"}, True)])
def test_the_triton_plan_serves_a_quantized_gguf_as_the_cpu_reference(tmp_path, qtype, tie):
    """A GGUF served as stored: its quantized weights kept as the Triton reference reads
    them (load_gguf(blocks_on=...)) give ReferencePlan's bits on the CPU reference's
    packed copy, the quantized embedding looked up and the lm_head multiplied as stored
    (the interpreter multiplies only the lm_head's first 96 rows: each logit is its own
    row's)."""
    from gateeng.model.loader import load_gguf
    from gateeng.plans.gpu import TritonReferencePlan
    from gateeng.plans.reference import ReferencePlan
    from tests.tiny_gguf import write_tiny_gguf
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype, tie=tie, layers=1)["path"]
    cpu, blocks = load_gguf(path), load_gguf(path, blocks_on="cpu")
    assert packing.quantized(blocks.model) and not packing.of(blocks.model).shared
    assert cpu.fingerprint == blocks.fingerprint
    ref, tri = ReferencePlan(cpu.model, reference_ops.load(), 4), TritonReferencePlan(4, blocks.model)
    assert tri.describe() == ref.describe() != REFERENCE   # "gateeng-ref-1 (... weights)"
    want, got = two_steps(cpu.model, ref), two_steps(blocks.model, tri)
    stored = packing.of(blocks.model)
    stored.blocks[id(blocks.model.lm_head)] = stored.blocks[id(blocks.model.lm_head)].rows(96)
    for a, b in zip(want, got):
        assert same(b, a)
        assert same(tri.full_logits(blocks.model, b), ref.full_logits(cpu.model, a)[:, :96])


def test_the_triton_reference_multiplies_a_stack_of_two_types_part_by_part(tmp_path):
    """A stack of two types as in llama.cpp's Q4_K_M (q and k in Q4_K, v in Q6_K; the
    rest in Q8_0, quick to write): the Triton reference keeps q, k and v as two runs of
    blocks (packing.StackedBlocks) with the file's fingerprint, and their product is the
    CPU reference's bit for bit."""
    from gateeng.model.loader import load_gguf
    from gateeng.plans.gpu import TritonReferencePlan
    from gateeng.plans.reference import ReferencePlan
    from tests.tiny_gguf import write_tiny_gguf
    mix = {"blk.*.attn_v.weight": "Q6_K", "blk.*.attn_[qk].weight": "Q4_K", "*": "Q8_0"}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", mix, tie=False, layers=1, hidden=256, heads=2, kv_heads=1,
                           head_dim=32, intermediate=256)["path"]   # q, k, v: 64 + 32 + 32 rows
    cpu, blocks = load_gguf(path), load_gguf(path, blocks_on="cpu")
    assert cpu.fingerprint == blocks.fingerprint
    w = blocks.model.layers[0].qkv
    assert [b.q.shape[0] for b in packing.block_parts(packing.of(blocks.model).blocks[id(w)])] == [64 + 32, 32]
    ref, tri = ReferencePlan(cpu.model, reference_ops.load(), 4), TritonReferencePlan(4, blocks.model)
    x = randn(3, 256, seed=12)
    assert same(tri.linear(x, w), ref.linear(x, cpu.model.layers[0].qkv))


# ---- quantized weights (SPEC.md, "Quantized weights"): against the numpy oracle ------

def quant_inputs(kind: str, m: int, n: int, k: int, seed: int, case: str = "plain"):
    """Random x (bf16 bits) and a Q8_0-, Q4_0- or Q4_1-shaped W (q int8 [n, k], d and m
    float16 [n, k/32]) as numpy arrays. case "tiny": x and the scales so small that block
    values and sums fall below 2^-126 (and some x are bf16 denormals); "cancel": block 1
    is block 0 with its scale (and min) negated, and in half the rows both sum to 0."""
    import numpy as np
    rng = np.random.default_rng(seed)
    nb = k // 32
    lo, hi = {"Q8_0": (-128, 128), "Q4_0": (-8, 8), "Q4_1": (0, 16)}[kind]
    q = rng.integers(lo, hi, (n, k)).astype(np.int8)
    xs = rng.standard_normal((m, k)).astype(np.float32)
    d = rng.standard_normal((n, nb)) * 0.02
    mins = rng.standard_normal((n, nb)) * 0.1 if kind == "Q4_1" else None
    if case == "tiny":   # rows near 2^-112, 2^-124 and 2^-106; columns' scales 2^-24..2^-4
        xs = xs * np.exp2(np.array([[-112], [-124], [-106]])[:m] + rng.integers(-4, 5, (m, k))).astype(np.float32)
        d = d * np.exp2(rng.integers(-22, -4, (n, 1)) + rng.integers(-2, 3, (n, nb)))
        if mins is not None:
            mins = mins * np.exp2(rng.integers(-22, -4, (n, 1)) + rng.integers(-2, 3, (n, nb)))
    else:   # exponents spread over 2^-12..2^12: a block's sums are inexact, so their order shows
        xs = xs * np.exp2(rng.integers(-12, 13, (m, k))).astype(np.float32)
    d = d.astype(np.float16)
    mins = None if mins is None else mins.astype(np.float16)
    if case == "cancel":
        half = slice(0, n, 2)
        if kind == "Q4_1":   # s = 4t exactly, and m = -4d: c = d*s + m*t = 0
            q[half, :32] = 4
            mins[half, 0] = -4 * d[half, 0]
        else:                # each pair's odd product cancels its even one: s = 0
            xs[:, 1:32:2] = xs[:, 0:32:2]
            q[half, 1:32:2] = -np.clip(q[half, 0:32:2], -127, 127)
        xs[:, 32:64], q[:, 32:64], d[:, 1] = xs[:, :32], q[:, :32], -d[:, 0]
        if mins is not None:
            mins[:, 1] = -mins[:, 0]
    x = torch.from_numpy(xs).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return x, q, d, mins


def run_qmatmul(x, q, d, mins, f32):
    return tr.qmatmul(torch.from_numpy(x.view("int16")).view(torch.bfloat16), torch.from_numpy(q),
                      torch.from_numpy(d), None if mins is None else torch.from_numpy(mins), f32=f32)


def oracle_qlinear(x, q, d, mins, f32):
    from tests import oracle
    out = oracle.qlinear(x, q, d, mins, f32=f32)
    return torch.from_numpy(out) if f32 else torch.from_numpy(out.view("int16")).view(torch.bfloat16)


@pytest.mark.parametrize("kind,m,k", [("Q8_0", 1, 64), ("Q8_0", 3, 96), ("Q8_0", 3, 576),
                                      ("Q4_0", 3, 64), ("Q4_0", 1, 96), ("Q4_0", 3, 576),
                                      ("Q4_1", 3, 64), ("Q4_1", 3, 96), ("Q4_1", 1, 576)])
@pytest.mark.parametrize("case", ["plain", "tiny", "cancel"])
def test_qmatmul_gives_the_oracles_bits(kind, m, k, case):
    """B = 2, 3 and 18 blocks (18: lanes of 2 blocks, the last 7 lanes empty), N = 37 (two
    column tiles, the second partly masked) or 21 (K = 576, to keep the interpreter
    quick), M = 1 and 3; the bf16 outputs on the plain inputs (their rounding is
    matmul's), the binary32 sums on all."""
    x, q, d, mins = quant_inputs(kind, m, 21 if k > 96 else 37, k, seed=k + m, case=case)
    for f32 in (True, False) if case == "plain" else (True,):
        assert same(run_qmatmul(x, q, d, mins, f32), oracle_qlinear(x, q, d, mins, f32)), (kind, case, f32)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_qmatmul_flushes_an_exact_denormal(kind):
    """SPEC.md's unchecked corner, on purpose: a block chain's step whose exact result is
    a denormal (1.5*2^-126 - 2^-126, no rounding) is flushed by the rule, here and in the
    oracle, so the block sum (and t) is 2^-120 and not 2^-120 + 2^-127."""
    import numpy as np
    x = np.zeros((1, 64), np.float32)
    x[0, :4] = [-(2.0 ** -126), 1.5 * 2.0 ** -126, 0.0, 2.0 ** -120]
    q = np.zeros((3, 64), np.int8)
    q[:, :4] = [[1, 1, 0, 1], [1, 2, 0, 1], [3, 2, 0, 1]]   # rows 1 and 2: no denormal step
    d = np.ones((3, 2), np.float16)
    mins = np.ones((3, 2), np.float16) if kind == "Q4_1" else None   # t: the same steps
    x = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = run_qmatmul(x, q, d, mins, True)
    assert same(got, oracle_qlinear(x, q, d, mins, True))
    assert got[0, 0] == (2.0 ** -119 if kind == "Q4_1" else 2.0 ** -120)   # d*s (+ m*t)


def test_quant_cases_reach_what_they_test(monkeypatch):
    """The "tiny" inputs make results below 2^-126 (flushing changes the answer) and the
    "cancel" inputs make exact zeros out of nonzero block values."""
    import numpy as np
    from tests import oracle
    for kind in ("Q4_0", "Q4_1"):
        x, q, d, mins = quant_inputs(kind, 3, 37, 64, seed=67, case="tiny")   # as the test above
        flushed = oracle.qlinear(x, q, d, mins, f32=True)
        with monkeypatch.context() as mp:
            mp.setattr(oracle, "flush", lambda v: np.asarray(v, np.float32))
            kept = oracle.qlinear(x, q, d, mins, f32=True)
        assert (flushed != kept).sum() > 30, kind                       # flushed parts
        assert ((flushed == 0) & (np.abs(kept) < 2.0 ** -126) & (kept != 0)).any(), kind   # a flushed result
        assert (np.abs(flushed) > 2.0 ** -120).any(), kind               # and normal ones
        x, q, d, mins = quant_inputs(kind, 1, 8, 64, seed=99, case="cancel")   # B = 2: c0 + c1 = 0
        assert (oracle.qlinear(x, q, d, mins, f32=True) == 0).all(), kind
