"""A/B of the fast plan: the plan in this checkout against gateeng/plan.py at an
earlier git revision, alternating in one process on the same model and prompts.

Reports the best-of-N steady decode step time at several batch sizes and the
ratio new/old. Usage: python bench/plan_ab.py --old-rev REV [--repeats 2]
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, prompt_set  # noqa: E402

from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine import Engine  # noqa: E402
from gateeng.loader import load  # noqa: E402
from gateeng.plan import FastPlan  # noqa: E402
from gateeng.request import DeterminismParams, SamplingParams  # noqa: E402
from gateeng.scheduler import Kind  # noqa: E402


def old_fast_plan(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:gateeng/plan.py"], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout
    path = Path(tempfile.mkdtemp()) / "plan_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("plan_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_old"] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.FastPlan


def step_ms(loaded, plan_cls, batch: int, steps: int = 8) -> float:
    engine = Engine(EngineConfig(), loaded=loaded)
    engine.runner.plans[Kind.FAST] = plan_cls()
    for p in prompt_set(batch, False):
        engine.scheduler.add(engine._make_request(p, SamplingParams(max_tokens=steps + 8, ignore_eos=True),
                                                  DeterminismParams(), None, True))
    for _ in range(3):   # prefill and the first decode steps
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-rev", required=True, help="git revision whose gateeng/plan.py is the baseline")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32,64")
    args = ap.parse_args()
    old = old_fast_plan(args.old_rev)
    loaded = load(None, "bfloat16")
    print(f"machine: {machine()}; old fast plan: {args.old_rev}\n")
    print("| running requests | old ms/step | new ms/step | new / old |")
    print("| --- | --- | --- | --- |")
    for b in (int(x) for x in args.batches.split(",")):
        o, n = [], []
        for _ in range(args.repeats):
            o.append(step_ms(loaded, old, b))
            n.append(step_ms(loaded, FastPlan, b))
        print(f"| {b} | {min(o):.1f} | {min(n):.1f} | {min(n) / min(o):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
