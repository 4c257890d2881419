"""Fast-path throughput: gateeng vs HF transformers `generate`, same model, bf16, CPU.

(a) 16 equal-length prompts, 64 tokens each.
(b) 32 mixed-length prompts with mixed max_tokens (16..128): HF must pad the batch
    and run to the longest request; our continuous batching retires requests early.
Both run in this process on the same prompts, alternating, each case --repeats
times (best kept), ours without prefix caching (every prompt computed, as
transformers does); the table reports tokens/s and the ratio ours/HF. It also
reports the steady decode step time at 1, 8, 32 and 64 running requests against
the time to read every weight once and against the step's matmul work at the
bf16 peak (the two floors), both measured in the same run.
Usage: python bench/throughput.py [--quick] [--repeats 3]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_step_ms, header, prompt_set, timed  # noqa: E402

from gateeng.plans import cpu_ops  # noqa: E402
from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine.engine import Engine  # noqa: E402
from gateeng.model.loader import default_model_path, ensure_hf_dir, load  # noqa: E402
from gateeng.request import SamplingParams  # noqa: E402


def hf_generate(model, tok, prompts, max_tokens):
    """HF batched greedy generate; counts only each prompt's own max_tokens."""
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model.generation_config.eos_token_id = None
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        model.generate(**enc, max_new_tokens=max(max_tokens), do_sample=False, pad_token_id=tok.pad_token_id)
    # This thread's OpenMP workers would slow the engine thread's (see Engine); the
    # engine thread lets its own go while idle, so transformers is not slowed either.
    kernels = cpu_ops.load()
    if kernels is not None:
        kernels.release_idle_threads()
    return sum(max_tokens)


def ours(engine, prompts, max_tokens):
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    res = engine.generate(prompts, params)
    return sum(r.completion_tokens for r in res)


def weight_read_ms(model) -> tuple[float, float]:
    """(ms, MB) to read once every weight a greedy decode step multiplies by: the
    floor its matmuls cannot beat. Greedy rows read only a few rows of the float32
    lm_head copy, so it is not counted. Each tensor is read by a max over its bits
    viewed as integers: memory bound, where a bf16 amax is compute bound on some
    CPUs (5 GB/s against 12-14 GB/s on an AMX Xeon) and would flatter the step."""
    seen, unique = set(), []
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            unique.append(t.detach().view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32))
    with torch.inference_mode():
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            for t in unique:
                t.max()
            best = min(best, time.perf_counter() - t0)
    return best * 1000, sum(t.numel() * t.element_size() for t in unique) / 1e6


def matmul_peak_gflops() -> float:
    """bf16 matmul throughput at a large shape (compute bound), best of 5, of the
    faster of torch's and the row-invariant C++ kernel: with the weight read, the
    other floor a decode step cannot beat."""
    from gateeng.plans import cpu_linear, reference_ops
    x, w = torch.randn(1024, 4096).to(torch.bfloat16), torch.randn(4096, 4096).to(torch.bfloat16)
    kernels, ref = cpu_ops.load(), reference_ops.load()
    name = cpu_linear.rowwise_kernel(kernels, ref)
    fns = [lambda a: torch.nn.functional.linear(a, w)]
    if name is not None:
        fns.append(cpu_linear.rowwise(name, cpu_linear.shared_pack(w, ref), kernels, ref))
    best = float("inf")
    with torch.inference_mode():
        for fn in filter(None, fns):
            fn(x)
            for _ in range(5):
                t0 = time.perf_counter()
                fn(x)
                best = min(best, time.perf_counter() - t0)
    return 2 * 1024 * 4096 * 4096 / best / 1e9


def step_gflop(model, rows: int) -> float:
    """Multiply-adds of a greedy decode step at `rows` rows: every projection and the
    bf16 lm_head (attention's are a few percent at these contexts)."""
    return 2 * rows * (sum(w.numel() for w in model.projections()) + model.lm_head.numel()) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each case per engine, alternating; the best of each is kept (a shared "
                         "host's neighbours only ever add time)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    loaded = load(None, "bfloat16")
    # No prefix caching: each repeat would find the previous repeat's prompts cached,
    # and transformers recomputes every prompt.
    engine = Engine(EngineConfig(dtype="bfloat16", num_kv_blocks=1024, enable_prefix_caching=False), loaded=loaded)
    hf = AutoModelForCausalLM.from_pretrained(ensure_hf_dir(default_model_path()), dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(ensure_hf_dir(default_model_path()))   # transformers' own, for its generate
    scale = 4 if args.quick else 1
    cases = {
        "(a) 16 equal prompts x 64 tok": (prompt_set(16, False), [64 // scale] * 16),
        "(b) 32 mixed prompts, 16..128 tok": (prompt_set(32, True),
                                             [(16 + (i * 37) % 113) // scale for i in range(32)]),
    }
    ours(engine, ["warm up"], [4])
    hf_generate(hf, tok, ["warm up"], [4])
    rows = []
    for name, (ps, mt) in cases.items():
        t_hf = t_us = float("inf")
        for _ in range(args.repeats):
            n_hf, t = timed(lambda: hf_generate(hf, tok, ps, mt))
            t_hf = min(t_hf, t)
            n_us, t = timed(lambda: ours(engine, ps, mt))
            t_us = min(t_us, t)
        rows.append((name, n_us / t_us, n_hf / t_hf))
        print(f"{name}: ours {n_us / t_us:.1f} tok/s, HF {n_hf / t_hf:.1f} tok/s", file=sys.stderr)
    engine.shutdown()
    read_ms, mb = weight_read_ms(loaded.model)
    peak = matmul_peak_gflops()
    steps = {b: decode_step_ms(loaded, b) for b in (1, 8, 32, 64)}
    print(f"{header()}\n")
    print("| case | gateeng fast path tok/s | HF generate tok/s | ours / HF |")
    print("| --- | --- | --- | --- |")
    for name, a, b in rows:
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    print(f"\nroofline: reading the weights once ({mb:.0f} MB) takes {read_ms:.1f} ms (best of 7); bf16 matmuls "
          f"peak at {peak:.0f} GFLOP/s (1024 x 4096 x 4096, the faster of torch and the row-invariant kernel)\n")
    print("| running requests | decode step ms | step / weight read | compute floor ms | step / max(read, compute) |")
    print("| --- | --- | --- | --- | --- |")
    for b, ms in steps.items():
        floor = step_gflop(loaded.model, b) / peak * 1000
        print(f"| {b} | {ms:.1f} | {ms / read_ms:.2f}x | {floor:.1f} | {ms / max(read_ms, floor):.2f}x |")


if __name__ == "__main__":
    main()
