"""Mixed traffic: what OFF requests keep and what VERIFIED requests cost.

One process, one loaded model, the same prompts in every mode (greedy, bf16):
  all OFF; 10 / 50 / 100% VERIFIED (adaptive route); plan=invariant (the
  server-wide batch-invariant mode); and, at 10% VERIFIED, the VERIFIED latency
  increment (a VERIFIED request's TPOT minus the TPOT the same request had in the
  all-OFF run) for the margin gate, window-only verification (tau = 0, W = 64)
  and always-verify (W = 1).
A mode is one batch submitted at once; TPOT is measured per request from the
arrival times of its streamed tokens (a VERIFIED_ONLY stream shows a token once
it is verified, so verification delays count).

Usage: python bench/mixed.py [--prompts 20] [--tokens 96] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, prompt_set  # noqa: E402

from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine import Engine  # noqa: E402
from gateeng.loader import load  # noqa: E402
from gateeng.outputs import Chunk, Completion  # noqa: E402
from gateeng.request import DeterminismParams, Mode, SamplingParams  # noqa: E402


def run(engine, prompts, params, dets):
    """(wall seconds, per request: (mode, tokens, e2e s, tpot s), completions)."""
    times = [[] for _ in prompts]
    done = [None] * len(prompts)
    t0 = time.perf_counter()
    handles = engine.submit_many(prompts, params, dets, chat=True)

    def collect(i, h):
        for ev in h:
            if isinstance(ev, Chunk) and ev.token_ids:
                times[i].extend([time.perf_counter()] * len(ev.token_ids))
            elif isinstance(ev, Completion):
                done[i] = (ev, time.perf_counter())

    threads = [threading.Thread(target=collect, args=(i, h)) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    rows = []
    for ts, (c, end) in zip(times, done):
        tpot = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else float("nan")
        rows.append((c.mode, c.completion_tokens, end - t0, tpot))
    return wall, rows, [c for c, _ in done]


def tput(rows, idx):
    """Tokens per second of these requests: their tokens over their summed times."""
    return sum(rows[i][1] for i in idx) / sum(rows[i][2] for i in idx)


def tpot(rows, idx):
    return statistics.median(rows[i][3] for i in idx)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens = 8, 16
    n = args.prompts
    loaded = load(None, "bfloat16")
    prompts = prompt_set(n, mixed=True)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    print(f"machine: {machine()}", flush=True)

    def engine(**kw):
        e = Engine(EngineConfig(**kw), loaded=loaded)
        e.generate(prompts[:2], SamplingParams(max_tokens=4), chat=True)   # warm-up
        return e

    def mix(frac, det=DeterminismParams(Mode.VERIFIED)):
        k = round(n * frac)
        step = n / k if k else 0
        ver = {int(i * step) for i in range(k)}
        return [det if i in ver else None for i in range(n)], sorted(ver)

    base = engine()
    run(base, prompts, params, [None] * n)   # the process's first full batch runs slower: not timed
    print(f"invariant plan: {base.invariant_plan.describe()}; tau={base.margin_threshold}, "
          f"W={base.max_window}; {n} chat prompts x {args.tokens} tokens, greedy\n", flush=True)
    t_off, rows_off, _ = run(base, prompts, params, [None] * n)
    base.shutdown()
    e = engine(plan="invariant")
    t_inv, rows_inv, ref = run(e, prompts, params, [None] * n)
    e.shutdown()

    print("| mode | wall time | vs all-OFF | OFF throughput kept | OFF TPOT | VERIFIED TPOT | "
          "VERIFIED vs plan=invariant | decode steps speculative / direct | VERIFIED == reference |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| all OFF | {t_off:.1f} s | 1.00x | 100% | {tpot(rows_off, range(n)) * 1e3:.0f} ms | - | - | - | - |")
    for frac in (0.1, 0.5, 1.0):
        dets, ver = mix(frac)
        off = [i for i in range(n) if i not in ver]
        e = engine()
        wall, rows, comps = run(e, prompts, params, dets)
        e.shutdown()
        kept = f"{tput(rows, off) / tput(rows_off, off):.1%}" if off else "-"
        off_tpot = f"{tpot(rows, off) * 1e3:.0f} ms" if off else "-"
        spec = sum(comps[i].stats.decode_steps for i in ver)
        direct = sum(comps[i].stats.direct_steps for i in ver)
        same = all(comps[i].token_ids == ref[i].token_ids for i in ver)
        print(f"| {frac:.0%} VERIFIED | {wall:.1f} s | {wall / t_off:.2f}x | {kept} | {off_tpot} | "
              f"{tpot(rows, ver) * 1e3:.0f} ms | {tput(rows, ver) / tput(rows_inv, ver):.2f}x | "
              f"{spec} / {direct} | {'yes' if same else 'NO'} |", flush=True)
    print(f"| plan=invariant | {t_inv:.1f} s | {t_inv / t_off:.2f}x | - | - | "
          f"{tpot(rows_inv, range(n)) * 1e3:.0f} ms | 1.00x | - | (is the reference) |\n", flush=True)

    print("VERIFIED latency increment at 10% VERIFIED: median over the VERIFIED requests of their TPOT "
          "minus their TPOT in the all-OFF run\n")
    print("| verification | tau | W | increment | vs always-verify | OFF TPOT vs all-OFF | replayed tokens | "
          "rollbacks |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for name, tau, w in (("margin gate", None, None), ("window-only", 0.0, 64), ("always-verify", None, 1)):
        dets, ver = mix(0.1, DeterminismParams(Mode.VERIFIED, margin_threshold=tau, max_window=w))
        off = [i for i in range(n) if i not in ver]
        e = engine()
        _, rows, comps = run(e, prompts, params, dets)
        shown_tau = e.margin_threshold if tau is None else tau
        shown_w = e.max_window if w is None else w
        e.shutdown()
        inc = statistics.median(rows[i][3] - rows_off[i][3] for i in ver)
        off_ratio = tpot(rows, off) / tpot(rows_off, off)
        replayed = sum(comps[i].stats.replayed_tokens for i in ver)
        rollbacks = sum(comps[i].stats.mismatches for i in ver)
        results.append((name, shown_tau, shown_w, inc, off_ratio, replayed, rollbacks))
    always = results[-1][3]
    for name, tau, w, inc, off_ratio, replayed, rollbacks in results:
        ratio = f"{inc / always:.2f}x" if always > 0 else "-"
        print(f"| {name} | {tau:g} | {w} | {inc * 1e3:+.1f} ms | {ratio} | {off_ratio:.2f}x | {replayed} | "
              f"{rollbacks} |", flush=True)


if __name__ == "__main__":
    main()
