"""Where a decode step's time goes, at 1, 8, 32 and 64 running requests, per plan.

Each of the plan's parts is wrapped in a wall-clock timer (projections,
attention, norms with the residual adds, RoPE with the KV store, the SiLU gate,
the lm_head with the token choice, and the one-call decoder layers the fast
plan uses on AVX-512), a steady decode step (every prompt
prefilled) is run several times, and the rest of the step (embedding, step
metadata, scheduling, Python) is reported as "other". Timers add about a
microsecond per call. Prints the CPU and its ISA.
With --plans fast,invariant both plans are profiled, the invariant one on an
engine with plan=invariant (every request decodes on it).
Usage: python bench/step_profile.py [--batches 1,8,32,64] [--steps 8] [--plans fast] [--model FILE]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import header, prompt_set, steady_decode  # noqa: E402

from gateeng.plans import head as head_module  # noqa: E402
from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine.core import EngineCore  # noqa: E402
from gateeng.model.loader import load  # noqa: E402
from gateeng.request import SamplingParams  # noqa: E402

PARTS = {"linear": "projections (q/k/v, o, gate/up, down)", "attention": "attention",
         "rms_norm": "RMSNorm", "add_rms_norm": "residual add + RMSNorm", "rope_store": "RoPE + KV store",
         "silu_mul": "SiLU gate",
         # On AVX-512 a decode step without prefill runs every decoder layer in one C++
         # call; the op timers above then stay at zero for the fast plan.
         "decode_layers": "decoder layers in one C++ call"}


def timed(fn, totals, key):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0
    return wrapper


def profile(loaded, batch: int, steps: int, plan: str = "fast", rounds: int = 3) -> dict:
    engine = EngineCore(EngineConfig(dtype="bfloat16", plan=plan), loaded=loaded)
    timed_plan = engine.fast_plan if plan == "fast" else engine.invariant_plan
    totals = defaultdict(float)
    for name in PARTS:
        setattr(timed_plan, name, timed(getattr(timed_plan, name), totals, name))
    import gateeng.plans.runner as runner_module
    runner_module.choose = timed(head_module.choose, totals, "lm_head")
    for p in prompt_set(batch, False):
        engine.add_request(engine.new_request(p, SamplingParams(max_tokens=160, ignore_eos=True), chat=True))
    steady_decode(engine)
    best = None
    for _ in range(rounds):
        totals.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t0) / steps * 1000
        if best is None or wall < best["step"]:
            best = {"step": wall, **{k: v / steps * 1000 for k, v in totals.items()}}
    runner_module.choose = head_module.choose
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--plans", default="fast", help="fast, invariant or fast,invariant")
    ap.add_argument("--model", default=None, help="a model as `gateeng serve --model` takes it (default: the "
                                                  "embedded one); a GGUF's quantized weights served as stored")
    args = ap.parse_args()
    loaded = load(args.model, "bfloat16")
    plans = args.plans.split(",")
    # Batch by batch, the plans in turn: both see the same state of the host.
    rows = {(b, p): profile(loaded, b, args.steps, p) for b in (int(x) for x in args.batches.split(","))
            for p in plans}
    print(f"{header()}\n")
    parts = list(PARTS) + ["lm_head"]
    labels = [PARTS.get(p, "lm_head + token choice") for p in parts] + ["other", "step"]
    print("| running requests | plan | " + " | ".join(labels) + " |")
    print("| --- " * (len(labels) + 2) + "|")
    for (b, plan), r in rows.items():
        other = r["step"] - sum(r.get(p, 0.0) for p in parts)
        cells = [f"{r.get(p, 0.0):.1f}" for p in parts] + [f"{other:.1f}", f"**{r['step']:.1f}**"]
        print(f"| {b} | {plan} | " + " | ".join(cells) + " |")
    print("\nms per decode step (best of 3 rounds).")


if __name__ == "__main__":
    main()
