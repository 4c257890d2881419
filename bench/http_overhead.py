"""What the OpenAI-compatible HTTP front adds over gRPC, and what oversized HTTP
prompts cost the other clients, against one `gateeng serve --http-port` started here.

    python bench/http_overhead.py [--requests 30] [--max-tokens 16] [--neighbours 8]

Overhead: each pair sends the same greedy prompt over gRPC (Complete) and over
HTTP (/v1/completions, via the `openai` client; the token counts are checked),
one at a time, so the engine serves one request at a time either way (prefix
caching off, so the second front of a pair does not find the first one's prompt
cached). Prints p50 / p90 latency per front and the ratio of the medians.

Oversized prompts: a tiny gRPC Complete (5 prompt tokens, 1 output token), idle,
then beside --neighbours clients (processes of their own) sending 580 KB prompts,
then idle again: with the neighbours on HTTP and on gRPC, each in two modes:
"burst" (the neighbours send one each, all at once, with every tiny request)
and "flood" (back to back: as much as the server can refuse). Each such prompt
is refused by its size before tokenizing (HTTP 413 by its Content-Length,
gRPC INVALID_ARGUMENT). Prints the tiny request's latency per phase, loaded /
idle, and the refusals' latency. Exits 1 if any oversized prompt was served.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import header  # noqa: E402
from bench.serve import ServerProcess, free_port  # noqa: E402
from gateeng.serving.grpc_client import Client  # noqa: E402
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
            floods = [oversized_neighbours(client, *where, mode, args.requests, args.neighbours)
                      for mode in ("burst", "flood") for where in ((http_port, "HTTP"), (server.target, "gRPC"))]
    finally:
        server.stop()
    print(header())
    print(f"{len(grpc_s)} requests per front, {args.max_tokens} tokens each, one at a time\n")
    print("| front | p50 (ms) | p90 (ms) |\n| --- | --- | --- |")
    print(f"| gRPC Complete | {q(grpc_s, 50):.1f} | {q(grpc_s, 90):.1f} |")
    print(f"| HTTP /v1/completions (openai client) | {q(http_s, 50):.1f} | {q(http_s, 90):.1f} |")
    print(f"\nHTTP / gRPC, median: {statistics.median(http_s) / statistics.median(grpc_s):.3f}x "
          f"(+{(statistics.median(http_s) - statistics.median(grpc_s)) * 1000:.1f} ms)")
    print(f"\nA tiny gRPC Complete ({args.requests} per phase) beside {args.neighbours} clients sending 580 KB "
          f"prompts, each refused by its size before tokenizing: burst = {args.neighbours} at once with each tiny "
          f"request, flood = back to back\n")
    print("| neighbours | idle p50 (ms) | loaded p50 / p90 (ms) | idle again p50 (ms) | loaded / idle | "
          "580 KB prompts sent | their p50 / p90 (ms) | their statuses |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for f in floods:
        base = statistics.median(f["idle"] + f["idle_after"])
        print(f"| {f['front']} {f['mode']} | {q(f['idle'], 50):.1f} | {q(f['loaded'], 50):.1f} / "
              f"{q(f['loaded'], 90):.1f} | {q(f['idle_after'], 50):.1f} | {statistics.median(f['loaded']) / base:.2f}x | "
              f"{len(f['refusals'])} | {q(f['refusals'], 50):.1f} / {q(f['refusals'], 90):.1f} | {f['statuses']} |")
    refused = {"HTTP": {"400", "413"}, "gRPC": {"INVALID_ARGUMENT"}}
    return 0 if all(set(f["statuses"]) <= refused[f["front"]] for f in floods) else 1


def q(xs, p):
    return sorted(xs)[int(p / 100 * (len(xs) - 1))] * 1000


PROMPT = "word " * 116_000                     # 580 KB, past the default --max-prompt-bytes
BODY = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()


def send_http(port: int) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
                                 data=BODY)
    try:
        urllib.request.urlopen(req, timeout=120).read()
        return "200"
    except urllib.error.HTTPError as e:
        e.read()
        return str(e.code)


def neighbour(front: str, address, mode: str, sync, stop, out) -> None:
    """One client in its own process (so the probe's latency is the server's, not
    this process's GIL), sending 580 KB prompts over `front` until `stop` is set:
    one per round of the `sync` barrier ("burst"), or back to back after passing
    it once ("flood"). Puts (latencies, statuses) on `out`."""
    import grpc
    from gateeng.v1 import engine_pb2 as pb
    from gateeng.v1 import engine_pb2_grpc as pb_grpc
    stub = pb_grpc.EngineStub(grpc.insecure_channel(address)) if front == "gRPC" else None
    request = pb.GenerateRequest(text=PROMPT)

    def send_grpc(_) -> str:
        try:
            stub.Complete(request, timeout=120)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name
    send = send_grpc if front == "gRPC" else send_http
    latencies, statuses = [], {}
    sync.wait()
    while not stop.is_set():
        t0 = time.perf_counter()
        status = send(address)
        latencies.append(time.perf_counter() - t0)
        statuses[status] = statuses.get(status, 0) + 1
        if mode == "burst":
            sync.wait()
    out.put((latencies, statuses))


def oversized_neighbours(client, address, front: str, mode: str, n: int, clients: int) -> dict:
    """A tiny gRPC request's latencies idle, beside `clients` neighbours sending
    580 KB prompts over `front` (`mode`: 8 at once per tiny request, or back to
    back), and idle again; the neighbours' latencies and statuses."""
    tiny = SamplingParams(max_tokens=1, ignore_eos=True)

    def once() -> float:
        t0 = time.perf_counter()
        client.complete([5, 6, 7, 8, 9], tiny)
        return time.perf_counter() - t0
    ctx = mp.get_context("spawn")            # no fork of this process's gRPC channel
    sync, stop, results = ctx.Barrier(clients + 1), ctx.Event(), ctx.Queue()
    idle = [once() for _ in range(n)]
    procs = [ctx.Process(target=neighbour, args=(front, address, mode, sync, stop, results), daemon=True)
             for _ in range(clients)]
    for p in procs:
        p.start()
    sync.wait(timeout=120)                   # every neighbour started
    loaded = []
    if mode == "burst":
        for i in range(n):
            time.sleep(0.002)                # the 8 prompts are on their way
            loaded.append(once())
            if i < n - 1:
                sync.wait(timeout=120)       # the 8 are answered: the next round
        stop.set()
        sync.wait(timeout=120)
    else:
        time.sleep(1.0)                      # every neighbour is sending
        loaded = [once() for _ in range(n)]
        stop.set()
    latencies, statuses = [], {}
    for _ in procs:
        lat, st = results.get(timeout=120)
        latencies += lat
        for k, v in st.items():
            statuses[k] = statuses.get(k, 0) + v
    for p in procs:
        p.join()
    return dict(front=front, mode=mode, idle=idle, loaded=loaded, idle_after=[once() for _ in range(n)],
                refusals=latencies, statuses=statuses)


if __name__ == "__main__":
    sys.exit(main())
