"""Start-up time of `gateeng serve` on the embedded model, as `make run` starts it: from
process start to gRPC health SERVING, and to HTTP /health answering 200 where the
HTTP front is on by default (every port is a free one, given by flag).

Cases, each run quiet and beside a CPU hog (--hog busy-loop processes at normal
priority, from before the server starts until it serves):
  first:  the route-cost cache cleared ($GATEENG_CACHE/route-costs only: the converted
          model and the compiled kernels stay), so the start times both plans'
          decode passes and keeps them;
  second: the same command again, which reads the costs the first kept (beside the
          hog, once a 50 ms probe has found the host still busy: costs timed on a busy
          host are timed again by the first start on a quiet one).
The hog rounds run before the quiet ones, so the costs left in the cache at the end
are ones timed on a quiet machine.

The server's log lines are stamped as they arrive: each run's profile (imports until
`listening`, the model and plans until `fast plan:`, then the route costs, the
self-check and `serving`); the `route costs` column says where each start's costs
came from.

Usage: python bench/start.py [--rounds 3] [--hog 2] [--quiet-only]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent.parent))
from bench.common import command, commit, machine, report_path  # noqa: E402
from bench.servers import free_port  # noqa: E402
from gateeng.config import ServerConfig, cache_root  # noqa: E402
from gateeng.engine import route_costs  # noqa: E402

SERVICE = "gateeng.v1.Engine"
POLL_S = 0.05
TIMEOUT_S = 600
# The log lines that end a start's phases, in order: (phase name, the line's start).
PHASES = (("imports", "listening on port"), ("model and plans", "fast plan:"), ("route costs", "route costs"),
          ("self-check", "invariant plan self-check"), ("to serving", "serving "))


def start_once(cmd: list, grpc_port: int, http_port, hogs: int) -> dict:
    """One start: seconds to gRPC SERVING and to HTTP /health 200, and the stamped log."""
    hog = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    lines = []
    try:
        time.sleep(0.5 if hogs else 0.0)   # the hogs are running before the server starts
        t0 = time.perf_counter()
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=_stamp, args=(server.stderr, t0, lines), daemon=True)
        reader.start()
        grpc_s = http_s = None
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        health = health_pb2_grpc.HealthStub(channel)
        try:
            while grpc_s is None or (http_port is not None and http_s is None):
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited ({server.returncode}):\n" +
                                       "\n".join(line for _, line in lines[-20:]))
                if time.perf_counter() - t0 > TIMEOUT_S:
                    raise TimeoutError(f"the server did not serve in {TIMEOUT_S} s")
                if grpc_s is None and _grpc_serving(health):
                    grpc_s = time.perf_counter() - t0
                if http_port is not None and http_s is None and _http_ok(http_port):
                    http_s = time.perf_counter() - t0
                time.sleep(POLL_S)
        finally:
            channel.close()
            for h in hog:
                h.kill()
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            reader.join(5)
    finally:
        for h in hog:
            h.kill()
            h.wait()
    route = next((line for _, line in lines if "route costs" in line), "")
    return {"grpc_serving_s": round(grpc_s, 2), "http_health_s": None if http_s is None else round(http_s, 2),
            "phases_s": _phases(lines), "route": _route_source(route), "route_line": route,
            "log": [[round(t, 2), line[:300]] for t, line in lines]}


def _stamp(stream, t0: float, lines: list) -> None:
    for line in stream:
        lines.append((time.perf_counter() - t0, line.rstrip()))


def _grpc_serving(health) -> bool:
    try:
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1).status
    except grpc.RpcError:
        return False
    return status == health_pb2.HealthCheckResponse.SERVING


def _http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _phases(lines: list) -> dict:
    """Seconds each phase took, from the stamps of the log lines that end them."""
    out, last = {}, 0.0
    for name, start in PHASES:
        at = next((t for t, line in lines if line.startswith("[gateeng] " + start)), None)
        if at is not None:
            out[name] = round(at - last, 2)
            last = at
    return out


def _route_source(line: str) -> str:
    """Where the run's route costs came from, in a few words."""
    if "route costs from decode passes" in line:
        how = "timed" + (" on a busy host" if "a busy host" in line else "")
        return how + (", refused" if " refused" in line else "") + (", kept" if "kept in" in line else "")
    if "route costs: both plans priced alike" in line:
        return "a kept refusal"
    if "route costs from" in line:
        return "read" + (" (timed on a busy host)" if "busy host" in line else "")
    return "none"


def clear_route_costs() -> None:
    shutil.rmtree(cache_root() / route_costs.FOLDER, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="first + second starts per condition")
    ap.add_argument("--hog", type=int, default=2, help="busy-loop processes beside the server (the hog condition)")
    ap.add_argument("--quiet-only", action="store_true", help="skip the hog condition")
    ap.add_argument("--out", default=str(report_path("start.json")),
                    help="the JSON report (default: outside the tree; bench/start.json is the one RESULTS cites)")
    args = ap.parse_args()
    grpc_port, metrics_port = free_port(), free_port()
    http_port = free_port() if ServerConfig().http_port is not None else None   # the default command's fronts
    gateeng = str(Path(sys.executable).parent / "gateeng")
    cmd = [gateeng, "serve", "--port", str(grpc_port), "--metrics-port", str(metrics_port)]
    if http_port is not None:
        cmd += ["--http-port", str(http_port)]
    print(f"start: {args.rounds} rounds; {machine()}; load average {os.getloadavg()}", file=sys.stderr, flush=True)
    conditions = ([] if args.quiet_only else [("beside the hog", args.hog)]) + [("quiet", 0)]
    runs = []
    for condition, hogs in conditions:
        for r in range(args.rounds):
            clear_route_costs()
            for case in ("first", "second"):
                run = dict(condition=condition, case=case, round=r + 1, load_before=os.getloadavg()[0],
                           **start_once(cmd, grpc_port, http_port, hogs))
                runs.append(run)
                print(f"  {condition:15s} {case:6s} round {r + 1}: gRPC SERVING {run['grpc_serving_s']:6.2f} s, "
                      f"HTTP /health {run['http_health_s']} s, route costs {run['route']}; {run['phases_s']}",
                      file=sys.stderr, flush=True)
    summary = {}
    for condition, _ in conditions:
        for case in ("first", "second"):
            mine = [r for r in runs if (r["condition"], r["case"]) == (condition, case)]
            summary[f"{condition}, {case}"] = {
                "grpc_serving_s": [r["grpc_serving_s"] for r in mine],
                "grpc_serving_median_s": statistics.median(r["grpc_serving_s"] for r in mine),
                "http_health_s": [r["http_health_s"] for r in mine],
                "phases_median_s": {name: statistics.median(r["phases_s"].get(name, 0.0) for r in mine)
                                    for name, _ in PHASES},
                "route": sorted({r["route"] for r in mine}),
            }
    result = {"machine": machine(), "commit": commit(), "command": command(),
              "server_command": " ".join(["gateeng"] + cmd[1:]), "hog_processes": args.hog,
              "load_average_at_end": os.getloadavg(), "summary": summary, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n`{result['command']}` at {result['commit']}; {result['machine']}\n")
    names = [name for name, _ in PHASES]
    print("| case | gRPC SERVING (median) | each round | HTTP /health | " + " | ".join(names) + " | route costs |")
    print("| --- | --- | --- | --- |" + " --- |" * len(names) + " --- |")
    for case, s in summary.items():
        http = "off" if http_port is None else "/".join(f"{v:.1f}" for v in s["http_health_s"])
        print(f"| {case} | {s['grpc_serving_median_s']:.1f} s | {'/'.join(f'{v:.1f}' for v in s['grpc_serving_s'])} "
              f"| {http} | " + " | ".join(f"{s['phases_median_s'][n]:.1f}" for n in names)
              + f" | {', '.join(s['route'])} |")
    print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
