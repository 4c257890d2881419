"""`gateeng fleet` on a two-node Ray cluster on loopback (ray.cluster_utils.Cluster,
one CPU per node): decode throughput of a fleet of 1 and of 2 replicas (one thread
each) of the embedded model in bf16, side by side in one run, and the time a weight
push takes (read once, shipped through the object store, prepared on every replica,
swapped at the version barrier).

Each round starts a fleet, submits --requests OFF requests of --max-tokens tokens at
once through Fleet.submit (the path both fronts take: tokenizing, routing, Ray's
streams), and times them to the last completion; then it pushes the nudged copy of
the weights. The 1- and 2-replica fleets alternate, --rounds times each; the table
gives medians.

Usage: python bench/fleet.py [--rounds 2] [--requests 16] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))

from ray_cluster import local_cluster  # noqa: E402  (before Ray loads: every node on 127.0.0.1)

import ray  # noqa: E402

from common import header, prompt_set, report_path  # noqa: E402
from weight_update import save_bf16_dirs  # noqa: E402


def one_round(cfg, replicas: int, prompts: list, max_tokens: int, new_dir: Path, address: str) -> dict:
    from gateeng.fleet.fleet import Fleet
    from gateeng.outputs import Completion
    from gateeng.request import SamplingParams
    fleet = Fleet(cfg, replicas, 1, None, 0, address)
    try:
        events: queue.Queue = queue.Queue()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        for p in prompts:
            fleet.submit(p, params, sink=events.put)
        tokens, done = 0, 0
        while done < len(prompts):
            ev = events.get(timeout=600)
            if isinstance(ev, Exception):
                raise ev
            if isinstance(ev, Completion):
                tokens, done = tokens + ev.completion_tokens, done + 1
        seconds = time.perf_counter() - t0
        push = fleet.update_weights(new_dir)
        return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                "push_seconds": push.seconds, "weight_version": push.weight_version}
    finally:
        fleet.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=str(report_path("fleet.json")))
    args = ap.parse_args()
    from gateeng.config import EngineConfig
    print(header(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="gateeng-bench-fleet-"))
    model_dir, new_dir = save_bf16_dirs(root)
    cluster = local_cluster(2)
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
    cfg = EngineConfig(model=str(model_dir), dtype="bfloat16", max_model_len=512)
    prompts = prompt_set(args.requests, mixed=False)
    runs: dict = {1: [], 2: []}
    try:
        for _ in range(args.rounds):
            for replicas in (1, 2):
                r = one_round(cfg, replicas, prompts, args.max_tokens, new_dir, cluster.address)
                runs[replicas].append(r)
                print(f"{replicas} replica(s): {r['tokens_per_s']:.1f} tokens/s ({r['tokens']} tokens in "
                      f"{r['seconds']:.1f} s); weight push {r['push_seconds']:.2f} s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "push_seconds")}
           for n, rs in runs.items()}
    print()
    print("| replicas | tokens/s (median) | vs 1 replica | weight push (median) |")
    print("| --- | --- | --- | --- |")
    for n in (1, 2):
        print(f"| {n} | {med[n]['tokens_per_s']:.1f} | {med[n]['tokens_per_s'] / med[1]['tokens_per_s']:.2f}x | "
              f"{med[n]['push_seconds']:.2f} s |")
    Path(args.out).write_text(json.dumps({"header": header(), "runs": runs, "median": med}, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
