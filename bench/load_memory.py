"""Start-up memory: a server's peak RSS while it loads and packs a model, against its
steady RSS once it serves.

For each model, `gateeng serve --model M` (defaults otherwise) is started; once its
health check says SERVING, the process's VmHWM (the peak resident set since it
started) and VmRSS are read from /proc, and again after a few requests. The
weights are in memory once when serving (the one packed copy); loading must not hold
them twice on the way there.

Models: the embedded SmolLM2-135M (its GGUF, converted once and cached) and, with
--random SHAPE, a random-weight Llama of that shape written here as a bf16
safetensors directory (bench/models.py; `1b`: TinyLlama-1.1B's shape with SmolLM2's
vocabulary, 1.17B parameters, 2.3 GB).

With --tensor-parallel-size N (repeatable), each model is served at each size, and
every rank is read: the server (the driver, rank 0) and its worker processes.

Usage: python bench/load_memory.py [--random 1b] [--model PATH ...] [--keep DIR]
                                   [--tensor-parallel-size N ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import command, commit, header, machine, report_path  # noqa: E402
from bench.models import SHAPES, random_llama  # noqa: E402
from bench.serve import ServerProcess, make_request, run_one  # noqa: E402

def status_mb(pid: int) -> dict:
    """VmHWM and VmRSS of a process, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def workers(pid: int) -> list:
    """The tensor-parallel workers a server started (torch.multiprocessing's spawned
    children), in start order."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    return sorted(c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())


def measure(model: str, requests: int, size: int = 1) -> dict:
    import asyncio

    import grpc

    from gateeng.v1 import engine_pb2_grpc as pb_grpc
    server = ServerProcess("--model", model, "--tensor-parallel-size", str(size))
    try:
        at_start = status_mb(server.proc.pid)
        ranks = workers(server.proc.pid)

        async def serve_some():
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = pb_grpc.EngineStub(channel)
                for i in range(requests):
                    await run_one(stub, make_request(f"Tell me about the number {i}.", i % 2 == 0, 16), "x", i)
        asyncio.run(serve_some())
        after = status_mb(server.proc.pid)
        others = [status_mb(pid) for pid in ranks]
    finally:
        server.stop()
    return {"model": model, "tensor_parallel_size": size, "peak_mb": after["VmHWM"],
            "rss_serving_mb": at_start["VmRSS"], "peak_at_serving_mb": at_start["VmHWM"],
            "rss_after_mb": after["VmRSS"], "requests": requests, "peak_over_steady": after["VmHWM"] / after["VmRSS"],
            "workers": [{"rss_after_mb": w["VmRSS"], "peak_mb": w["VmHWM"]} for w in others]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="a model to serve (repeatable)")
    ap.add_argument("--random", choices=sorted(SHAPES), action="append", default=[],
                    help="also a random-weight Llama of this shape (repeatable)")
    ap.add_argument("--no-embedded", action="store_true", help="leave the embedded model out")
    ap.add_argument("--requests", type=int, default=8, help="requests served before the second reading")
    ap.add_argument("--keep", default=None, metavar="DIR", help="write (or reuse) the random models here")
    ap.add_argument("--tensor-parallel-size", type=int, action="append", default=[], metavar="N",
                    help="serve each model at this size (repeatable; default 1)")
    ap.add_argument("--out", default=str(report_path("load_memory.json")))
    args = ap.parse_args()
    print(header(), flush=True)
    from gateeng.model.loader import default_model_path
    models = ([] if args.no_embedded else [str(default_model_path())]) + args.model
    with tempfile.TemporaryDirectory(prefix="load-memory-") as tmp:
        for shape in args.random:
            models.append(str(random_llama(Path(args.keep or tmp) / f"random-{shape}", shape)))
        rows = []
        for model in models:
            for size in args.tensor_parallel_size or [1]:
                rows.append(measure(model, args.requests, size))
                r = rows[-1]
                print(f"  {Path(model).name} at TP {size}: peak {r['peak_mb']:.0f} MiB, serving "
                      f"{r['rss_after_mb']:.0f} MiB, peak / serving {r['peak_over_steady']:.2f}x; workers "
                      f"{[round(w['rss_after_mb']) for w in r['workers']]} MiB", file=sys.stderr, flush=True)
    print("\n| model | TP | RSS serving (MiB) | peak RSS (MiB) | peak / serving | workers: RSS serving (peak), MiB |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ranks = ", ".join(f"{w['rss_after_mb']:.0f} ({w['peak_mb']:.0f})" for w in r["workers"]) or "-"
        print(f"| {Path(r['model']).name} | {r['tensor_parallel_size']} | {r['rss_after_mb']:.0f} | "
              f"{r['peak_mb']:.0f} | {r['peak_over_steady']:.2f}x | {ranks} |")
    Path(args.out).write_text(json.dumps({"machine": machine(), "commit": commit(), "command": command(),
                                          "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
