"""Soak: a real `gateeng serve` under steady mixed, partly hostile traffic for a long
time, watched for what a long life costs.

    python bench/soak.py                  # 30 minutes on the embedded model, both fronts over TLS
    python bench/soak.py --minutes 2      # a short run
    python bench/soak.py --no-tls         # plain text

Workers (threads of this process, so the server keeps its own cores' share) each
loop over a weighted mix of actions, with a short pause between them:
  grpc        Complete, OFF or VERIFIED, 8-24 tokens                     -> OK
  grpc_cancel Generate, cancelled after its first message                -> CANCELLED
  grpc_deadline Complete with a 1-20 ms deadline                         -> DEADLINE_EXCEEDED or OK
  grpc_bad    an unknown determinism mode                                -> INVALID_ARGUMENT
  http        /v1/completions or /v1/chat/completions                    -> 200
  http_stream a streamed chat read to [DONE] by a slow reader            -> 200
  http_gone   a streamed completion whose client closes after one chunk  -> (nothing to read)
  http_bad    bad JSON, an unknown field, n=17 (above the 16 served)     -> 400
  http_big    a 2 MiB chunked body                                       -> 413 (or the connection closed)
  http_idle   a connection that sends nothing                            -> 408 at the header timeout
  grpc_flood  80 connections to the gRPC port that send nothing, past its limit of 64, held
              while a new client asks gRPC health                        -> SERVING within 2 s
  grpc_silent one gRPC connection that sends nothing                     -> closed at the 2 s deadline
              (or before it, where a flood past the limit took its slot)
  grpc_plain  (TLS) a plain-text gRPC client                             -> UNAVAILABLE
  http_plain  (TLS) a plain-text HTTP request                            -> no answer, closed
With TLS (the default) the server gets a certificate made for the run (openssl), and
every client speaks TLS with its CA: gRPC over TLS, HTTPS, raw sockets wrapped in TLS.
A `busy` answer (gRPC RESOURCE_EXHAUSTED, HTTP 429) is counted apart and is no
failure. Anything else is unexpected: a 5xx, gRPC INTERNAL/UNKNOWN/UNAVAILABLE,
another status than the action's, or no answer within 120 s (lost).

Every --check-every seconds the load pauses, and the server must be idle within a
second (GetServerInfo: running, waiting and KV usage all 0: no ghost request);
its RSS and open file descriptors are sampled then. RSS growth per 1000 requests is
the slope of RSS over requests served, after the first check (warm-up).
Writes bench/soak.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import TOPICS, command, commit, machine, report_path  # noqa: E402
from servers import free_port  # noqa: E402

from gateeng.request import DeterminismParams, Mode, SamplingParams  # noqa: E402
from gateeng.serving.grpc_client import Client, to_proto  # noqa: E402

MIX = {"grpc": 6, "grpc_cancel": 3, "grpc_deadline": 3, "grpc_bad": 1, "http": 6, "http_stream": 2,
       "http_gone": 2, "http_bad": 2, "http_big": 1, "http_idle": 1, "grpc_flood": 1, "grpc_silent": 1}
TLS_MIX = {"grpc_plain": 1, "http_plain": 1}
ANSWER_S = 120.0
GRPC_MAX_CONNECTIONS, FLOOD, HANDSHAKE_S = 64, 80, 2.0


def make_certs(where: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1 signed by it, with openssl."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=soak CA")
    (where / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.pem", "-days", "2", "-extfile", "san.ext")
    return where


class Soak:
    def __init__(self, grpc_target: str, http_port: int, ca: Optional[Path] = None):
        self.target, self.http_port = grpc_target, http_port
        self.ca = str(ca) if ca else None
        self.tls = ssl.create_default_context(cafile=self.ca) if ca else None
        self.mix = {**MIX, **(TLS_MIX if ca else {})}
        self.outcomes: Counter = Counter()       # (action, outcome)
        self.unexpected: list = []
        self.served = 0
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.stop = threading.Event()
        self.idle_workers = 0

    def record(self, action: str, outcome: str, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.outcomes[(action, outcome)] += 1
            self.served += 1
            if not ok:
                self.unexpected.append(f"{action}: {outcome} {detail[:200]}")

    # ---- actions ------------------------------------------------------------------
    def grpc(self, client: Client, rng: random.Random) -> None:
        det = DeterminismParams(Mode.VERIFIED if rng.random() < 0.3 else Mode.OFF)
        try:
            client.complete(f"Write about {rng.choice(TOPICS)}.", SamplingParams(max_tokens=rng.randint(8, 24)),
                            det, chat=True, timeout=ANSWER_S)
            self.record("grpc", "OK", True)
        except grpc.RpcError as e:
            self.grpc_error("grpc", e, ())

    def grpc_cancel(self, client: Client, rng: random.Random) -> None:
        call = client.generate(f"Tell me about {rng.choice(TOPICS)}.", SamplingParams(max_tokens=64), chat=True,
                               timeout=ANSWER_S)
        try:
            next(call)
            call.cancel()
            for _ in call:
                pass
            self.record("grpc_cancel", "OK (finished first)", True)
        except grpc.RpcError as e:
            self.grpc_error("grpc_cancel", e, (grpc.StatusCode.CANCELLED,))

    def grpc_deadline(self, client: Client, rng: random.Random) -> None:
        try:
            client.complete([5, 6, 7, 8], SamplingParams(max_tokens=32), timeout=rng.uniform(0.001, 0.02))
            self.record("grpc_deadline", "OK", True)
        except grpc.RpcError as e:
            self.grpc_error("grpc_deadline", e, (grpc.StatusCode.DEADLINE_EXCEEDED,))

    def grpc_bad(self, client: Client, rng: random.Random) -> None:
        req = to_proto("hi", SamplingParams(max_tokens=4))
        req.determinism.mode = 7
        try:
            client.stub.Complete(req, timeout=ANSWER_S)
            self.record("grpc_bad", "OK", False, "an unknown mode was served")
        except grpc.RpcError as e:
            self.grpc_error("grpc_bad", e, (grpc.StatusCode.INVALID_ARGUMENT,))

    def grpc_error(self, action: str, e: grpc.RpcError, expected: tuple) -> None:
        code = e.code()
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.record(action, "busy", True)
        else:
            self.record(action, code.name, code in expected, e.details() or "")

    def client(self) -> Client:
        return Client(self.target, ca_file=self.ca)

    def connect(self, port: int, timeout: float = ANSWER_S) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        return self.tls.wrap_socket(sock, server_hostname="127.0.0.1") if self.tls else sock

    def health(self, timeout: float) -> str:
        creds = grpc.ssl_channel_credentials(Path(self.ca).read_bytes()) if self.ca else None
        options = [("grpc.use_local_subchannel_pool", 1)]
        with (grpc.secure_channel(self.target, creds, options=options) if creds
              else grpc.insecure_channel(self.target, options=options)) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="gateeng.v1.Engine"), timeout=timeout).status
                return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as e:
                return e.code().name

    def grpc_flood(self, _, rng: random.Random) -> None:
        port = int(self.target.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(FLOOD)]
        try:
            t0 = time.time()
            status = self.health(timeout=2.0)
            took = time.time() - t0
        finally:
            for sock in socks:
                sock.close()
        self.record("grpc_flood", status, status == "SERVING" and took < 2.0, f"{took:.2f} s")

    def grpc_silent(self, _, rng: random.Random) -> None:
        port = int(self.target.rsplit(":", 1)[1])
        sock = socket.create_connection(("127.0.0.1", port), timeout=HANDSHAKE_S + 10)
        t0 = time.time()
        try:
            while sock.recv(4096):
                pass
        except (ConnectionResetError, socket.timeout):
            pass
        took = time.time() - t0
        sock.close()
        # Before the deadline where a flood past the limit took its slot (the oldest silent one goes first).
        outcome = ("closed to make room" if took < HANDSHAKE_S - 0.5 else
                   "closed at the deadline" if took < HANDSHAKE_S + 3 else f"closed after {took:.1f} s")
        self.record("grpc_silent", outcome, took < HANDSHAKE_S + 3)

    def grpc_plain(self, _, rng: random.Random) -> None:
        with Client(self.target) as plain:
            try:
                plain.server_info()
                self.record("grpc_plain", "OK", False, "a plain-text client was served")
            except grpc.RpcError as e:
                self.grpc_error("grpc_plain", e, (grpc.StatusCode.UNAVAILABLE,))

    def http_plain(self, _, rng: random.Random) -> None:
        sock = socket.create_connection(("127.0.0.1", self.http_port), timeout=ANSWER_S)
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = sock.recv(64)
        except (BrokenPipeError, ConnectionResetError):
            head = b""
        sock.close()
        self.record("http_plain", "closed" if not head.startswith(b"HTTP/1.1 200") else "200", not head.startswith(
            b"HTTP/1.1 200"))

    def _post(self, path: str, body: bytes, timeout: float = ANSWER_S):
        conn = (http.client.HTTPSConnection("127.0.0.1", self.http_port, timeout=timeout, context=self.tls)
                if self.tls else http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=timeout))
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def http_status(self, action: str, status: int, expected: tuple, detail: str = "") -> None:
        if status == 429:
            self.record(action, "busy", True)
        else:
            self.record(action, str(status), status in expected, detail)

    def http(self, _, rng: random.Random) -> None:
        if rng.random() < 0.5:
            path, body = "/v1/completions", {"prompt": f"The story of {rng.choice(TOPICS)}:",
                                             "max_tokens": rng.randint(8, 24)}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": rng.choice(TOPICS)}],
                                                  "max_tokens": rng.randint(8, 24)}
        if rng.random() < 0.3:
            body["determinism"] = {"mode": "verified"}
        conn, res = self._post(path, json.dumps(body).encode())
        data = res.read()
        conn.close()
        self.http_status("http", res.status, (200,), data.decode(errors="replace"))

    def http_stream(self, _, rng: random.Random) -> None:
        body = {"messages": [{"role": "user", "content": rng.choice(TOPICS)}], "max_tokens": 24, "stream": True}
        conn, res = self._post("/v1/chat/completions", json.dumps(body).encode())
        done = False
        while True:
            line = res.fp.readline()
            if not line:
                break
            if line.strip() == b"data: [DONE]":
                done = True
            time.sleep(0.05)                          # a slow reader
        conn.close()
        self.http_status("http_stream", res.status if done else 599, (200,), "no [DONE]")

    def http_gone(self, _, rng: random.Random) -> None:
        body = {"prompt": f"A long tale of {rng.choice(TOPICS)}:", "max_tokens": 200, "stream": True}
        conn, res = self._post("/v1/completions", json.dumps(body).encode())
        res.fp.readline()
        conn.sock.close()                             # gone mid-stream: the server must abort it
        conn.close()
        self.record("http_gone", "closed", True)

    def http_bad(self, _, rng: random.Random) -> None:
        body = rng.choice([b"{not json", b'{"prompt": "hi", "frobnicate": 1}', b'{"prompt": "hi", "n": 17}'])
        conn, res = self._post("/v1/completions", body)
        data = res.read()
        conn.close()
        self.http_status("http_bad", res.status, (400,), data.decode(errors="replace"))

    def http_big(self, _, rng: random.Random) -> None:
        sock = self.connect(self.http_port)
        piece = b"x" * 65536
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(32):
                sock.sendall(b"10000\r\n" + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
            head = sock.recv(64)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            head = b"closed"
        sock.close()
        ok = head.startswith(b"HTTP/1.1 413") or head in (b"closed", b"")
        self.record("http_big", head[:12].decode(errors="replace") or "closed", ok)

    def http_idle(self, _, rng: random.Random) -> None:
        sock = self.connect(self.http_port)
        head = sock.recv(64)
        sock.close()
        self.record("http_idle", head[:12].decode(errors="replace") or "closed", head.startswith(b"HTTP/1.1 408"))

    # ---- the loop -------------------------------------------------------------------
    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        actions, weights = zip(*self.mix.items())
        with self.client() as client:
            while not self.stop.is_set():
                if not self.running.is_set():
                    with self.lock:
                        self.idle_workers += 1
                    self.running.wait()
                    with self.lock:
                        self.idle_workers -= 1
                    continue
                action = rng.choices(actions, weights)[0]
                try:
                    getattr(self, action)(client, rng)
                except (OSError, http.client.HTTPException) as e:
                    self.record(action, type(e).__name__, False, str(e))
                time.sleep(rng.uniform(0.05, 0.3))


def proc_stats(pid: int) -> tuple[int, int]:
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def wait_idle(client: Client, seconds: float = 1.0) -> tuple[bool, str]:
    deadline = time.time() + seconds
    while True:
        info = client.server_info()
        idle = info.requests_running == 0 and info.requests_waiting == 0 and info.kv_cache_usage == 0
        if idle or time.time() > deadline:
            return idle, (f"running {info.requests_running}, waiting {info.requests_waiting}, "
                          f"KV {info.kv_cache_usage:.3f}")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--check-every", type=float, default=60.0, help="seconds between idle checks")
    ap.add_argument("--model", default=None, help="the model to serve (default: the embedded model)")
    ap.add_argument("--no-tls", action="store_true", help="serve and call in plain text")
    ap.add_argument("--out", type=Path, default=report_path("soak.json"),
                    help="the JSON report, the server's log beside it (default: outside the tree; "
                         "bench/soak.json is the one RESULTS cites)")
    args = ap.parse_args()
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "gateeng.tools.cli", "serve", "--port", str(grpc_port), "--http-port", str(http_port),
           "--metrics-port", "-1", "--max-queue", "64", "--http-header-timeout", "5",
           "--grpc-max-connections", str(GRPC_MAX_CONNECTIONS), "--grpc-handshake-timeout", str(HANDSHAKE_S)]
    if args.model:
        cmd += ["--model", args.model]
    certs = None if args.no_tls else make_certs(Path(tempfile.mkdtemp(prefix="soak-certs-")))
    if certs:
        cmd += ["--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key")]
    ca = certs / "ca.pem" if certs else None
    log = open(args.out.with_suffix(".log"), "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{grpc_port}"
    try:
        soak = Soak(target, http_port, ca)
        client = soak.client()
        deadline = time.time() + 900
        while True:
            try:
                client.server_info()
                conn = (http.client.HTTPSConnection("127.0.0.1", http_port, timeout=5, context=soak.tls) if soak.tls
                        else http.client.HTTPConnection("127.0.0.1", http_port, timeout=5))
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except (grpc.RpcError, OSError):
                pass
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the server did not start (see {log.name})")
            time.sleep(1)
        threads = [threading.Thread(target=soak.worker, args=(i,), daemon=True) for i in range(args.workers)]
        for t in threads:
            t.start()
        samples, ghosts = [], []
        t0 = time.time()
        end = t0 + args.minutes * 60
        print(f"soak: {args.minutes:g} min, {args.workers} workers, {'plain text' if args.no_tls else 'TLS'}; "
              f"{machine()}", file=sys.stderr, flush=True)
        while time.time() < end:
            soak.running.set()
            time.sleep(min(args.check_every, max(0.0, end - time.time())))
            soak.running.clear()
            while soak.idle_workers < args.workers:   # every action in flight has ended
                time.sleep(0.05)
            idle, state = wait_idle(client)
            rss, fds = proc_stats(server.pid)
            samples.append({"t_s": round(time.time() - t0, 1), "served": soak.served, "rss_mb": rss / 2 ** 20,
                            "fds": fds, "idle": idle, "state": state})
            if not idle:
                ghosts.append(state)
            print(f"  {samples[-1]['t_s']:7.0f} s  {soak.served:6d} requests  RSS {rss / 2 ** 20:7.1f} MB  "
                  f"fds {fds:4d}  {'idle' if idle else 'NOT IDLE: ' + state}", file=sys.stderr, flush=True)
        soak.stop.set()
        soak.running.set()
        for t in threads:
            t.join(ANSWER_S)
        alive = server.poll() is None
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    warm = samples[1:] if len(samples) > 2 else samples
    slope = 0.0
    if len(warm) >= 2 and warm[-1]["served"] > warm[0]["served"]:
        n = len(warm)
        mx = sum(s["served"] for s in warm) / n
        my = sum(s["rss_mb"] for s in warm) / n
        sxx = sum((s["served"] - mx) ** 2 for s in warm)
        slope = sum((s["served"] - mx) * (s["rss_mb"] - my) for s in warm) / sxx * 1000 if sxx else 0.0
    result = {"machine": machine(), "minutes": args.minutes, "workers": args.workers, "tls": not args.no_tls,
              "grpc_max_connections": GRPC_MAX_CONNECTIONS, "grpc_flood": FLOOD, "requests": soak.served,
              "outcomes": {f"{a} {o}": c for (a, o), c in sorted(soak.outcomes.items())},
              "unexpected": len(soak.unexpected), "unexpected_examples": soak.unexpected[:20],
              "ghost_checks_failed": len(ghosts), "checks": len(samples), "server_alive_at_end": alive,
              "rss_mb_first": samples[0]["rss_mb"] if samples else None,
              "rss_mb_last": samples[-1]["rss_mb"] if samples else None,
              "rss_mb_per_1000_requests": round(slope, 3),
              "fds_min": min(s["fds"] for s in samples), "fds_max": max(s["fds"] for s in samples),
              "samples": samples,
              "commit": commit(), "command": command()}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"| minutes | requests | unexpected | ghost checks failed | RSS first -> last MB | MB / 1000 requests "
          f"| fds min-max |\n| --- | --- | --- | --- | --- | --- | --- |\n"
          f"| {args.minutes:g} | {soak.served} | {len(soak.unexpected)} | {len(ghosts)} of {len(samples)} "
          f"| {result['rss_mb_first']:.0f} -> {result['rss_mb_last']:.0f} | {slope:.3f} "
          f"| {result['fds_min']}-{result['fds_max']} |")
    for (a, o), c in sorted(soak.outcomes.items()):
        print(f"  {a:14s} {o:24s} {c}")
    for line in soak.unexpected[:20]:
        print("  unexpected:", line)
    return 0 if not soak.unexpected and not ghosts and alive else 1


if __name__ == "__main__":
    sys.exit(main())
