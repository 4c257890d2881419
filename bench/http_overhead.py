"""What the OpenAI-compatible HTTP front adds over gRPC: the same requests, alternating,
against one `gateeng serve --http-port` started here.

    python bench/http_overhead.py [--requests 30] [--max-tokens 16]

Each pair sends the same greedy prompt over gRPC (Complete) and over HTTP
(/v1/completions, via the `openai` client; the token counts are checked),
one at a time, so the engine serves one request at a time either way (prefix caching
off, so the second front of a pair does not find the first one's prompt cached). Prints
p50 / p90 latency per front and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
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
    finally:
        server.stop()

    def q(xs, p):
        return sorted(xs)[int(p / 100 * (len(xs) - 1))] * 1000
    print(f"Machine: {machine()}")
    print(f"{len(grpc_s)} requests per front, {args.max_tokens} tokens each, one at a time\n")
    print("| front | p50 (ms) | p90 (ms) |\n| --- | --- | --- |")
    print(f"| gRPC Complete | {q(grpc_s, 50):.1f} | {q(grpc_s, 90):.1f} |")
    print(f"| HTTP /v1/completions (openai client) | {q(http_s, 50):.1f} | {q(http_s, 90):.1f} |")
    print(f"\nHTTP / gRPC, median: {statistics.median(http_s) / statistics.median(grpc_s):.3f}x "
          f"(+{(statistics.median(http_s) - statistics.median(grpc_s)) * 1000:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
