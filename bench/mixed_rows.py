"""OFF throughput kept under 10% VERIFIED traffic, for several invariant group sizes.

The CPU invariant plan runs rows in fixed groups of `invariant_rows`; a replay of a
few positions still pays for a whole group. This runs, in one process: the all-OFF
batch, then the same batch with every 10th request VERIFIED for each group size.
Usage: python bench/mixed_rows.py [--prompts 32] [--tokens 128] [--rows 4 8]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, prompt_set, timed  # noqa: E402

from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine import Engine  # noqa: E402
from gateeng.loader import load  # noqa: E402
from gateeng.request import DeterminismParams, Mode, SamplingParams  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8])
    args = ap.parse_args()
    loaded = load(None, "bfloat16")
    prompts = prompt_set(args.prompts, mixed=True)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    mix = [DeterminismParams(Mode.VERIFIED) if i % 10 == 0 else None for i in range(args.prompts)]
    base = Engine(EngineConfig(), loaded=loaded)
    base.generate(prompts[:2], SamplingParams(max_tokens=4))
    _, t_off = timed(lambda: base.generate(prompts, params, chat=True))
    base.shutdown()
    print(f"machine: {machine()}; {args.prompts} prompts x {args.tokens} tokens, bf16, "
          f"{sum(d is not None for d in mix)} VERIFIED\n")
    print("| invariant rows | mixed wall time / all-OFF | OFF per-request throughput kept |")
    print("| --- | --- | --- |")
    for rows in args.rows:
        e = Engine(EngineConfig(invariant_rows=rows), loaded=loaded)
        e.generate(prompts[:2], SamplingParams(max_tokens=4))
        _, t_mix = timed(lambda: e.generate(prompts, params, mix, chat=True))
        e.shutdown()
        print(f"| {rows} | {t_mix / t_off:.2f}x | {t_off / t_mix:.1%} |", flush=True)


if __name__ == "__main__":
    main()
