"""Our Llama over the paged cache against transformers, and the plans' invariance."""
import pytest
import torch

from gateeng.model.llama import KVCache
from gateeng.plans import kernel_names, packing
from gateeng.plans.generic import FastPlan, InvariantPlan
from gateeng.plans.rows import Rows
from tiny import hf_tiny, tiny_loaded

BS = 4


def prefill_logits(loaded, plan, seqs, chunk=None):
    """Run sequences (lists of ids) through `plan`, optionally in prefill chunks; logits for every position."""
    model, cfg = loaded.model, loaded.config
    kv = KVCache(cfg, 64, BS, model.dtype, "cpu")
    tables, nxt = [], 1
    for s in seqs:
        n = -(-len(s) // BS)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    chunk = chunk or max(len(s) for s in seqs)
    out = [[None] * len(s) for s in seqs]
    for c0 in range(0, max(len(s) for s in seqs), chunk):
        rows = Rows([], [], [], [], [])
        owners = []
        for i, s in enumerate(seqs):
            first = len(rows)
            for p in range(c0, min(c0 + chunk, len(s))):
                rows.input_ids.append(s[p]); rows.positions.append(p)
                rows.slots.append(tables[i][p // BS] * BS + p % BS)
                rows.sample_rows.append(len(rows.input_ids) - 1); owners.append((i, p))
            if len(rows) > first:
                rows.seqs.append((first, len(rows), tables[i]))
        logits = plan.logits(model, kv, rows)
        for (i, p), lg in zip(owners, logits):
            out[i][p] = lg
    return [torch.stack(o) for o in out]


def cpu_kernels():
    from gateeng.plans import cpu_ops
    kernels = cpu_ops.load()
    if kernels is None:
        pytest.skip("the CPU kernels could not be built here (a C++ compiler is needed; see the log)")
    return kernels


def rowwise_plan(matmul: str, loaded) -> InvariantPlan:
    """The machine-specific invariant plan on the row-invariant matmul `matmul`
    (kernel_names.ROWWISE_MATMULS) over the model's one packed copy, as the engine
    builds it on a CPU whose matmul that is (an AVX-512 BF16 CPU also runs the
    reference's AVX2 build, which is how a test here reaches it)."""
    from types import SimpleNamespace

    from gateeng.plans import reference_ops
    k = cpu_kernels()
    if matmul == "cpu_dpbf16":
        if not k.dpbf16:
            pytest.skip("this CPU lacks AVX-512 BF16 (the VDPBF16PS matmul)")
        ref = reference_ops.load()
    else:
        if "avx2" not in reference_ops.runnable():
            pytest.skip("this CPU cannot run the reference's AVX2 build")
        ref = reference_ops.load("avx2")
        k = SimpleNamespace(**{n: getattr(k, n) for n in dir(k) if not n.startswith("__")} | {"dpbf16": False})
    m = loaded.model
    packing.pack_shared(m, ref)
    packing.pack_fast(m, k, ref)
    stored = packing.of(m)
    return InvariantPlan(rows=8, split=8, packed=stored.invariant_packed, kernels=k, block_size=BS,
                         matmul=stored.invariant_matmul)


def make_plan(name, loaded):
    """The plans as the engine builds them on CPU: torch ops only, or with the C++
    kernels and (bf16) the packed weights: oneDNN's, or the one shared copy under a
    row-invariant matmul."""
    if name == "fast":
        return FastPlan()
    if name == "invariant":
        return InvariantPlan(rows=8, split=8)
    if name.startswith("invariant-rowwise-"):
        return rowwise_plan(name.removeprefix("invariant-rowwise-"), loaded)
    packing.pack_fast(loaded.model)
    return InvariantPlan(rows=8, split=8, packed=packing.of(loaded.model).packed, kernels=cpu_kernels(),
                         block_size=BS)


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("plan_name", ["fast", "invariant", "invariant-kernels"])
def test_logits_match_transformers(plan_name, rope):
    hf = hf_tiny(rope_scaling=rope)
    loaded = tiny_loaded("float32", hf)
    plan = make_plan(plan_name, loaded)
    seqs = [list(range(5, 40)), [7, 3, 9, 11, 200, 13], list(range(100, 117))]
    ours = prefill_logits(loaded, plan, seqs, chunk=5)
    for s, lg in zip(seqs, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0].float()
        assert (lg - ref).abs().max().item() < 1e-4


def test_untied_lm_head():
    hf = hf_tiny(tie=False)
    loaded = tiny_loaded("float32", hf)
    (ours,) = prefill_logits(loaded, FastPlan(), [list(range(3, 20))])
    with torch.no_grad():
        ref = hf(torch.tensor([list(range(3, 20))])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("plan_name", ["invariant", "invariant-kernels", "invariant-rowwise-cpu_dpbf16",
                                       "invariant-rowwise-ref_avx2"])
def test_invariant_plan_is_batch_and_chunk_invariant_in_bf16(plan_name):
    loaded = tiny_loaded("bfloat16")
    plan = make_plan(plan_name, loaded)
    if plan_name == "invariant-kernels":
        assert "matmul=onednn_packed" in plan.describe() or not packing.of(loaded.model).packed
    if plan_name.startswith("invariant-rowwise-"):   # unpadded: every op row-invariant at any row count
        want = plan_name.removeprefix("invariant-rowwise-")
        assert want in kernel_names.ROWWISE_MATMULS
        assert f"matmul={want}" in plan.describe() and plan.group_rows == 0
    target = list(range(30, 60))
    alone = prefill_logits(loaded, plan, [target])[0]
    gen = torch.Generator().manual_seed(0)
    others = [torch.randint(0, 255, (n,), generator=gen).tolist() for n in (17, 40, 3)]
    for chunk in (1, 3, 16):
        mixed = prefill_logits(loaded, plan, others[:2] + [target] + others[2:], chunk=chunk)[2]
        assert torch.equal(alone, mixed), f"chunk={chunk}"



@pytest.mark.parametrize("matmul", ["this CPU's", "the reference's"])
def test_one_call_decode_layers_give_the_op_by_op_bits(matmul, monkeypatch):
    """The fast plan's C++ decode layers (a decode step in one call) run the same kernels
    in the same order as the op-by-op forward: the same logits, bit for bit. "the
    reference's": the call takes the reference build's matmul from the other extension
    (decode_layers_with, the AVX2 machines' path), which gives the same bits."""
    from gateeng.plans import cpu_linear, reference_ops
    k = cpu_kernels()
    loaded = tiny_loaded("bfloat16")
    m, ref = loaded.model, reference_ops.load()
    # Every row count on the row-invariant matmul, both ways: the probe's timing (which a
    # busy machine can tip towards oneDNN) would otherwise pick the op-by-op kernel.
    monkeypatch.setattr(cpu_linear, "rowwise_max_rows", lambda *args: None)
    packing.pack_shared(m, ref)
    packing.pack_fast(m, k, ref)
    stored = packing.of(m)
    if stored.fused_layers is None:
        pytest.skip("no row-invariant matmul here (neither AVX-512 BF16 nor an AVX2 reference build)")
    if matmul == "the reference's":
        stored.fused_layers = stored.fused_layers._replace(matmul=ref.linear)
    plan = FastPlan(0.0, stored.packed, k, stored.dense_head)
    one_call = plan.decode_layers
    calls = []
    plan.decode_layers = lambda *a: calls.append(one_call(*a)) or calls[-1]
    seqs = [list(range(5, 40)), [7, 3, 9, 11, 200, 13], list(range(100, 117))]
    fused = prefill_logits(loaded, plan, seqs, chunk=1)   # one row per sequence a step: decode steps
    assert calls and all(c is not None for c in calls[1:])   # the first step is a prefill
    stored.fused_layers = None
    op_by_op = prefill_logits(loaded, plan, seqs, chunk=1)
    assert all(torch.equal(a, b) for a, b in zip(fused, op_by_op))


def test_fast_lm_head_gives_float32_top2_for_greedy_rows_and_float32_rows_for_sampled():
    from gateeng.kernels.fixed_order import argmax_margin
    from gateeng.plans.head import float_logits
    model = tiny_loaded("bfloat16").model
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(300, model.cfg.hidden_size, generator=gen) * 3).to(torch.bfloat16)
    # Near-ties: a few rows that are the average of two vocab rows' directions.
    w = model.lm_head.float()
    hidden[:20] = ((w[torch.arange(20)] + w[torch.arange(20) + 50]) * 4).to(torch.bfloat16)
    greedy = [i % 7 != 3 for i in range(300)]
    full = float_logits(FastPlan(), model, hidden)
    got = FastPlan().lm_head(model, hidden, greedy)
    g = torch.tensor(greedy)
    tok_full, mar_full = argmax_margin(full[g])
    tok, mar = argmax_margin(got[g])
    assert torch.equal(tok, tok_full)
    assert (mar - mar_full).abs().max().item() < 1e-4
    assert torch.equal(got[~g], full[~g])   # sampled rows: the float32 lm_head itself


def _head(vocab: int, hidden_size: int = 64, packed: bool = False, seed: int = 0):
    """A stand-in model with only an lm_head (what greedy_top2 reads), and the
    packed bf16 head the fast plan would pass (None: the plain weight)."""
    from types import SimpleNamespace

    from gateeng.plans import cpu_linear
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, hidden_size, generator=gen) * 0.2).to(torch.bfloat16)
    model = SimpleNamespace(lm_head=w, stored=None)   # packing.of makes the float32 lm_head and its norm
    return model, (cpu_linear.pack(w) if packed else None)


@pytest.mark.parametrize("search", ["chunks", "kernel"])
@pytest.mark.parametrize("vocab,packed", [(256, False), (300, False), (5, False), (49152, True), (1000, True)])
def test_greedy_top2_equals_the_dense_greedy_path(vocab, packed, search):
    """Either candidate search (torch chunks, the C++ pass) gives exactly the token
    and margin the sampler takes from greedy_logits, near-ties and exact ties
    included, and the float32 argmax."""
    from gateeng.kernels.fixed_order import argmax_margin
    from gateeng.plans.head import greedy_logits, greedy_top2
    kernels = cpu_kernels() if search == "kernel" else None
    if search == "kernel" and kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    model, head = _head(vocab, packed=packed)
    gen = torch.Generator().manual_seed(1)
    hidden = (torch.randn(40, 64, generator=gen) * 4).to(torch.bfloat16)
    w = model.lm_head.float()
    a, b = torch.arange(10) % vocab, (torch.arange(10) * 7 + 3) % vocab
    hidden[:10] = ((w[a] + w[b]) * 8).to(torch.bfloat16)     # near-ties between two ids
    hidden[10:12] = 0                                           # every logit 0: an exact tie over the vocab
    tok, mar = greedy_top2(model, hidden, head, kernels)
    want_tok, want_mar = argmax_margin(greedy_logits(model, hidden, head))
    assert tok == want_tok.tolist() and mar == want_mar.tolist()
    assert tok[10] == 0 and mar[10] == 0.0
    exact = torch.nn.functional.linear(hidden.float(), packing.lm_head_f32(model))
    chosen = exact.gather(1, torch.tensor(tok)[:, None])[:, 0]
    assert (exact.max(-1).values - chosen).max() < 1e-4   # the float32 argmax, up to float32 rounding
    broken = hidden.clone()
    broken[3, 0] = float("inf")   # non-finite logits in one row: the dense path decides, for every row
    tok, mar = greedy_top2(model, broken, head, kernels)
    want_tok, want_mar = argmax_margin(greedy_logits(model, broken, head))
    assert tok == want_tok.tolist() and mar[:3] == want_mar[:3].tolist()


def test_choose_mixes_greedy_and_sampled_rows_as_the_dense_sampler_does():
    from gateeng.plans import sampler
    from gateeng.plans.head import choose
    from gateeng.request import SamplingParams
    model = tiny_loaded("bfloat16").model
    gen = torch.Generator().manual_seed(2)
    hidden = (torch.randn(12, model.cfg.hidden_size, generator=gen) * 3).to(torch.bfloat16)
    specs = [sampler.RowSpec(SamplingParams() if i % 3 else SamplingParams(temperature=0.8), 7 + i, 5)
             for i in range(12)]
    for plan in (FastPlan(), InvariantPlan(rows=8)):
        assert plan.sparse_greedy
        dense = sampler.sample(plan.choice_logits(model, hidden, [s.params.greedy for s in specs]), specs)
        assert choose(plan, model, hidden, specs, sampler.sample) == dense


@pytest.mark.parametrize("chunk,kernel_work", [(1, None), (3, None), (3, 0), (None, 80)])
def test_fast_plan_with_cpu_kernels_matches_transformers(chunk, kernel_work, monkeypatch):
    """RMSNorm and attention from gateeng.plans.cpu_ops: float32 logits as close to
    transformers as the torch ops give, in pure decode steps (chunk 1), in steps that
    mix decode rows with prefill chunks the kernel attends row by row (chunk 3), with
    SDPA taking every chunk (work limit 0), and in one step whose 17- and 11-token
    prompts go to SDPA while the 7-token one (49 <= 80) goes to the kernel."""
    from gateeng.plans import generic as plan_mod
    if kernel_work is not None:
        monkeypatch.setattr(plan_mod, "KERNEL_PREFILL_WORK", kernel_work)
    kernels = cpu_kernels()
    hf = hf_tiny()
    loaded = tiny_loaded("float32", hf)
    seqs = [list(range(5, 22)), list(range(40, 47)), [3, 9, 27, 81, 100, 7, 1, 2, 250, 4, 6]]
    got = prefill_logits(loaded, FastPlan(kernels=kernels), seqs, chunk=chunk)
    for s, g in zip(seqs, got):
        with torch.no_grad():
            want = hf(torch.tensor([s])).logits[0].float()
        assert (g - want).abs().max().item() < 1e-3
