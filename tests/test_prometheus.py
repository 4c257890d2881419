"""A real Prometheus (Debian's `prometheus` package) scraping a real `gateeng serve`
every second, with the project's recording rules and alerts loaded. The README's
trigger-rate query must equal what the per-request DeterminismReports add up to,
on the speculative route and on the default (adaptive) one, where it says
`all_direct` if no decode reached the gate; and every shipped expression must
evaluate. Then `gateeng calibrate --apply` sets tau on the live server, and
Prometheus sees the new value."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

from gateeng.serving.grpc_client import Client
from gateeng.request import TRIGGERS, DeterminismParams, Mode, SamplingParams
from promql import DEPLOY, expressions, readme_trigger_rate
from test_server import ADMIN, free_port, start_server, wait_health

PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.model,
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing: apt-get install prometheus "
                                                            "(Debian's `prometheus` package; .ci/run does)")]


def query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def scalar(base: str, expr: str):
    res = query(base, expr)
    return float(res[0]["value"][1]) if res else None


def wait_for(fn, timeout=90, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"timed out waiting for {what}")


@contextlib.contextmanager
def prometheus_over(tmp, *server_args):
    """A gateeng server started with server_args, and a Prometheus scraping it."""
    from grpc_health.v1 import health_pb2
    proc, target, mport = start_server(*server_args)
    port = free_port()
    (tmp / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(DEPLOY / "rules.yml"), str(DEPLOY / "alerts.yml")],
        "scrape_configs": [{"job_name": "gateeng", "static_configs": [{"targets": [f"127.0.0.1:{mport}"]}]}],
    }))
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_health(target, health_pb2.HealthCheckResponse.SERVING)
        wait_for(lambda: scalar(base, 'up{job="gateeng"}') == 1.0, what="Prometheus to scrape the engine")
        yield target, base
    finally:
        for p in (prom, proc):
            p.send_signal(signal.SIGTERM)
        for p in (prom, proc):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # The speculative route: the README trigger-rate query is over gated (speculative) steps.
    with prometheus_over(tmp_path_factory.mktemp("prometheus"), "--verified-route", "speculative") as s:
        yield s


def served_name(target) -> str:
    """The model's name as the server shows it (GetModelInfo): every series' model_name."""
    with Client(target) as c:
        return c.model_info().name


def run_verified(target, n, params):
    """n VERIFIED requests at once; their DeterminismReports."""
    reports = [None] * n

    def run(i):
        with Client(target) as c:
            reports[i] = c.complete(f"Name {i + 2} things that are blue.", params, DeterminismParams(Mode.VERIFIED),
                                    chat=True, timeout=600).determinism
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return reports


def test_readme_trigger_rate_is_the_recorded_rule():
    rules = expressions()
    assert " ".join(rules["rules.yml:gateeng:verifier_trigger_rate:ratio_rate5m"].split()) == readme_trigger_rate()


def test_readme_trigger_rate_answers_under_the_default_route(tmp_path):
    with prometheus_over(tmp_path) as (target, base):
        reports = run_verified(target, 4, SamplingParams(max_tokens=16, ignore_eos=True))
        wait_for(lambda: scalar(base, "sum(gateeng_request_success_total)") == 4, what="the requests to be scraped")
        steps = sum(r.decode_steps for r in reports)
        direct = sum(r.direct_steps for r in reports)
        # Decode steps ran on one route or the other. (They need not be one per token:
        # a verify pass with no mismatch gives a token free, a rollback decodes again.)
        assert steps + direct > 0
        got = query(base, readme_trigger_rate())
        assert len(got) == 1, got
        name = served_name(target)
        if steps == 0:       # every VERIFIED decode went direct: the explicit answer, not NaN
            assert got[0]["metric"] == {"model_name": name, "gate": "all_direct"}
            assert float(got[0]["value"][1]) == 0.0
        else:
            triggers = sum(getattr(r, f"triggers_{reason.value}") for r in reports for reason in TRIGGERS)
            assert got[0]["metric"] == {"model_name": name}
            assert float(got[0]["value"][1]) == pytest.approx(triggers / steps, rel=0.02)
        routes = {r["metric"]["route"]: float(r["value"][1]) for r in
                  query(base, 'sum by (route) (rate(gateeng_decode_steps_total{determinism="verified"}[5m]))')}
        assert set(routes) == {"speculative", "direct"} and (routes["direct"] > 0) == (direct > 0)


def test_readme_trigger_rate_says_all_direct_when_no_step_reaches_the_gate(tmp_path):
    """Every VERIFIED decode on the invariant plan (what the default route does where
    both plans cost the same): the README's query answers the explicit "all direct",
    on any CPU, rather than NaN or nothing."""
    with prometheus_over(tmp_path, "--verified-route", "direct") as (target, base):
        reports = run_verified(target, 2, SamplingParams(max_tokens=8, ignore_eos=True))
        assert sum(r.decode_steps for r in reports) == 0 and sum(r.direct_steps for r in reports) > 0
        wait_for(lambda: scalar(base, "sum(gateeng_request_success_total)") == 2, what="the requests to be scraped")
        got = wait_for(lambda: query(base, readme_trigger_rate()), what="the trigger rate to answer")
        assert [(r["metric"], float(r["value"][1])) for r in got] == [
            ({"model_name": served_name(target), "gate": "all_direct"}, 0.0)]


def test_readme_trigger_rate_in_prometheus_equals_the_reports(stack):
    target, base = stack
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [f"Write one sentence about {w}." for w in
               ["rivers", "owls", "glass", "tides", "maps", "salt", "kites", "moss", "tin", "wool", "dunes", "ink"]]
    reports = {}

    def run(i):
        det = DeterminismParams(Mode.VERIFIED) if i % 2 == 0 else None
        with Client(target) as c:
            reports[i] = c.complete(prompts[i], params, det, chat=True, timeout=600).determinism
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    verified = [r for r in reports.values() if r.mode == "verified"]
    triggers = sum(getattr(r, f"triggers_{reason.value}") for r in verified for reason in TRIGGERS)
    steps = sum(r.decode_steps for r in verified)
    assert triggers > 0 and steps > 0
    wait_for(lambda: scalar(base, "sum(gateeng_request_success_total)") == len(prompts),
             what="the finished requests to be scraped")
    got = scalar(base, readme_trigger_rate())
    # rate() extrapolates numerator and denominator alike (same scrapes, both start at 0).
    assert got == pytest.approx(triggers / steps, rel=0.02), (got, triggers, steps)
    want = {reason: sum(getattr(r, f"triggers_{reason}") for r in verified) / steps
            for reason in (t.value for t in TRIGGERS)}   # the router's too: 0 on a dense model

    def recorded():
        return {r["metric"]["reason"]: float(r["value"][1])
                for r in query(base, "gateeng:verifier_trigger_rate_by_reason:ratio_rate5m")}
    # The rule is evaluated every second: wait for an evaluation after the final scrape.
    try:
        wait_for(lambda: recorded() == pytest.approx(want, rel=0.02, abs=1e-9), timeout=20)
    except TimeoutError:
        pass
    assert recorded() == pytest.approx(want, rel=0.02, abs=1e-9)
    assert scalar(base, "sum(gateeng_margin_count)") == steps
    assert scalar(base, 'sum(gateeng_decode_steps_total{determinism="off"})') == 6 * (24 - 1)


def test_every_shipped_expression_evaluates_on_live_data(stack):
    _, base = stack
    empty = []
    for where, expr in expressions().items():
        if not query(base, expr) and not where.startswith("alerts.yml"):   # alerts are quiet here
            empty.append(where)
    # Latency series exist for both classes once traffic ran; only what this traffic
    # cannot produce may be empty (no preemptions, no mismatch-margin samples, ...).
    allowed = {"dashboard:Fast-path margin at mismatches:A"}
    assert set(empty) <= allowed, empty


def test_calibrate_quick_applies_tau_to_the_live_server(stack, tmp_path):
    target, base = stack
    env = dict(os.environ, GATEENG_ADMIN_TOKEN=ADMIN)
    res = subprocess.run([sys.executable, "-m", "gateeng.tools.cli", "calibrate", "--quick", "--target-miss", "0.05",
                          "--out", str(tmp_path), "--apply", target], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert (tmp_path / "calibration.png").stat().st_size > 10_000
    assert report["steps"] == 2 * 8 * 15 and report["recommended_tau"] is not None
    assert "| tau | trigger rate |" in res.stdout and "calibrate" in res.stderr   # table and progress bar
    tau = report["recommended_tau"]
    with Client(target) as c:
        assert c.server_info().gate.margin_threshold == pytest.approx(tau)
    wait_for(lambda: scalar(base, "gateeng_margin_threshold") == pytest.approx(tau), what="tau in Prometheus")
