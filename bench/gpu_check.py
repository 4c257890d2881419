"""One-shot GPU check for gateeng's kernels and plans. Prints one table.

Run on a CUDA machine (about 3 minutes on an H200, most of it building the CPU
reference and compiling the Triton kernels):
    python bench/gpu_check.py [CHECK ...]
It covers
  1. correctness of each Triton invariant kernel against a float64 torch reference
     (relative norm error) and bitwise batch invariance on real sizes (hidden 4096,
     batch 1..256; attention with 1 vs many queries, moved rows, other pages);
  2. speed of each invariant kernel relative to its cuBLAS / flashinfer / torch
     counterpart, in the same run (anchor: batch-invariant matmul within ~20% of cuBLAS);
  3. the reference (gateeng-ref-1): each Triton reference kernel on the device against
     the CPU reference build on the same inputs, bit for bit (matmul, the quantized
     matmul and embedding rows, RMSNorm, SiLU, attention, exp and log, Gumbel noise,
     a mixture of experts' routing and combine, and a tiny MoE's forward);
  4. the golden file's tiny-model answers (tests/golden), made on a CPU, decoded
     again on the device: token ids and logprob bits;
  5. end to end, a random-weight ~1B Llama decoding a batch of 64 with the fast
     plan, the invariant plan (the reference, for bf16) and VERIFIED, in tokens/s.
On a machine without CUDA it exits 2 with a message.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ROWS = []
# Decode steps per request end to end: the reference's Triton kernels run without tensor cores.
TOKENS = 32


def row(section, name, value, verdict=""):
    ROWS.append((section, name, value, verdict))
    print(f"  {section} | {name} | {value} | {verdict}", file=sys.stderr, flush=True)


def rel(got, want):
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm()).item()


def bench(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def check_matmul(dev):
    from gateeng.kernels import triton_matmul as tm
    K, N = 4096, 4096
    for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
        w = torch.randn(N, K, device=dev, dtype=dtype) / 64
        x = torch.randn(256, K, device=dev, dtype=dtype)
        full = tm.matmul(x, w)
        err = rel(full, x.double() @ w.double().T)
        row("matmul", f"{dtype} rel err (256x4096x4096)", f"{err:.2e}", "ok" if err < tol else "FAIL")
        inv = all(torch.equal(tm.matmul(x[:b], w), full[:b]) for b in (1, 2, 3, 7, 16, 64, 128, 255))
        perm = torch.randperm(256, device=dev)
        inv &= torch.equal(tm.matmul(x[perm], w), full[perm])
        row("matmul", f"{dtype} bitwise invariant, batch 1..256 + moved rows", str(inv), "ok" if inv else "FAIL")
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64
    for b in (1, 64, 256):
        x = torch.randn(b, K, device=dev, dtype=torch.bfloat16)
        t_ours = bench(lambda: tm.matmul(x, w))
        t_ref = bench(lambda: torch.nn.functional.linear(x, w))
        row("speed", f"matmul bf16 M={b} (ours / cuBLAS)", f"{t_ours / t_ref:.2f}x",
            "ok" if t_ours / t_ref < 1.2 else "slower than the 20% anchor")


def check_rmsnorm(dev):
    from gateeng.kernels import fixed_order as ref
    from gateeng.kernels import triton_rmsnorm as tr
    x = torch.randn(256, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    y = tr.rms_norm(x, w, 1e-5)
    xd = x.double()
    err = rel(y, w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5))
    inv = all(torch.equal(tr.rms_norm(x[:b], w, 1e-5), y[:b]) for b in (1, 3, 64, 200))
    row("rmsnorm", "bf16 rel err / bitwise invariant", f"{err:.2e} / {inv}", "ok" if err < 1e-2 and inv else "FAIL")
    t_ours = bench(lambda: tr.rms_norm(x, w, 1e-5))
    t_ref = bench(lambda: ref.rms_norm(x, w, 1e-5))
    row("speed", "rmsnorm bf16 256x4096 (ours / torch)", f"{t_ours / t_ref:.2f}x")


def check_attention(dev):
    from gateeng.kernels import fixed_order as ref
    from gateeng.kernels import triton_attention as ta
    page, split, hkv, h, d, L = 16, 256, 8, 32, 128, 3000
    nblocks = 2 * (L // page + 1)
    kc = torch.randn(nblocks, page, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pages = torch.randperm(nblocks, device=dev)[: L // page + 1]
    slots = (pages[:, None] * page + torch.arange(page, device=dev)).view(-1)[:L]
    q = torch.randn(L, h, d, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(L, device=dev)
    tables = pages[None].expand(L, -1).contiguous()
    out = ta.split_attention(q, kc, vc, tables, pos, split, d ** -0.5)
    sel = torch.tensor([0, 255, 256, 1000, L - 1], device=dev)
    want = ref.attention_float64(q[sel], kc.view(-1, hkv, d)[slots], vc.view(-1, hkv, d)[slots], sel, d ** -0.5)
    err = rel(out[sel], want)
    inv = all(torch.equal(ta.split_attention(q[i:i + 1], kc, vc, tables[:1], pos[i:i + 1], split, d ** -0.5)[0], out[i])
              for i in sel.tolist())
    perm = torch.randperm(L, device=dev)
    inv &= torch.equal(ta.split_attention(q[perm], kc, vc, tables[perm], pos[perm], split, d ** -0.5), out[perm])
    row("attention", "bf16 rel err / bitwise invariant (1 vs 3000 queries, moved)", f"{err:.2e} / {inv}",
        "ok" if err < 1e-2 and inv else "FAIL")
    try:
        import flashinfer
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        wrap = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        B = 64
        npg = L // page + 1
        i32 = dict(dtype=torch.int32, device=dev)
        wrap.plan(torch.arange(B + 1, **i32) * npg, pages.repeat(B).to(torch.int32),
                  torch.full((B,), L - (npg - 1) * page, **i32), h, hkv, d, page, q_data_type=torch.bfloat16)
        qd = q[:B].contiguous()
        t_fi = bench(lambda: wrap.run(qd, (kc, vc)))
        posd = torch.full((B,), L - 1, device=dev)
        t_ours = bench(lambda: ta.split_attention(qd, kc, vc, tables[:B], posd, split, d ** -0.5))
        row("speed", f"decode attention B={B}, ctx {L} (ours / flashinfer)", f"{t_ours / t_fi:.2f}x")
    except ImportError:
        row("speed", "decode attention vs flashinfer", "flashinfer not installed", "SKIPPED")


def check_sampling(dev):
    from gateeng.kernels import fixed_order as ref
    from gateeng.kernels import triton_sampling as ts
    logits = torch.randn(64, 128256, device=dev)
    tok, mar = ts.sample(logits, [0.0] * 64, [0] * 64, [0] * 64)
    wt, wm = ref.argmax_margin(logits.cpu())
    ok = torch.equal(tok.cpu(), wt) and torch.equal(mar.cpu(), wm)
    tok2, _ = ts.sample(logits, [0.8] * 64, list(range(64)), [5] * 64)
    cpu = [int(ref.argmax_margin(logits[i].cpu() / 0.8 + ref.gumbel_noise(i, 5, 128256))[0]) for i in range(4)]
    ok &= tok2[:4].cpu().tolist() == cpu
    row("sampling", "argmax+margin equal to torch; seeded Gumbel equal to the CPU hash", str(ok), "ok" if ok else "FAIL")


def same(got, want) -> bool:
    """Whether a device tensor has the CPU tensor `want`'s dtype and bits."""
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(want.dtype, want.dtype)
    return got.dtype == want.dtype and torch.equal(got.cpu().contiguous().view(view), want.contiguous().view(view))


def check_reference(dev):
    """The Triton reference kernels on the device give the CPU reference build's bits."""
    from gateeng.kernels import triton_reference as tr
    from gateeng.plans import reference_ops
    ops = reference_ops.load()

    def bf(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).to(torch.bfloat16)
    x, w = bf(64, 2048), bf(1536, 2048, scale=0.05)
    packed = ops.pack(w)
    ok = same(tr.matmul(x.to(dev), w.to(dev), f32=True), ops.linear(x, packed, 1536, True))
    ok &= same(tr.matmul(x.to(dev), w.to(dev)), ops.linear(x, packed, 1536, False))
    px, pw = reference_ops.probe_inputs()
    ok &= same(tr.matmul(px.to(dev), pw.to(dev), f32=True), ops.linear(px, ops.pack(pw), pw.shape[0], True))
    row("reference", "matmul (64x2048x1536, and the denormal probe) == CPU build", str(ok), "ok" if ok else "FAIL")
    h, nw, gu = bf(64, 2048, scale=3.0), bf(2048), bf(64, 2 * 5632, scale=8.0)
    ok = same(tr.rms_norm(h.to(dev), nw.to(dev), 1e-5), ops.rms_norm(h, nw, 1e-5))
    ok &= same(tr.silu_mul(gu.to(dev)), ops.silu_mul(gu))
    v = torch.cat([torch.linspace(-90, 90, 100001), torch.randn(100000) * 20]).float()
    ok &= same(tr.map_f32(v.to(dev), False), ops.map_f32(v, 0)) and same(tr.map_f32(v.abs().to(dev), True),
                                                                          ops.map_f32(v.abs(), 1))
    ok &= same(tr.gumbel(12345, 128256, dev), ops.gumbel(12345, 128256))
    row("reference", "RMSNorm, SiLU, exp, log, Gumbel noise == CPU build", str(ok), "ok" if ok else "FAIL")
    ok = True
    for d in (64, 128):
        k_cache, v_cache = bf(256, 16, 8, d, scale=2.0), bf(256, 16, 8, d)
        lens = torch.randint(1, 1000, (16,))
        tables = torch.stack([torch.randperm(256)[:63] for _ in range(16)])
        q = bf(16, 32, d, scale=3.0)
        want = ops.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
        got = tr.decode_attention(q.to(dev), k_cache.to(dev), v_cache.to(dev), tables.to(dev), lens.to(dev), d ** -0.5)
        ok &= same(got, want)
    row("reference", "attention (head dim 64 and 128, up to 1000 keys) == CPU build", str(ok), "ok" if ok else "FAIL")
    ok = quantized_same(ops, dev, 64, 1536, 2048)
    row("reference", "quantized matmul and embedding rows (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; 64x2048x1536) "
        "== CPU build", str(ok), "ok" if ok else "FAIL")


def quantized_same(ops, dev, m: int, n: int, k: int) -> bool:
    """Whether the Triton reference's qmatmul (both outputs) and qrows on `dev` give the CPU
    build's bits, for each type served as stored, as the loader splits them
    (gguf_weights.split_blocks): Q8_0, Q4_0, Q4_1 on reference_ops' probe records (scales
    from 2^-24 to 2^4), the K-quants on k_quant_probe's."""
    from gateeng.kernels import triton_reference as tr
    from gateeng.model.gguf_weights import K_QUANT_BYTES, SERVED_QUANTIZED, split_blocks
    from gateeng.plans import reference_ops
    x = (torch.randn(m, k) * 4).to(torch.bfloat16)
    x[m // 2:] *= 2.0 ** -118   # half the rows small enough that sub-block values and sums flush
    ids = torch.randint(0, n, (m,))
    ok = True
    for kind, ggml in SERVED_QUANTIZED.items():
        raw = (k_quant_probe(n, k, kind, seed=ggml) if kind in K_QUANT_BYTES else
               reference_ops.quantized_probe(n, k, dict(reference_ops.QUANT_PROBES)[ggml], seed=ggml))
        packed = ops.qpack(raw, ggml)
        b = split_blocks(raw.numpy(), kind, k).to(dev)
        for f32 in (True, False):
            got, want = tr.qmatmul(x.to(dev), b.q, b.d, b.m, f32, b.sc, b.mn), ops.linear(x, packed, n, f32)
            ok &= torch.equal(got.cpu().view(torch.int32 if f32 else torch.int16),
                              want.view(torch.int32 if f32 else torch.int16))
        ok &= torch.equal(tr.qrows(b.q, b.d, b.m, ids.to(dev), b.sc, b.mn).cpu().view(torch.int16),
                          ops.qrows(packed, ids).view(torch.int16))
    return bool(ok)


def k_quant_probe(n: int, k: int, kind: str, seed: int) -> torch.Tensor:
    """GGUF rows [n, k/256 super-blocks] of a K-quant: random bytes, with binary16 d (and
    dmin) from 2^-24 to 2^-4."""
    from gateeng.model.gguf_weights import K_QUANT_BYTES
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // 256, K_QUANT_BYTES[kind]), generator=gen, dtype=torch.uint8)
    count = 1 if kind == "Q6_K" else 2
    shape = (n, k // 256, count)
    scales = (torch.rand(shape, generator=gen) * 2 - 1) * 2.0 ** torch.randint(-24, -3, shape, generator=gen)
    at = 208 if kind == "Q6_K" else 0
    raw[:, :, at:at + 2 * count] = scales.to(torch.float16).view(torch.uint8).view(n, k // 256, 2 * count)
    return raw.view(n, -1)


def check_moe(dev):
    """A mixture of experts on the device's reference: the Triton routing (every rule,
    exact ties) and combine against the CPU build, and the golden file's tiny Qwen3-MoE
    on TritonReferencePlan on the device against ReferencePlan on the CPU (a prefill and
    a decode step: hidden states, logits and router margins). The engine still refuses a mixture of
    experts on CUDA at start-up; this is the check that lifting it needs."""
    sys.path.append(str(ROOT))
    from gateeng.kernels import triton_reference as tr
    from gateeng.plans import reference_ops
    from gateeng.plans.gpu import TritonReferencePlan
    from gateeng.plans.reference import ReferencePlan
    from tests.test_triton_moe import prefill_then_decode
    from tests.tiny import spec_tiny
    ops = reference_ops.load()
    z = torch.randn(512, 128) * 3
    z[:128, 64:] = z[:128, :64]      # every expert tied with another
    z[128:256] = z[128:256].round()  # many exact ties
    ok = True
    for k in (1, 2, 8):
        for rule in ((True, True), (True, False), (False, False)):
            ok &= all(same(g, w) for g, w in zip(tr.moe_route(z.to(dev), k, *rule), ops.moe_route(z, k, *rule)))
    weights = ops.moe_route(z, 8, True, True)[1]
    y = (torch.randn(512, 8, 2048) * 4).to(torch.bfloat16)
    ok &= same(tr.moe_combine(y.to(dev), weights.to(dev)), ops.moe_combine(y, weights))
    row("moe", "routing (3 rules, k 1/2/8 of 128, ties) and combine (512 rows x 8 x 2048) == CPU build", str(ok),
        "ok" if ok else "FAIL")
    cpu, gpu = spec_tiny(moe=True).model, spec_tiny(moe=True, device=str(dev)).model
    want = prefill_then_decode(cpu, ReferencePlan(cpu, ops, 4))
    got = prefill_then_decode(gpu, TritonReferencePlan(4, gpu))
    ok = all(same(g, w) for step_got, step_want in zip(got, want) for g, w in zip(step_got, step_want))
    row("moe", "tiny Qwen3-MoE on the device's TritonReferencePlan == CPU ReferencePlan (hidden, logits, margins)",
        str(ok), "ok" if ok else "FAIL")


def check_golden(dev):
    """The golden file's tiny-model answers, made once on a CPU, decoded again here on
    the device's invariant plan (the Triton reference): whole decodes, greedy and
    seeded, token ids and logprob bits."""
    sys.path.append(str(ROOT))   # after site-packages: the tests package, nothing it would shadow
    from gateeng.plans.kernel_names import REFERENCE
    from tests.golden.cases import CASES, answers
    from tests.tiny import spec_tiny
    golden = json.loads((ROOT / "tests" / "golden" / f"{REFERENCE}.json").read_text())["models"]["tiny"]
    loaded = spec_tiny(device=str(dev))
    for case, want in zip(CASES["tiny"], (c["answers"] for c in golden["cases"])):
        got = answers(loaded, case, device=dev.type)
        same = got == want
        kind = "seeded" if case.get("seeds") else "greedy"
        row("golden", f"tiny model, {kind}: {len(want)} answers x {case['params']['max_tokens']} tokens == "
            f"{REFERENCE}.json (ids, logprob bits)", str(same), "ok" if same else "FAIL")


def check_end_to_end(dev):
    from gateeng.config import EngineConfig, ModelConfig
    from gateeng.engine.engine import Engine
    from gateeng.model.loader import LoadedModel
    from gateeng.model.llama import LlamaModel
    from gateeng.request import DeterminismParams, Mode, SamplingParams

    class Tok:
        eos_token_id = None

        def encode(self, text, add_special_tokens=False):
            return [1 + (b % 1000) for b in text.encode()]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    cfg = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, max_position=4096, tie_word_embeddings=False, eos_token_ids=(),
                      architecture="llama")
    model = LlamaModel(cfg, torch.bfloat16, dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() == 2 else p.fill_(1.0)
    model.finalize()
    loaded = LoadedModel(model, Tok(), cfg, "random-1b", "random")
    n_params = sum(p.numel() for p in model.parameters()) / 1e9
    prompts = [[(i * 31 + j) % 31999 + 1 for j in range(64 + i)] for i in range(64)]
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    results = {}
    for name, plan, det in (("fast", "fast", None), ("invariant", "invariant", None),
                            ("VERIFIED", "fast", DeterminismParams(Mode.VERIFIED))):
        e = Engine(EngineConfig(device="cuda", plan=plan, num_kv_blocks=4096, max_num_batched_tokens=8192), loaded=loaded)
        e.generate(prompts[:2], SamplingParams(max_tokens=4))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = e.generate(prompts, params, det)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        results[name] = (out, 64 * TOKENS / dt)
        extra = ""
        if det is not None:
            st = [c.stats for c in out]
            extra = f"trigger rate {sum(s.triggers for s in st) / max(1, sum(s.decode_steps for s in st)):.1%}"
        row("e2e", f"{n_params:.2f}B random Llama, batch 64 x {TOKENS} tok, {name}", f"{64 * TOKENS / dt:.0f} tok/s",
            extra)
        e.shutdown()
    same = [a.token_ids for a in results["VERIFIED"][0]] == [a.token_ids for a in results["invariant"][0]]
    row("e2e", "VERIFIED outputs == invariant-plan outputs", str(same), "ok" if same else "FAIL")
    row("e2e", "VERIFIED / fast tok/s; invariant / fast tok/s",
        f"{results['VERIFIED'][1] / results['fast'][1]:.2f}x; {results['invariant'][1] / results['fast'][1]:.2f}x")


def check_policy(dev):
    """The trainer's policy on the device (its forward on the Triton reference): each
    sampled token's logprob equal, bit for bit, to a VERIFIED answer of the CPU
    server on the same tiny model; its backward runs."""
    sys.path.append(str(ROOT))
    from gateeng.config import EngineConfig
    from gateeng.engine.engine import Engine
    from gateeng.request import DeterminismParams, Mode, SamplingParams
    from gateeng.train import Policy
    from tests.tiny import hf_family, tiny_loaded
    hf = hf_family("llama")
    prompts = [[7, 3, 9, 11, 200, 13], [5, 6, 7], [100, 20, 30, 40, 50, 60, 70, 80, 90]]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True, logprobs=0)
    engine = Engine(EngineConfig(dtype="bfloat16", num_kv_blocks=128, max_model_len=256, block_size=4),
                    loaded=tiny_loaded("bfloat16", hf))
    res = [engine.generate(p, params, DeterminismParams(Mode.VERIFIED)) for p in prompts]
    engine.shutdown()
    policy = Policy(tiny_loaded("float32", hf)).to(dev)
    got = policy.logprobs([p + r.token_ids for p, r in zip(prompts, res)], [len(p) for p in prompts],
                          temperature=1.0, top_p=0.9)
    same = [g.cpu().tolist() for g in got] == [[e.logprob for e in r.logprobs] for r in res]
    row("policy", "Triton forward on the device: logprobs == the CPU server's VERIFIED (3 x 24 tokens)", str(same),
        "ok" if same else "FAIL")
    sum(g.sum() for g in got).backward()
    grads = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in policy.parameters())
    row("policy", "backward on the device: every parameter's gradient finite", str(grads), "ok" if grads else "FAIL")


CHECKS = {"matmul": check_matmul, "rmsnorm": check_rmsnorm, "attention": check_attention,
          "sampling": check_sampling, "reference": check_reference, "moe": check_moe, "golden": check_golden,
          "policy": check_policy, "end_to_end": check_end_to_end}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checks", nargs="*", metavar="CHECK", help=f"run only these ({', '.join(CHECKS)}); default: all")
    names = ap.parse_args().checks or list(CHECKS)
    unknown = [c for c in names if c not in CHECKS]
    if unknown:
        ap.error(f"unknown check {', '.join(unknown)}: choose from {', '.join(CHECKS)}")
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this on a GPU machine (see bench/RESULTS.md)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})", file=sys.stderr)
    for check in (CHECKS[c] for c in names):
        t0 = time.perf_counter()
        try:
            check(dev)
        except Exception as e:   # report and go on: one table with everything we could measure
            traceback.print_exc()
            row(check.__name__, "error", repr(e)[:120], "FAIL")
        print(f"  ({check.__name__}: {time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    print("\n| section | check | value | verdict |\n| --- | --- | --- | --- |")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")
    return 1 if any(r[3] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
