"""Determinism and its cost: OFF vs VERIFIED vs plan=invariant, on SmolLM2-135M bf16.

1. Each prompt decoded alone and inside a batch of all prompts, per mode: how many
   prompts give more than one distinct output, and does VERIFIED equal the
   reference (plan=invariant, alone)?  Trigger rate, passes per token, rollbacks,
   and wall time of the batch run relative to OFF.
2. 10% VERIFIED traffic: the batch with every 10th request VERIFIED, against
   all-OFF (OFF throughput kept) and against a plan=invariant engine serving the
   same batch (what a server-wide batch-invariant switch costs).
All runs share one process and one loaded model. Usage:
  python bench/determinism.py [--prompts 32] [--tokens 128] [--torch-ops]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import TORCH_OPS, commit, machine, prompt_set, timed  # noqa: E402

from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine.engine import Engine  # noqa: E402
from gateeng.model.loader import load  # noqa: E402
from gateeng.request import DeterminismParams, Mode, SamplingParams  # noqa: E402

VERIFIED = DeterminismParams(Mode.VERIFIED)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--invariant-alone", type=int, default=4,
                    help="prompts also decoded alone on plan=invariant (slow on CPU)")
    ap.add_argument("--torch-ops", action="store_true",
                    help="both plans on torch ops and plain weights (--no-cpu-kernels --no-packed-weights): "
                         "where the C++ kernels make the fast plan's matmuls and short-prompt attention "
                         "row-invariant too, OFF output varies with the batch only this way")
    args = ap.parse_args()
    n, T, n_inv_alone = args.prompts, args.tokens, args.invariant_alone
    loaded = load(None, "bfloat16")
    # No prefix caching: a batch run would find its prompts cached by the alone runs
    # before it (and VERIFIED and plan=invariant by their own), so the wall times would
    # compare cache states, not modes.
    ops = dict(TORCH_OPS) if args.torch_ops else {}
    fast = Engine(EngineConfig(enable_prefix_caching=False, **ops), loaded=loaded)
    inv = Engine(EngineConfig(plan="invariant", enable_prefix_caching=False, **ops), loaded=loaded)
    log(f"invariant plan: {inv.invariant_plan.describe()}")
    prompts = prompt_set(n, mixed=True)
    params = SamplingParams(max_tokens=T, ignore_eos=True)
    fast.generate(prompts[:2], SamplingParams(max_tokens=4))
    inv.generate(prompts[:2], SamplingParams(max_tokens=4))

    def alone(engine, det, count=n):
        out = []
        for i, p in enumerate(prompts[:count]):
            out.append(engine.generate(p, params, det, chat=True))
            log(f"  alone {i + 1}/{count}")
        return out

    # The reference is the invariant plan; its bits do not depend on the batch (that
    # is checked below on the first few prompts), so it is computed as one batch.
    runs, times = {}, {}
    log(f"plan=invariant: batch of {n} (the reference)")
    runs[("reference", "batch")], times["plan=invariant"] = timed(
        lambda: inv.generate(prompts, params, chat=True))
    ref = [c.token_ids for c in runs[("reference", "batch")]]
    log(f"plan=invariant: alone, first {n_inv_alone} prompts (it costs `rows` x a fast step at batch 1)")
    runs[("reference", "alone")] = alone(inv, None, n_inv_alone)
    for name, det in (("OFF", None), ("VERIFIED", VERIFIED)):
        log(f"{name}: alone")
        runs[(name, "alone")] = alone(fast, det)
        log(f"{name}: batch of {n}")
        runs[(name, "batch")], times[name] = timed(lambda: fast.generate(prompts, params, det, chat=True))

    def distinct(name):
        a, b = runs[(name, "alone")], runs[(name, "batch")]
        return sum(x.token_ids != y.token_ids for x, y in zip(a, b))

    def off_ref(name):
        return sum(x.token_ids != r or y.token_ids != r
                   for x, y, r in zip(runs[(name, "alone")], runs[(name, "batch")], ref))

    vstats = [c.stats for c in runs[("VERIFIED", "alone")] + runs[("VERIFIED", "batch")]]
    steps = sum(s.decode_steps for s in vstats)
    trig = sum(s.triggers for s in vstats)
    by = {r: sum(getattr(s, f"triggers_{r}") for s in vstats) for r in ("margin", "window", "finish")}
    passes = sum(s.verify_passes for s in vstats)
    toks = 2 * n * T

    # 10% VERIFIED traffic in one batch.
    mix = [VERIFIED if i % 10 == 0 else None for i in range(n)]
    log("mixed 10% VERIFIED batch")
    mixed, t_mix = timed(lambda: fast.generate(prompts, params, mix, chat=True))
    log("plan=invariant on the same batch")
    _, t_inv_mix = timed(lambda: inv.generate(prompts, params, chat=True))
    mixed_ok = all(c.token_ids == ref[i] for i, c in enumerate(mixed) if mix[i] is not None)
    n_off = sum(1 for d in mix if d is None)
    fast.shutdown()
    inv.shutdown()

    print(f"at {commit()}; machine: {machine()}; {n} prompts x {T} tokens, bf16, greedy, "
          f"tau={fast.margin_threshold}, W={fast.max_window}, invariant rows={fast.invariant_plan.rows}, "
          f"split={fast.config.attention_split}\n")
    print("| mode | prompts whose alone and batch-of-%d outputs differ | prompts differing from the reference "
          "| batch wall time / OFF |" % n)
    print("| --- | --- | --- | --- |")
    for name in ("OFF", "VERIFIED", "reference"):
        label = "plan=invariant" if name == "reference" else name
        m = len(runs[(name, "alone")])
        t = times[label]
        print(f"| {label} | {distinct(name)} / {m} | {off_ref(name)} / {m} | {t / times['OFF']:.2f}x |")
    print()
    print("| VERIFIED accounting (alone + batch runs) | value |")
    print("| --- | --- |")
    print(f"| trigger rate (triggers / decode steps) | {trig / max(steps, 1):.1%} ({trig} / {steps}; "
          f"margin {by['margin']}, window {by['window']}, finish {by['finish']}) |")
    print(f"| verify passes per output token | {passes / toks:.3f} |")
    print(f"| replayed positions per output token | {sum(s.replayed_tokens for s in vstats) / toks:.2f} |")
    print(f"| rollbacks (mismatches) / rolled-back tokens | {sum(s.mismatches for s in vstats)} / "
          f"{sum(s.rolled_back_tokens for s in vstats)} |")
    print()
    print(f"| 10% VERIFIED traffic (batch of {n}, {n - n_off} VERIFIED) | value |")
    print("| --- | --- |")
    print(f"| VERIFIED outputs equal to the reference | {'yes' if mixed_ok else 'NO'} |")
    print(f"| wall time, gateeng mixed / plan=invariant on the same batch | {t_mix / t_inv_mix:.2f}x "
          f"({t_mix:.1f}s vs {t_inv_mix:.1f}s) |")
    # Every OFF request runs from start to end of the batch, so its tokens/s is T / wall time.
    print(f"| OFF per-request throughput kept vs the all-OFF batch | {times['OFF'] / t_mix:.1%} |")


if __name__ == "__main__":
    main()
