"""What the reference (gateeng-ref-1) costs per decode step, against the
machine-specific invariant plan it replaced and the fast plan.

One process, one loaded model (the embedded SmolLM2, bf16), one engine. Its runner
times decode passes (rows, forward, lm_head, sampling, as a step runs them; the
start-up pricing's timer) with each plan swapped in as its fast plan in turn
(EngineCore.replace_fast_plan: the engine's own assembly, as a weight swap uses):
  fast            the fast plan (for scale)
  machine-v4      the invariant plan before the reference: this CPU's row-invariant
                  C++ kernels built with -march=native -ffast-math (cpu_ops.cpp),
                  whose bits change with the CPU kind
  ref-<isa>       the reference on each build this CPU runs
at 1, 8 and 32 rows, each row attending --context keys. Every round runs every
plan once per row count, interleaved, so the host's noise falls on all alike; the
table gives each plan's median over rounds and its median per-round ratio to
machine-v4.

Usage: python bench/reference.py [--rounds 7] [--context 256] [--rows 1 8 32]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import header  # noqa: E402
from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine import pricing  # noqa: E402
from gateeng.engine.engine import Engine  # noqa: E402
from gateeng.model.loader import load  # noqa: E402
from gateeng.plans import cpu_ops, packing, reference_ops  # noqa: E402
from gateeng.plans.generic import InvariantPlan, default_invariant_rows  # noqa: E402
from gateeng.plans.reference import ReferencePlan  # noqa: E402
from gateeng.reproducibility import cpu_model_and_isa  # noqa: E402
from gateeng.step import PlanKind  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=256, help="keys each decode row attends")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    print(header())
    # The bf16 model (a GGUF dequantized): a model handed in keeps its plain weights, which
    # machine-v4's float32 lm_head needs.
    engine = Engine(EngineConfig(plan="invariant", num_kv_blocks=64 + max(args.rows) * 2),
                    loaded=load(None, dequantize=True))
    core = engine.core
    model = core.model
    stored = packing.of(model)
    kernels = cpu_ops.load()
    plans = {"fast": core.fast_plan,
             "machine-v4": InvariantPlan(default_invariant_rows(cpu_model_and_isa()[1]), 64, stored.invariant_packed,
                                         kernels, core.config.block_size, stored.invariant_matmul)}
    for isa in reference_ops.runnable():
        plans[f"ref-{isa}"] = ReferencePlan(model, reference_ops.load(isa), core.config.block_size)
    print("plans:", "; ".join(f"{name}: {getattr(p, 'describe', lambda: core.fast_matmul)()}"
                              for name, p in plans.items()))
    seconds = {(name, rows): [] for name in plans for rows in args.rows}
    for r in range(args.rounds):
        for rows in args.rows:
            for name, plan in plans.items():
                core.replace_fast_plan(plan)
                timer = pricing.decode_pass_timer(core.runner, core.blocks, args.context)
                timer(PlanKind.FAST, rows)   # the shape's first pass: set-up, not cost
                seconds[(name, rows)].append(min(timer(PlanKind.FAST, rows) for _ in range(2)))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    engine.shutdown()
    print(f"\ndecode pass, {args.context} keys per row, median of {args.rounds} rounds "
          f"(ms; ratio: median per-round ratio to machine-v4)\n")
    print("| plan | " + " | ".join(f"{rows} rows" for rows in args.rows) + " |")
    print("| --- |" + " --- |" * len(args.rows))
    for name in plans:
        cells = []
        for rows in args.rows:
            mine, base = seconds[(name, rows)], seconds[("machine-v4", rows)]
            ratio = statistics.median(a / b for a, b in zip(mine, base))
            cells.append(f"{statistics.median(mine) * 1e3:.1f} ms ({ratio:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
