"""Tensor parallelism's arithmetic: a row-parallel projection's ranks, each summing its
slice of K (linear_partial) and combined by the tree (combine_partials), give the
bits of one device, in every reference build this CPU runs, for bf16 and quantized
weights; and the sizes a model admits."""
import pytest
import torch

from gateeng.config import ModelConfig
from gateeng.plans import reference_ops
from gateeng.plans.tp_shapes import QUANT_BLOCK, k_slice, refusal
from tests import oracle
from tests.test_quantized import TYPES, stored
from tests.test_reference import BUILDS, bits, randn, same

SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module", params=BUILDS)
def ops(request):
    return reference_ops.load(request.param)


def sharded(ops, x, w, size, f32):
    """x @ w.T as `size` ranks compute it: each its slice of K, then the combination."""
    partials = []
    for rank in range(size):
        s = k_slice(x.shape[1], size, rank)
        partials.append(ops.linear_partial(x[:, s.start:s.stop], ops.pack(w[:, s.start:s.stop]), w.shape[0],
                                           s.per, s.blocks))
    return ops.combine_partials(torch.stack(partials), f32)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("m,n,k", [(3, 40, 1536), (5, 37, 576), (1, 16, 64), (9, 21, 40)])
def test_ranks_combined_equal_one_device(ops, size, m, n, k):
    # 1536 and 576: SmolLM2's MLP down and attention output K; 40: 20 pairs in blocks of
    # 2, so the last ranks hold fewer pairs than their blocks, or none.
    x, w = randn(m, k, seed=1), randn(n, k, seed=2)
    packed = ops.pack(w)
    for f32 in (True, False):
        assert same(sharded(ops, x, w, size, f32), bits(ops.linear(x, packed, n, f32)))


def quantized_columns(raw: torch.Tensor, k: int, s) -> torch.Tensor:
    """The GGUF rows' blocks of K values [s.start, s.stop)."""
    block = raw.shape[1] // (k // QUANT_BLOCK)
    return raw[:, s.start // QUANT_BLOCK * block: s.stop // QUANT_BLOCK * block].contiguous()


@pytest.mark.parametrize("gguf_type", list(TYPES))
@pytest.mark.parametrize("n,k", [(37, 576), (21, 1536), (16, 64)])
def test_quantized_ranks_combined_equal_one_device(ops, gguf_type, n, k):
    # 576: 18 blocks in lanes of 2, so at 4 ranks and up the last ranks hold fewer
    # blocks, or none; 64: two blocks, one lane each.
    raw = torch.from_numpy(stored(gguf_type, n, k, seed=k)[0])
    ggml = TYPES[gguf_type]
    x = randn(3, k, seed=k, scale=2.0)
    packed = ops.qpack(raw, ggml)
    assert torch.equal(ops.qunpack(packed, n), raw) and ops.qtype(packed) == ggml
    want = {f32: bits(ops.linear(x, packed, n, f32)) for f32 in (True, False)}
    for size in SIZES:
        partials = []
        for rank in range(size):
            s = k_slice(k, size, rank, QUANT_BLOCK)
            mine = quantized_columns(raw, k, s)
            part = ops.qpack(mine, ggml, s.per)   # as model.shard packs it: the whole K's lanes
            assert torch.equal(ops.qunpack(part, n, s.per), mine)
            partials.append(ops.linear_partial(x[:, s.start:s.stop].contiguous(), part, n, s.per, s.blocks))
        for f32 in (True, False):
            assert same(ops.combine_partials(torch.stack(partials), f32), want[f32]), (size, f32)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_returns_its_subtree_as_the_oracle_computes_it(ops, size):
    x, w = randn(4, 96, seed=3, scale=3.0), randn(19, 96, seed=4)
    for rank in range(size):
        s = k_slice(96, size, rank)
        xs, ws = x[:, s.start:s.stop], w[:, s.start:s.stop]
        got = ops.linear_partial(xs, ops.pack(ws), 19, s.per, s.blocks)
        assert same(got, oracle.dot_blocks(bits(xs)[:, None, :], bits(ws)[None, :, :], s.per, s.blocks))


@pytest.mark.parametrize("size", [2, 4, 16])
def test_denormal_probes_combine_to_one_device(ops, size):
    x, w = reference_ops.probe_inputs()
    want = ops.linear(x, ops.pack(w), w.shape[0], True)
    assert same(sharded(ops, x, w, size, True), bits(want))


def test_a_quantized_part_is_multiplied_whole_by_every_matmul_that_reads_it(ops):
    """The fast plan multiplies a rank's part of a quantized weight on its own (then the
    all-reduce): the reference's linear and cpu_ops' int8 matmuls read its lanes."""
    from gateeng.plans import cpu_ops
    kernels = cpu_ops.load()
    raw = torch.from_numpy(stored("Q4_1", 24, 576, seed=3)[0])
    x = randn(5, 576, seed=4)
    s = k_slice(576, 2, 0, QUANT_BLOCK)   # 16 of 18 blocks, in 8 lanes of 2
    mine = quantized_columns(raw, 576, s)
    part, alone = ops.qpack(mine, 3, s.per), ops.qpack(mine, 3)
    xs = x[:, s.start:s.stop].contiguous()
    want = ops.linear(xs, alone, 24, True)
    matmuls = [ops.linear] + [getattr(kernels, f"qlinear_{n}") for n in ("vnni", "avx2") if getattr(kernels, "q" + n)]
    for matmul in matmuls:
        got = matmul(xs, part, 24, True, s.per)
        assert float((got - want).norm()) <= 0.02 * float(want.norm()), matmul   # int8 inputs: ~0.5% off
    # the build's own tiles read the lanes as the spec's plain loops do
    assert torch.equal(ops.linear(xs, part, 24, True, s.per), ops.qlinear(xs, part, 24, True, True, s.per))


def test_partial_refuses_shapes_that_are_not_a_subtree(ops):
    x, w = randn(2, 64, seed=5), randn(16, 64, seed=6)
    packed = ops.pack(w)
    with pytest.raises(RuntimeError, match="power of two"):
        ops.linear_partial(x, packed, 16, 2, 3)
    with pytest.raises(RuntimeError, match="more pairs than its blocks"):
        ops.linear_partial(x, packed, 16, 1, 4)   # 32 pairs in 4 blocks of 1
    with pytest.raises(RuntimeError, match="power of two"):
        ops.combine_partials(torch.zeros(3, 2, 16), True)
    raw = torch.from_numpy(stored("Q8_0", 16, 256, seed=7)[0])   # 8 blocks
    part = ops.qpack(raw, TYPES["Q8_0"], 2)                       # in lanes of 2
    with pytest.raises(RuntimeError, match="does not fit in 2 lanes of 2 blocks"):
        ops.linear_partial(randn(2, 256, seed=8), part, 16, 2, 2)
    with pytest.raises(RuntimeError, match="per must be at least 0"):
        ops.qpack(raw, TYPES["Q8_0"], -1)


def test_k_slices_tile_k_and_split_evenly_on_whole_blocks():
    for k in (40, 64, 576, 1536, 2):
        for size in SIZES:
            slices = [k_slice(k, size, r) for r in range(size)]
            assert slices[0].start == 0 and slices[-1].stop == k
            assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))
            if k % 32 == 0:
                assert [s.stop - s.start for s in slices] == [k // size] * size
    for k in (64, 576, 1536, 5632):   # a quantized weight's K, in GGUF blocks of 32
        for size in SIZES:
            slices = [k_slice(k, size, r, QUANT_BLOCK) for r in range(size)]
            assert slices[0].start == 0 and slices[-1].stop == k
            assert all(a.stop == b.start and a.stop % QUANT_BLOCK == 0 for a, b in zip(slices, slices[1:]))
            if k % (16 * QUANT_BLOCK) == 0:   # whole lanes of whole blocks: the even split, as for bf16
                assert [s[:2] for s in slices] == [(r * k // size, (r + 1) * k // size) for r in range(size)]
    with pytest.raises(ValueError):
        k_slice(64, 3, 0)


def smollm2(**changes) -> ModelConfig:
    fields = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, architecture="llama")
    return ModelConfig(**{**fields, **changes})


def test_sizes_a_model_admits():
    llama3_8b = smollm2(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128)
    # 8 KV heads over 16 ranks: attention whole on every rank (model.shard), not refused.
    assert all(refusal(llama3_8b, size) is None for size in (1, 2, 4, 8, 16))
    # SmolLM2-135M: 9 heads (3 KV heads) split over no size but 1, its MLP and o over all.
    assert all(refusal(smollm2(), size) is None for size in (1, 2, 4, 8, 16))
    assert "1000 MLP columns" in refusal(smollm2(intermediate_size=1000), 16)
    assert "power of two" in refusal(smollm2(), 3)
    assert "power of two" in refusal(smollm2(), 32)
    odd_k = smollm2(num_heads=8, num_kv_heads=4, head_dim=50)
    assert "K = 400 is not a multiple of 32" in refusal(odd_k, 2)

