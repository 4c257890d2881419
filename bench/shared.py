"""A shared machine: one stream's decode speed with the server's default compute
threads against `--threads 1` (and against a fixed thread per core), in three
settings, on the embedded model:

- quota:     the server in a cgroup (v1) with a CPU quota of one CPU;
- neighbour: beside a busy process pinned to one of the cores;
- quiet:     alone.

    python bench/shared.py [--rounds 2] [--tokens 96] [--prompts 4] [--out bench/shared.json]

The modes alternate within each setting and round, one server at a time. Per
setting: each mode's output tokens/s over its run (one stream, answers one after
another; the best of the rounds) and the ratios. The quota setting needs root and a cgroup v1 CPU controller at
/sys/fs/cgroup/cpu; where there is none it is reported as not run, with the reason.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import header, report_path  # noqa: E402
from peer import load  # noqa: E402
from serve import prompts  # noqa: E402
from servers import Server  # noqa: E402

CORES = len(os.sched_getaffinity(0))
# The default against --threads 1; and a fixed count of every core, which is what the
# default was before it followed the neighbours (what the choice between steps avoids).
MODES = {"default threads": (), "--threads 1": ("--threads", "1"), f"--threads {CORES}": ("--threads", str(CORES))}
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


class Quota:
    """A cgroup v1 CPU group with a quota of `cpus` CPUs; `prefix` runs a command in it."""

    def __init__(self, cpus: float):
        if not (CGROUP_V1 / "cpu.cfs_quota_us").exists():
            raise RuntimeError(f"no cgroup v1 CPU controller at {CGROUP_V1}")
        self.dir = CGROUP_V1 / f"gateeng-bench-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()   # PermissionError without root: reported as not run
        (self.dir / "cpu.cfs_period_us").write_text("100000")
        (self.dir / "cpu.cfs_quota_us").write_text(str(int(cpus * 100000)))
        self.prefix = ("sh", "-c", f'echo $$ > {self.dir}/cgroup.procs && exec "$@"', "sh")

    def close(self) -> None:
        self.dir.rmdir()


class Neighbour:
    """A busy process pinned to the last core of this process's mask."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        os.sched_setaffinity(self.proc.pid, {max(os.sched_getaffinity(0))})

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def one_stream(server: Server, texts: list, tokens: int) -> dict:
    asyncio.run(load(server.url, texts[:2], 1, 8))   # warm up; the threads settle meanwhile
    run = asyncio.run(load(server.url, texts, 1, tokens))
    # Output tokens over the run's wall time: a thread parked by the quota or a neighbour
    # shows in it (the median gap between tokens would hide the stalls).
    return {"decode_tok_s": run["tokens_per_s"], "itl_p50_ms": run["itl_p50_ms"], "itl_p99_ms": run["itl_p99_ms"]}


def setting(name: str, args, texts: list) -> dict:
    rounds = {mode: [] for mode in MODES}
    for r in range(args.rounds):
        for mode, flags in MODES.items():
            quota = Quota(1.0) if name == "quota" else None
            try:
                with Server.gateeng(*flags, name=f"gateeng {mode}", prefix=quota.prefix if quota else ()) as server:
                    neighbour = Neighbour() if name == "neighbour" else None
                    try:
                        got = one_stream(server, texts, args.tokens)
                    finally:
                        if neighbour:
                            neighbour.close()
            finally:
                if quota:
                    quota.close()
            rounds[mode].append(got)
            print(f"  {name}, round {r + 1}, {mode}: {got['decode_tok_s']:.1f} tok/s "
                  f"(gap p50 {got['itl_p50_ms']:.1f} ms, p99 {got['itl_p99_ms']:.1f} ms)", file=sys.stderr, flush=True)
    best = {mode: max(x["decode_tok_s"] for x in runs) for mode, runs in rounds.items()}
    return {"rounds": rounds, "best_tok_s": best, "ratio": best["default threads"] / best["--threads 1"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96, help="tokens per answer (ignore_eos)")
    ap.add_argument("--prompts", type=int, default=4, help="answers per run, one at a time")
    ap.add_argument("--settings", nargs="+", default=["quota", "neighbour", "quiet"],
                    choices=["quota", "neighbour", "quiet"])
    ap.add_argument("--out", type=Path, default=report_path("shared.json"))
    args = ap.parse_args()
    print(header(), file=sys.stderr, flush=True)
    texts = prompts(args.prompts)
    report = {"header": header(), "settings": {}}
    for name in args.settings:
        try:
            report["settings"][name] = setting(name, args, texts)
        except (RuntimeError, PermissionError) as e:
            if name != "quota":
                raise
            report["settings"][name] = {"not_run": str(e)}
    fixed = f"--threads {CORES}"
    lines = [f"| setting | default threads, tok/s | --threads 1, tok/s | {fixed}, tok/s | default / --threads 1 "
             f"| {fixed} / --threads 1 |", "|---|---|---|---|---|---|"]
    for name, got in report["settings"].items():
        if "not_run" in got:
            lines.append(f"| {name} | not run: {got['not_run']} | | | | |")
        else:
            b = got["best_tok_s"]
            lines.append(f"| {name} | {b['default threads']:.1f} | {b['--threads 1']:.1f} | {b[fixed]:.1f} "
                         f"| {got['ratio']:.2f}x | {b[fixed] / b['--threads 1']:.2f}x |")
    report["table"] = "\n".join(lines)
    args.out.write_text(json.dumps(report, indent=1))
    print(report["header"] + "\n\n" + report["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
