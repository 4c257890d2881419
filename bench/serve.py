"""Serving benchmark: a load generator in its own process against a real `gateeng serve`.

    python bench/serve.py                 # full run (several minutes on 2 cores)
    python bench/serve.py --quick         # a smoke run (a test runs it)

Phases, all against servers this script starts (`--target` uses a running one
for the load phase only):
  load      closed-loop concurrency sweep (default 1 / 16 / 64 / 256) over 64
            diverse prompts, a VERIFIED fraction of them; per class (OFF,
            VERIFIED): throughput, TTFT, TPOT, ITL and end-to-end p50/p99,
            errors by status code. A health prober in a third process checks
            every 0.1 s with a 1 s deadline. After each level the running and
            waiting gauges and KV usage must return to idle. Every VERIFIED
            output under load is compared with the same request run alone.
  prefill   an OFF stream's tokens/s alone, then while two clients send
            2000-token prompts (max_tokens 1) back to back.
  queue     concurrency 256 against a server started with --max-queue 32:
            the excess gets RESOURCE_EXHAUSTED, the admitted requests complete.
  rss       server RSS after 50 and after 500 sequential requests.

Writes serve.json, serve.md and serve.png (--out; default outside the tree); prints the markdown.
ITL is the gap between consecutive stream messages (a VERIFIED message may
carry several tokens released by one verify pass).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import commit, machine, report_path  # noqa: E402
from gateeng.v1 import engine_pb2 as pb  # noqa: E402
from gateeng.v1 import engine_pb2_grpc as pb_grpc  # noqa: E402

SUBJECTS = ["the ocean", "a small robot", "ancient Rome", "quantum computers", "a lighthouse keeper",
            "bread baking", "the moon landing", "a jazz club", "mountain goats", "a chess match",
            "volcanoes", "a lost key", "the printing press", "honeybees", "a desert caravan", "winter"]
ASKS = ["Write a short story about {}.", "Explain {} to a ten-year-old.", "List five facts about {}.",
        "Write a haiku about {}, then explain it in two sentences."]


def prompts(n: int = 64) -> list:
    """n diverse chat prompts: 16 subjects x 4 asks, some with a longer preamble."""
    out = []
    for i in range(n):
        text = ASKS[(i // len(SUBJECTS)) % len(ASKS)].format(SUBJECTS[i % len(SUBJECTS)])
        if i % 5 == 4:
            text = ("Context: you are writing for a museum guide that visitors read while they walk "
                    "between rooms, so keep sentences short and concrete. " * 3) + text
        out.append(text)
    return out


# ---- a server process ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra: str):
        self.port, self.metrics_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "gateeng.tools.cli", "serve", "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--http-port", "-1", "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.target = f"127.0.0.1:{self.port}"
        wait_serving(self.target, self.proc)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def wait_serving(target: str, proc=None, timeout: float = 600) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            req = health_pb2.HealthCheckRequest(service="gateeng.v1.Engine")
            if stub.Check(req, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{target} did not become SERVING")


def scrape(metrics_port: int) -> dict:
    """Sample values by name and labels, the model_name every gateeng_ series carries left out."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[re.sub(r'model_name="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")] = float(value)
    return values


def wait_idle(metrics_port: int, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while True:
        m = scrape(metrics_port)
        idle = {k: m.get(k) for k in ("gateeng_requests_running", "gateeng_requests_waiting",
                                      "gateeng_kv_cache_usage_ratio")}
        if not any(idle.values()) or time.time() > deadline:
            return idle
        time.sleep(0.2)


# ---- health prober (its own process, so the load generator cannot delay it) ----------------
def probe(target: str, metrics_port, stop, out) -> None:
    """A health Check (1 s deadline) and, when there is a metrics port, a /metrics
    scrape, every 0.1 s: (time, health ms, healthy, scrape ms or None)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    req = health_pb2.HealthCheckRequest(service="gateeng.v1.Engine")
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            ok = stub.Check(req, timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            ok = False
        t1 = time.perf_counter()
        scrape_ms = None
        if metrics_port:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1.0).read()
                scrape_ms = (time.perf_counter() - t1) * 1000
            except OSError:
                scrape_ms = float("inf")
        out.put((time.time(), (t1 - t0) * 1000, ok, scrape_ms))
        time.sleep(0.1)


class Prober:
    def __init__(self, target: str, metrics_port=None):
        ctx = mp.get_context("spawn")
        self.stop_event, self.queue = ctx.Event(), ctx.Queue()
        self.proc = ctx.Process(target=probe, args=(target, metrics_port, self.stop_event, self.queue),
                                daemon=True)
        self.proc.start()
        self.samples: list = []

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the first sample: the spawned prober takes seconds to start,
        longer than a short load level lasts."""
        self.samples.append(self.queue.get(timeout=timeout))

    def collect(self) -> list:
        while not self.queue.empty():
            self.samples.append(self.queue.get())
        return self.samples

    def close(self) -> None:
        self.stop_event.set()
        self.proc.join(10)
        self.collect()


def health_stats(samples: list, t0: float, t1: float) -> dict:
    window = [(ms, ok, scrape) for t, ms, ok, scrape in samples if t0 <= t <= t1]
    lat = sorted(ms for ms, _, _ in window)
    scrapes = sorted(s for _, _, s in window if s is not None)
    return {"checks": len(window), "failed": sum(not ok for _, ok, _ in window),
            "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": lat[-1] if lat else None,
            "metrics_p99_ms": pct(scrapes, 99)}


# ---- requests -------------------------------------------------------------------------------
@dataclass
class Result:
    cls: str                    # off | verified
    prompt: int
    code: str = "OK"
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    gaps: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)

    @property
    def tpot(self):
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.ttft is not None and self.tokens > 1 else None


def make_request(text: str, verified: bool, max_tokens: int, ids=None) -> pb.GenerateRequest:
    det = pb.Determinism(mode=pb.Determinism.MODE_VERIFIED if verified else pb.Determinism.MODE_OFF)
    sp = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if ids is not None:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sp, determinism=det)
    return pb.GenerateRequest(text=text, chat=True, sampling=sp, determinism=det)


async def run_one(stub, req: pb.GenerateRequest, cls: str, prompt: int) -> Result:
    r = Result(cls, prompt)
    t0 = last = time.perf_counter()
    try:
        async for ev in stub.Generate(req, timeout=1800):
            now = time.perf_counter()
            if ev.HasField("chunk") and ev.chunk.token_ids:
                if r.ttft is None:
                    r.ttft = now - t0
                else:
                    r.gaps.append(now - last)
                last = now
                r.token_ids += list(ev.chunk.token_ids)
            elif ev.HasField("complete"):
                r.tokens = ev.complete.usage.completion_tokens
    except grpc.aio.AioRpcError as e:
        r.code = e.code().name
    r.e2e = time.perf_counter() - t0
    return r


async def closed_loop(target: str, jobs: list, concurrency: int) -> list:
    """`concurrency` clients, each sending its next job when the last one ends."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.EngineStub(channel)
        queue = list(reversed(jobs))
        results = []

        async def client():
            while queue:
                req, cls, i = queue.pop()
                results.append(await run_one(stub, req, cls, i))
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def class_stats(results: list, seconds: float) -> dict:
    ok = [r for r in results if r.code == "OK"]
    errors: dict = {}
    for r in results:
        if r.code != "OK":
            errors[r.code] = errors.get(r.code, 0) + 1
    gaps = [g for r in ok for g in r.gaps]
    return {"requests": len(results), "completed": len(ok), "errors": errors,
            "tokens_per_s": sum(r.tokens for r in ok) / seconds if seconds else None,
            "ttft_p50": pct([r.ttft for r in ok], 50), "ttft_p99": pct([r.ttft for r in ok], 99),
            "tpot_p50": pct([r.tpot for r in ok], 50), "tpot_p99": pct([r.tpot for r in ok], 99),
            "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
            "e2e_p50": pct([r.e2e for r in ok], 50), "e2e_p99": pct([r.e2e for r in ok], 99)}


# ---- phases ---------------------------------------------------------------------------------
def jobs_for(texts: list, n: int, fraction: float, max_tokens: int) -> list:
    """n jobs over the prompts; job j is VERIFIED when it falls in the fraction (spread evenly)."""
    out = []
    for j in range(n):
        i = j % len(texts)
        verified = int((j + 1) * fraction) > int(j * fraction)
        out.append((make_request(texts[i], verified, max_tokens), "verified" if verified else "off", i))
    return out


def load_phase(args, server_target: str, metrics_port, texts: list) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    # VERIFIED references: each VERIFIED prompt run alone, before any load.
    verified_prompts = sorted({i for _, cls, i in jobs_for(texts, len(texts), args.verified_fraction,
                                                            args.max_tokens) if cls == "verified"})
    print(f"[serve] references: {len(verified_prompts)} VERIFIED prompts alone", file=sys.stderr)
    alone = asyncio.run(closed_loop(server_target, [(make_request(texts[i], True, args.max_tokens), "verified", i)
                                                    for i in verified_prompts], 1))
    reference = {r.prompt: r.token_ids for r in alone if r.code == "OK"}
    prober = Prober(server_target, metrics_port)
    levels_out = []
    try:
        prober.wait_ready()
        for c in levels:
            n = max(args.min_requests, 2 * c)
            jobs = jobs_for(texts, n, args.verified_fraction, args.max_tokens)
            print(f"[serve] concurrency {c}: {n} requests", file=sys.stderr, flush=True)
            t0 = time.time()
            results = asyncio.run(closed_loop(server_target, jobs, c))
            t1 = time.time()
            idle = wait_idle(metrics_port) if metrics_port else None
            checked = [r for r in results if r.cls == "verified" and r.code == "OK" and r.prompt in reference]
            level = {"concurrency": c, "seconds": t1 - t0,
                     "off": class_stats([r for r in results if r.cls == "off"], t1 - t0),
                     "verified": class_stats([r for r in results if r.cls == "verified"], t1 - t0),
                     "health": health_stats(prober.collect(), t0, t1), "idle_after": idle,
                     "verified_equal_alone": sum(r.token_ids == reference[r.prompt] for r in checked),
                     "verified_checked": len(checked)}
            levels_out.append(level)
            print(f"[serve]   {level['off']['tokens_per_s']:.1f} + {level['verified']['tokens_per_s'] or 0:.1f} "
                  f"tok/s, health p99 {level['health']['p99_ms']:.1f} ms, failed {level['health']['failed']}, "
                  f"VERIFIED equal alone {level['verified_equal_alone']}/{level['verified_checked']}",
                  file=sys.stderr, flush=True)
    finally:
        prober.close()
    return {"levels": levels_out}


def prefill_phase(target: str, max_tokens: int, long_len: int, vocab: int) -> dict:
    """An OFF stream's tokens/s alone and while two clients stream long prompts."""
    text = "Describe a walk through a busy market, stall by stall."

    async def measure(with_long: bool) -> float:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EngineStub(channel)
            stop = asyncio.Event()
            rng = random.Random(0)

            async def long_client():
                while not stop.is_set():     # distinct random prompts: no prefix-cache hits
                    ids = [rng.randrange(100, vocab) for _ in range(long_len)]
                    longs.append(await run_one(stub, make_request("", False, 1, ids), "off", -1))
            others = [asyncio.create_task(long_client()) for _ in range(2 if with_long else 0)]
            if others:
                await asyncio.sleep(1.0)
            r = await run_one(stub, make_request(text, False, max_tokens), "off", 0)
            stop.set()
            await asyncio.gather(*others)
            return (r.tokens - 1) / (r.e2e - r.ttft)
    longs: list = []
    alone = asyncio.run(measure(False))
    loaded = asyncio.run(measure(True))
    done = [r.e2e for r in longs if r.code == "OK"]
    return {"alone_tokens_per_s": alone, "with_long_prompts_tokens_per_s": loaded, "ratio": loaded / alone,
            "long_prompt_tokens": long_len, "long_prompt_seconds_p50": pct(done, 50)}


def queue_phase(concurrency: int, max_queue: int, max_seqs: int, max_tokens: int, texts: list,
                extra: list) -> dict:
    server = ServerProcess(*extra, "--max-queue", str(max_queue), "--max-num-seqs", str(max_seqs))
    try:
        jobs = [(make_request(texts[i % len(texts)], False, max_tokens), "off", i) for i in range(concurrency)]
        t0 = time.time()
        results = asyncio.run(closed_loop(server.target, jobs, concurrency))
        codes: dict = {}
        for r in results:
            codes[r.code] = codes.get(r.code, 0) + 1
        complete = sum(r.code == "OK" and r.tokens == max_tokens for r in results)
        return {"concurrency": concurrency, "max_queue": max_queue, "max_num_seqs": max_seqs, "codes": codes,
                "admitted_completed": complete, "seconds": time.time() - t0,
                "idle_after": wait_idle(server.metrics_port)}
    finally:
        server.stop()


def rss_phase(target: str, metrics_port: int, n: int, first: int, texts: list) -> dict:
    async def run():
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.EngineStub(channel)
            rss = {}
            for i in range(n):
                await run_one(stub, make_request(f"{texts[i % len(texts)]} (variant {i})", i % 2 == 0, 4),
                              "x", i)
                if i + 1 in (first, n):
                    rss[i + 1] = scrape(metrics_port)["process_resident_memory_bytes"]
            return rss
    rss = asyncio.run(run())
    return {"requests": n, "rss_after_first_mb": rss[first] / 2**20, "rss_after_all_mb": rss[n] / 2**20,
            "first": first, "growth": rss[n] / rss[first] - 1}


# ---- report ---------------------------------------------------------------------------------
def fmt(x, scale=1.0, digits=0):
    return "-" if x is None else f"{x * scale:.{digits}f}"


def markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']}", "",
             f"Load: {report['config']['max_tokens']} tokens per request, "
             f"{report['config']['verified_fraction']:.0%} VERIFIED, {report['config']['prompts']} prompts.", "",
             "| concurrency | class | done | errors | tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
             "ITL p50 / p99 (ms) | e2e p50 / p99 (s) | health p99 (ms) | /metrics p99 (ms) | failed checks | "
             "VERIFIED == alone |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for lv in report.get("load", {}).get("levels", []):
        for cls in ("off", "verified"):
            s = lv[cls]
            if not s["requests"]:
                continue
            lines.append(
                f"| {lv['concurrency']} | {cls.upper()} | {s['completed']}/{s['requests']} | "
                f"{sum(s['errors'].values()) or 0} | {fmt(s['tokens_per_s'], digits=1)} | "
                f"{fmt(s['ttft_p50'], 1000)} / {fmt(s['ttft_p99'], 1000)} | "
                f"{fmt(s['tpot_p50'], 1000)} / {fmt(s['tpot_p99'], 1000)} | "
                f"{fmt(s['itl_p50'], 1000)} / {fmt(s['itl_p99'], 1000)} | "
                f"{fmt(s['e2e_p50'], digits=2)} / {fmt(s['e2e_p99'], digits=2)} | "
                f"{fmt(lv['health']['p99_ms'], digits=1)} | {fmt(lv['health'].get('metrics_p99_ms'), digits=1)} | "
                f"{lv['health']['failed']}/{lv['health']['checks']} | "
                + (f"{lv['verified_equal_alone']}/{lv['verified_checked']} |" if cls == "verified" else "|"))
    idle = [lv["idle_after"] for lv in report.get("load", {}).get("levels", [])]
    lines += ["", "Gauges after each level (running, waiting, KV usage): "
                  + ", ".join(str(tuple(v.values())) if v else "-" for v in idle)]
    if "prefill" in report:
        p = report["prefill"]
        lines += [f"OFF stream while two clients send {p['long_prompt_tokens']}-token prompts: "
                  f"{p['with_long_prompts_tokens_per_s']:.1f} vs {p['alone_tokens_per_s']:.1f} tokens/s alone "
                  f"(**{p['ratio']:.0%}**); a long prompt took {fmt(p['long_prompt_seconds_p50'], digits=1)} s "
                  f"(p50) to its one token."]
    if "queue" in report:
        q = report["queue"]
        lines += [f"Concurrency {q['concurrency']} against `--max-queue {q['max_queue']} --max-num-seqs "
                  f"{q['max_num_seqs']}`: status codes "
                  f"{q['codes']}; admitted and completed: {q['admitted_completed']}; gauges after: "
                  f"{tuple(q['idle_after'].values())}."]
    if "rss" in report:
        r = report["rss"]
        lines += [f"Server RSS after {r['first']} requests {r['rss_after_first_mb']:.0f} MiB, after "
                  f"{r['requests']}: {r['rss_after_all_mb']:.0f} MiB (**{r['growth']:+.1%}**)."]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = report["load"]["levels"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for cls, color in (("off", "tab:blue"), ("verified", "tab:orange")):
        xs = [lv["concurrency"] for lv in levels if lv[cls]["requests"]]
        rows = [lv[cls] for lv in levels if lv[cls]["requests"]]
        for key, style in (("ttft_p50", "-"), ("ttft_p99", "--")):
            axes[0].plot(xs, [r[key] for r in rows], style, color=color, marker="o", label=f"{cls} {key[5:]}")
        for key, style in (("tpot_p50", "-"), ("tpot_p99", "--")):
            axes[1].plot(xs, [r[key] and r[key] * 1000 for r in rows], style, color=color, marker="o",
                         label=f"{cls} {key[5:]}")
        axes[2].plot(xs, [r["tokens_per_s"] for r in rows], color=color, marker="o", label=cls)
    for ax, title in zip(axes, ("TTFT (s)", "TPOT (ms)", "throughput (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"gateeng serve, {report['config']['verified_fraction']:.0%} VERIFIED — "
                 f"{report['machine'].split(' [')[0]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="concurrency 1,8; 8 tokens; short phases (smoke test)")
    ap.add_argument("--long-prompt", type=int, default=2000, help="prefill phase: tokens per long prompt")
    ap.add_argument("--concurrency", default="1,16,64,256", help="closed-loop levels")
    ap.add_argument("--verified-fraction", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--min-requests", type=int, default=64, help="requests per level at least (else 2 x level)")
    ap.add_argument("--target", default=None, metavar="HOST:PORT",
                    help="load a running server instead of starting one (load phase only)")
    ap.add_argument("--metrics-port", type=int, default=None, help="with --target: its metrics port")
    ap.add_argument("--phases", default="load,prefill,rss,queue", help="which phases to run")
    ap.add_argument("--server-args", default="", help="extra `gateeng serve` flags for the servers started here")
    ap.add_argument("--out", default=str(report_path("serve")), help="output path prefix (.json, .md, .png)")
    args = ap.parse_args(argv)
    phases = set(filter(None, args.phases.split(",")))
    extra = args.server_args.split()
    if args.quick:
        args.concurrency, args.max_tokens, args.min_requests = "1,8", 8, 8
    texts = prompts(16 if args.quick else 64)
    report = {"machine": machine(), "commit": commit(), "command": "python bench/serve.py " + " ".join(argv or sys.argv[1:]),
              "config": {"max_tokens": args.max_tokens, "verified_fraction": args.verified_fraction,
                         "prompts": len(texts)}}
    print(f"[serve] {report['command']} at {report['commit']}; {report['machine']}", file=sys.stderr)
    server = None if args.target else ServerProcess(*extra)
    target = args.target or server.target
    metrics_port = args.metrics_port if args.target else server.metrics_port
    try:
        if "load" in phases:
            report["load"] = load_phase(args, target, metrics_port, texts)
        if server is not None and "prefill" in phases:
            print("[serve] prefill interference", file=sys.stderr, flush=True)
            report["prefill"] = prefill_phase(target, 16 if args.quick else 48,
                                              256 if args.quick else args.long_prompt, vocab=49152)
        if server is not None and "rss" in phases:
            n, first = (30, 10) if args.quick else (500, 50)
            print(f"[serve] RSS over {n} sequential requests", file=sys.stderr, flush=True)
            report["rss"] = rss_phase(target, metrics_port, n, first, texts)
    finally:
        if server is not None:
            report["exit_code"] = server.stop()
    if "queue" in phases and not args.target:
        c, q, seqs = (24, 4, 8) if args.quick else (256, 32, 64)
        print(f"[serve] queue bound: concurrency {c}, --max-queue {q}", file=sys.stderr, flush=True)
        report["queue"] = queue_phase(c, q, seqs, args.max_tokens, texts, extra)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    out.with_suffix(".md").write_text(md + "\n")
    if "load" in report:
        plot(report, out.with_suffix(".png"))
    print(md)
    print(f"\nwrote {out}.json, .md, .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
