"""Tensor parallelism on the embedded model: VERIFIED bits at every size, the fast
plan's differences between sizes, and throughput per size.

Each round starts one engine per size in --sizes, one after another (one
tensor-parallel group per process), with --threads threads per rank (default:
the engine's, this machine's threads shared out over the ranks: on 2 cores, size
1 takes both, 2 ranks a core each, and 4 ranks share them). On each, the same
--prompts chat prompts x --tokens tokens, greedy with the top-2 logprobs, are
submitted together, VERIFIED (the default adaptive route), then OFF, then one OFF
prompt alone (one stream). Every answer is compared with the first size's, token
ids and logprob bits: VERIFIED promises 0 differences, OFF promises nothing and its
count is reported. Throughput is output tokens over wall seconds of each batch;
ratios are against the first size in the same round, and the table shows their
median over rounds.

Usage: python bench/tensor_parallel.py [--prompts 16] [--tokens 64] [--sizes 1,2,4] [--rounds 2]
       [--threads N] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import command, commit, header, machine, prompt_set, report_path  # noqa: E402

import torch  # noqa: E402

from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine.engine import Engine  # noqa: E402
from gateeng.model.loader import load  # noqa: E402
from gateeng.request import DeterminismParams, Mode, SamplingParams  # noqa: E402

KINDS = ("verified", "off", "one_stream")
CORES = torch.get_num_threads()   # torch's choice at start-up


def bits(c) -> tuple:
    return tuple(c.token_ids), tuple((lp.token, lp.logprob.hex(), tuple((t, v.hex()) for t, v in lp.top))
                                     for lp in c.logprobs)


def run_size(loaded, size: int, prompts: list, tokens: int, threads: int) -> dict:
    torch.set_num_threads(threads or CORES)   # as a fresh process starts (a size > 1 engine sets its own)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(tensor_parallel_size=size, num_threads=threads), loaded=loaded)
    started = time.perf_counter() - t0
    params = SamplingParams(max_tokens=tokens, logprobs=2, ignore_eos=True)
    out = {"start_s": started}
    try:
        for kind, mode, batch in (("verified", Mode.VERIFIED, prompts), ("off", Mode.OFF, prompts),
                                  ("one_stream", Mode.OFF, prompts[:1])):
            t = time.perf_counter()
            done = engine.generate(batch, params, DeterminismParams(mode), chat=True)
            wall = time.perf_counter() - t
            out[kind] = {"bits": [bits(c) for c in done], "tok_s": sum(len(c.token_ids) for c in done) / wall}
        out["record"] = done[0].reproducibility.tensor_parallel_size
    finally:
        engine.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per rank (default: the engine's, this machine's threads shared out over the "
                         "ranks)")
    ap.add_argument("--out", default=str(report_path("tensor_parallel.json")))
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    machine = header()   # before any engine: a size > 1 engine sets this process's torch threads
    print(machine, file=sys.stderr)
    loaded = load(None, "bfloat16")
    prompts = prompt_set(args.prompts, mixed=True)
    rounds = []
    for r in range(args.rounds):
        results = {}
        for size in sizes:
            print(f"round {r + 1}/{args.rounds}: tensor-parallel size {size}", file=sys.stderr)
            results[size] = run_size(loaded, size, prompts, args.tokens, args.threads)
        rounds.append(results)
    base = sizes[0]
    rows = []
    for size in sizes:
        differ = {kind: max(sum(a != b for a, b in zip(rnd[size][kind]["bits"], rnd[base][kind]["bits"]))
                            for rnd in rounds) for kind in ("verified", "off")}
        off_tokens = max(sum(a[0] != b[0] for a, b in zip(rnd[size]["off"]["bits"], rnd[base]["off"]["bits"]))
                         for rnd in rounds)
        ratio = {kind: statistics.median(rnd[size][kind]["tok_s"] / rnd[base][kind]["tok_s"] for rnd in rounds)
                 for kind in KINDS}
        tok_s = {kind: statistics.median(rnd[size][kind]["tok_s"] for rnd in rounds) for kind in KINDS}
        rows.append({"size": size, "verified_differ": differ["verified"], "off_differ": differ["off"],
                     "off_tokens_differ": off_tokens,
                     "tok_s": tok_s, "ratio": ratio, "start_s": statistics.median(rnd[size]["start_s"]
                                                                                  for rnd in rounds)})
    # VERIFIED answers must also be equal from round to round (the same engine, run again).
    repeat = all(rnd[s]["verified"]["bits"] == rounds[0][s]["verified"]["bits"] for rnd in rounds for s in sizes)
    n = args.prompts
    print(f"\n{machine}\n")
    print(f"| TP size | VERIFIED differing from TP={base} (tokens or logprob bits) | OFF: tokens differ | OFF: "
          f"tokens or logprob bits differ | VERIFIED tok/s (x TP={base}) | OFF tok/s (x) | one stream OFF tok/s (x) | "
          f"start-up s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        cells = " | ".join(f"{row['tok_s'][k]:.1f} ({row['ratio'][k]:.2f}x)" for k in KINDS)
        print(f"| {row['size']} | {row['verified_differ']} of {n} | {row['off_tokens_differ']} of {n} | "
              f"{row['off_differ']} of {n} | {cells} | "
              f"{row['start_s']:.1f} |")
    print(f"\nVERIFIED answers equal in every round: {repeat}")
    Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "command": command(),
                                          "args": vars(args), "rows": rows, "verified_equal_every_round": repeat}, indent=1))
    ok = repeat and all(row["verified_differ"] == 0 for row in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
