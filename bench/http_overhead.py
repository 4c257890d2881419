"""What the OpenAI-compatible HTTP front adds over gRPC, and what oversized HTTP
prompts cost the other clients, against one `gateeng serve --http-port` started here.

    python bench/http_overhead.py [--requests 30] [--max-tokens 16] [--neighbours 8]

Overhead: each pair sends the same greedy prompt over gRPC (Complete) and over
HTTP (/v1/completions, via the `openai` client; the token counts are checked),
one at a time, so the engine serves one request at a time either way (prefix
caching off, so the second front of a pair does not find the first one's prompt
cached). Prints p50 / p90 latency per front and the ratio of the medians.

Oversized prompts: a tiny gRPC Complete (5 prompt tokens, 1 output token), idle,
then while --neighbours HTTP clients send 580 KB prompts back to back (each is
refused by its bytes, 400, before tokenizing), then idle again. Prints the tiny
request's p50 / p90 in each phase, loaded / idle, and the refusals' latency.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine  # noqa: E402
from bench.serve import ServerProcess, free_port  # noqa: E402
from gateeng.serving.client import Client  # noqa: E402
from gateeng.request import SamplingParams  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--neighbours", type=int, default=8, help="HTTP clients sending 580 KB prompts")
    args = ap.parse_args(argv)
    import openai
    http_port = free_port()
    server = ServerProcess("--http-port", str(http_port), "--no-prefix-caching")   # same work per front
    grpc_s, http_s = [], []
    try:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        model = api.models.list().data[0].id
        with Client(server.target) as client:
            for i in range(args.requests):
                ids = list(range(100 + i, 140 + i))      # token ids: both fronts see the same prompt
                t0 = time.perf_counter()
                g = client.complete(ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
                t1 = time.perf_counter()
                h = api.completions.create(model=model, prompt=ids, max_tokens=args.max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True})
                t2 = time.perf_counter()
                assert h.usage.completion_tokens == len(g.token_ids) == args.max_tokens
                if i:                                    # the first pair warms both paths
                    grpc_s.append(t1 - t0)
                    http_s.append(t2 - t1)
            neighbours = oversized_neighbours(client, http_port, args.requests, args.neighbours)
    finally:
        server.stop()
    print(f"Machine: {machine()}")
    print(f"{len(grpc_s)} requests per front, {args.max_tokens} tokens each, one at a time\n")
    print("| front | p50 (ms) | p90 (ms) |\n| --- | --- | --- |")
    print(f"| gRPC Complete | {q(grpc_s, 50):.1f} | {q(grpc_s, 90):.1f} |")
    print(f"| HTTP /v1/completions (openai client) | {q(http_s, 50):.1f} | {q(http_s, 90):.1f} |")
    print(f"\nHTTP / gRPC, median: {statistics.median(http_s) / statistics.median(grpc_s):.3f}x "
          f"(+{(statistics.median(http_s) - statistics.median(grpc_s)) * 1000:.1f} ms)")
    idle, loaded, idle_after, refusals, statuses = neighbours
    print(f"\nA tiny gRPC Complete ({len(idle)} per phase) beside {args.neighbours} HTTP clients sending "
          f"580 KB prompts back to back ({len(refusals)} sent; statuses {statuses})\n")
    print("| phase | p50 (ms) | p90 (ms) |\n| --- | --- | --- |")
    for name, xs in (("idle", idle), ("580 KB prompts arriving", loaded), ("idle again", idle_after)):
        print(f"| {name} | {q(xs, 50):.1f} | {q(xs, 90):.1f} |")
    print(f"| (each 580 KB refusal) | {q(refusals, 50):.1f} | {q(refusals, 90):.1f} |")
    base = statistics.median(idle + idle_after)
    print(f"\nloaded / idle, median: {statistics.median(loaded) / base:.2f}x")
    return 0 if set(statuses) == {400} else 1


def q(xs, p):
    return sorted(xs)[int(p / 100 * (len(xs) - 1))] * 1000


def oversized_neighbours(client, http_port: int, n: int, clients: int):
    """(idle, loaded, idle again) latencies of a tiny gRPC request, the latencies
    of the oversized HTTP requests, and their statuses."""
    body = json.dumps({"prompt": "word " * 116_000, "max_tokens": 1}).encode()     # 580 KB
    tiny = SamplingParams(max_tokens=1, ignore_eos=True)

    def probe() -> list:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            client.complete([5, 6, 7, 8, 9], tiny)
            out.append(time.perf_counter() - t0)
        return out
    stop = threading.Event()
    refusals, statuses = [], {}

    def neighbour():
        while not stop.is_set():
            req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            t0 = time.perf_counter()
            try:
                urllib.request.urlopen(req, timeout=120).read()
                status = 200
            except urllib.error.HTTPError as e:
                e.read()
                status = e.code
            refusals.append(time.perf_counter() - t0)
            statuses[status] = statuses.get(status, 0) + 1
    idle = probe()
    threads = [threading.Thread(target=neighbour, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)                                      # every neighbour is sending
    loaded = probe()
    stop.set()
    for t in threads:
        t.join()
    return idle, loaded, probe(), refusals, statuses


if __name__ == "__main__":
    sys.exit(main())
