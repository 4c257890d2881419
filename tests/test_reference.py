"""The reference (gateeng-ref-1): every build this machine runs gives the bits of the
oracle (tests/oracle.py, the spec in numpy), op by op and for whole decodes."""
import numpy as np
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.plans import reference_ops
from gateeng.plans.kernel_names import ISA_ENV, REFERENCE, REFERENCE_ISAS
from gateeng.request import SamplingParams
from tests import oracle
from tests.tiny import spec_tiny

BUILDS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in reference_ops.runnable(),
                                                      reason=f"this CPU cannot run the {isa} build"))
          for isa in REFERENCE_ISAS]


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's bits as the oracle takes them: bf16 as uint16, float32 as float32."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()


def same(got: torch.Tensor, want: np.ndarray) -> bool:
    got = bits(got)
    if got.dtype == np.float32:
        return np.array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))
    return np.array_equal(got, want)


def randn(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@pytest.fixture(scope="module", params=BUILDS)
def ops(request):
    return reference_ops.load(request.param)


def test_the_build_is_the_one_asked_for(ops):
    assert ops.isa in REFERENCE_ISAS


@pytest.mark.parametrize("m,n,k", [(5, 37, 96), (1, 16, 2), (3, 50, 576), (9, 21, 40)])
def test_matmul_equals_the_oracle(ops, m, n, k):
    x, w = randn(m, k, seed=1), randn(n, k, seed=2)
    packed = ops.pack(w)
    want = oracle.linear(bits(x), bits(w), f32=True)
    assert same(ops.linear(x, packed, n, True), want)
    assert same(ops.linear(x, packed, n, False), oracle.to_bf(want))


def test_matmul_flushes_denormals_as_the_spec_says(ops):
    x, w = reference_ops.probe_inputs()
    want = oracle.linear(bits(x), bits(w), f32=True)
    got = ops.linear(x, ops.pack(w), w.shape[0], True)
    assert same(got, want)
    assert (got == 0).any()   # some probe rows cancel or flush to exactly zero


def test_norms_adds_and_silu_equal_the_oracle(ops):
    x, h, w = randn(7, 96, seed=3, scale=4.0), randn(7, 96, seed=4), randn(96, seed=5)
    assert same(ops.rms_norm(x, w, 1e-5), oracle.rms_norm(bits(x), bits(w), 1e-5))
    h_out, x_out = ops.add_rms_norm(h, x, w, 1e-6)
    want_h = oracle.add(bits(h), bits(x))
    assert same(h_out, want_h) and same(x_out, oracle.rms_norm(want_h, bits(w), 1e-6))
    assert same(ops.add(x, w), oracle.add(bits(x), bits(w)[None, :]))
    gate_up = randn(5, 2 * 70, seed=6, scale=30.0)   # exp over its whole range, infinities included
    assert same(ops.silu_mul(gate_up), oracle.silu_mul(bits(gate_up)))


def test_rope_and_the_kv_store_equal_the_oracle(ops):
    hq, hkv, d, rows = 4, 2, 32, 5
    qkv = randn(rows, (hq + 2 * hkv) * d, seed=7)
    inv = oracle.inv_freq(10000.0, d)
    tables = [oracle.rope_row(p, inv) for p in (0, 3, 17, 200, 4000)]
    cos = torch.from_numpy(np.stack([c for c, s in tables]).view(np.int16)).view(torch.bfloat16)
    sin = torch.from_numpy(np.stack([s for c, s in tables]).view(np.int16)).view(torch.bfloat16)
    k_cache = torch.zeros(4, 4, hkv, d, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, -1, 0, 15, 8])
    q = ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, hq)
    x = bits(qkv)
    c, s = bits(cos)[:, None, :], bits(sin)[:, None, :]
    assert same(q, oracle.rope(x[:, :hq * d].reshape(rows, hq, d), c, s))
    want_k = oracle.rope(x[:, hq * d:(hq + hkv) * d].reshape(rows, hkv, d), c, s)
    flat_k, flat_v = bits(k_cache).reshape(16, hkv, d), bits(v_cache).reshape(16, hkv, d)
    for r, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert np.array_equal(flat_k[slot], want_k[r])
            assert np.array_equal(flat_v[slot], x[r, (hq + hkv) * d:].reshape(hkv, d))
    assert not flat_k[[1, 2]].any()   # the padding row (-1) stored nothing


@pytest.mark.parametrize("d,block_size", [(32, 16), (32, 4), (16, 32), (64, 8)])
def test_attention_equals_the_oracle_whatever_the_kv_block_size(ops, d, block_size):
    hq, hkv, nblocks = 6, 2, 24
    gen = torch.Generator().manual_seed(d + block_size)
    k_cache = (torch.randn(nblocks, block_size, hkv, d, generator=gen) * 2).to(torch.bfloat16)
    v_cache = torch.randn(nblocks, block_size, hkv, d, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([1, 15, 16, 17, 40, 70][: 6 if nblocks * block_size >= 70 else 4])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(nblocks, generator=gen)[:width] for _ in lens])
    q = randn(len(lens), hq, d, seed=9, scale=3.0)
    got = bits(ops.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5))
    kb, vb, qb = bits(k_cache), bits(v_cache), bits(q)
    for r, n in enumerate(lens.tolist()):
        slots = [(int(tables[r, p // block_size]), p % block_size) for p in range(n)]
        keys = np.stack([kb[b, o] for b, o in slots])
        values = np.stack([vb[b, o] for b, o in slots])
        for head in range(hq):
            want = oracle.attention(qb[r, head], keys[:, head // (hq // hkv)], values[:, head // (hq // hkv)],
                                    d ** -0.5)
            assert np.array_equal(got[r, head], want), (r, head)


def test_exp_log_and_sums_equal_the_oracle(ops):
    special = [0.0, -0.0, 1.0, -1.0, 88.0, 88.5, -86.0, -86.5, -87.4, 2.0 ** -130, -(2.0 ** -127), 1e-30,
               float("inf"), float("-inf"), float("nan"), 0.5, 3.4e38, 0.6931471805599453]
    x = torch.cat([torch.tensor(special), torch.linspace(-90, 90, 2001),
                   torch.randn(3000, generator=torch.Generator().manual_seed(1)) * 10]).float()
    for which, fn in ((0, oracle.exp), (1, oracle.log)):
        got, want = bits(ops.map_f32(x, which)), fn(x.numpy())
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = ~np.isnan(want)
        assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32)), which
    for n in (1, 5, 16, 17, 100, 4099):
        v = torch.randn(n, generator=torch.Generator().manual_seed(n)).float()
        assert same(ops.sum_f32(v).reshape(1), oracle.fsum(v.numpy())[None])


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 20, 1.0), (0.9, 0, 0.8),
                                                     (1.0, 50, 0.5)])
def test_token_choice_equals_the_oracle(ops, temperature, top_k, top_p):
    z = (torch.randn(300, generator=torch.Generator().manual_seed(top_k)) * 4).float()
    z[7] = z[11] = z.max() + 1   # a tie: the lowest id wins
    s = ops.sample_scores(z, temperature, top_k, top_p)
    want = oracle.sample_scores(z.numpy(), temperature, top_k, top_p)
    assert same(s, want)
    key = oracle.row_key(2 ** 40 + 12345, 17)
    g = ops.gumbel(key, 300)
    assert same(g, oracle.gumbel(key, 300))
    noisy = ops.add_f32(s, g)
    tok, margin = ops.argmax_margin(noisy[None])
    want_tok, want_margin = oracle.argmax_margin(oracle.flush(want + oracle.gumbel(key, 300)))
    assert int(tok[0]) == want_tok and np.float32(margin[0]) == np.float32(want_margin)
    assert same(ops.log_softmax(s), oracle.log_softmax(want))
    tok, margin = ops.argmax_margin(z[None])
    assert int(tok[0]) == 7 and float(margin[0]) == 0.0


def test_every_build_gives_the_same_bits_at_smollm_shapes():
    x, w = randn(33, 576, seed=11), randn(1536, 576, seed=12)
    outs = {isa: reference_ops.load(isa).linear(x, reference_ops.load(isa).pack(w), 1536, True)
            for isa in reference_ops.runnable()}
    first = next(iter(outs.values()))
    assert all(torch.equal(o.view(torch.int32), first.view(torch.int32)) for o in outs.values()), list(outs)


def test_a_build_this_cpu_cannot_run_is_refused_with_the_reason(monkeypatch):
    missing = [isa for isa in REFERENCE_ISAS if isa not in reference_ops.runnable()]
    monkeypatch.setenv(ISA_ENV, "avx9000")
    with pytest.raises(reference_ops.ReferenceUnavailable, match="avx9000.*use one of"):
        reference_ops.load()
    if missing:
        with pytest.raises(reference_ops.ReferenceUnavailable, match=f"cannot run the {missing[0]} build"):
            reference_ops.load(missing[0])


@pytest.fixture(scope="module")
def tiny_engine():
    e = Engine(EngineConfig(plan="invariant", dtype="bfloat16", num_kv_blocks=64, max_model_len=128, block_size=4),
               loaded=spec_tiny())
    yield e
    e.shutdown()


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.8, seed=7), dict(temperature=1.1, top_p=0.7, seed=3)])
def test_a_whole_decode_equals_the_oracle(tiny_engine, params):
    prompts = [[5, 17, 200, 3], list(range(40, 63))]
    sp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, **params)
    got = tiny_engine.generate(prompts, sp)
    assert tiny_engine.core.reproducibility.kernel_plan == f"invariant; {REFERENCE}"
    model = oracle.Model(tiny_engine.core.model)
    for prompt, c in zip(prompts, got):
        tokens, lps = model.decode(prompt, 10, sp.temperature, sp.top_k, sp.top_p, sp.seed or 0)
        assert list(c.token_ids) == tokens
        assert [int(np.float32(lp.logprob).view(np.uint32)) for lp in c.logprobs] == lps


def test_without_a_reference_build_verified_is_refused_and_the_record_says_so(monkeypatch):
    from gateeng.engine.errors import DeterminismUnavailable
    from gateeng.request import DeterminismParams, Mode
    monkeypatch.setenv(ISA_ENV, "no-such-build")
    engine = Engine(EngineConfig(dtype="bfloat16", num_kv_blocks=32, max_model_len=64, block_size=4),
                    loaded=spec_tiny())
    try:
        assert REFERENCE not in engine.core.reproducibility.kernel_plan
        with pytest.raises(DeterminismUnavailable, match="no build of the reference gateeng-ref-1.*no-such-build"):
            engine.generate([1, 2, 3], SamplingParams(max_tokens=2), DeterminismParams(Mode.VERIFIED))
        assert len(engine.generate([1, 2, 3], SamplingParams(max_tokens=2)).token_ids) == 2   # OFF still serves
    finally:
        engine.shutdown()


@pytest.mark.model
def test_a_few_smollm2_steps_equal_the_oracle(smollm):
    loaded = smollm("bfloat16")
    engine = Engine(EngineConfig(plan="invariant", num_kv_blocks=32, max_model_len=64), loaded=loaded)
    try:
        prompt = list(loaded.tokenizer.encode("The capital of France is"))
        got = engine.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0))[0]
        tokens, lps = oracle.Model(engine.core.model).decode(prompt, 3)
        assert list(got.token_ids) == tokens
        assert [int(np.float32(lp.logprob).view(np.uint32)) for lp in got.logprobs] == lps
    finally:
        engine.shutdown()
