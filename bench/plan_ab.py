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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_step_ms, machine  # noqa: E402

from gateeng.loader import load  # noqa: E402
from gateeng.plan import FastPlan  # noqa: E402


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
            o.append(decode_step_ms(loaded, b, fast_plan=old()))
            n.append(decode_step_ms(loaded, b, fast_plan=FastPlan(packed=loaded.model.packed)))
        print(f"| {b} | {min(o):.1f} | {min(n):.1f} | {min(n) / min(o):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
