"""The README's lm-eval-harness section runs as printed: its `gateeng serve` command (on
free ports), its `lm_eval run` command with this venv's lm_eval, and the table the
README shows is the table lm-eval prints. Two runs give the same loglikelihoods, bit
for bit, as the README says."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateeng.config import HTTP_PORT

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SECTION = "### Evaluate with lm-eval-harness"


def section(heading: str = SECTION) -> str:
    """The README's text under `heading`, up to the next heading of its level or above."""
    text = (ROOT / "README.md").read_text()
    start = text.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = re.compile(r"^#{1,%d} " % level, re.M).search(text, start + len(heading)).start()
    return text[start:end]


def blocks(text: str) -> list:
    """The fenced blocks of `text`, as (info string, body)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def commands() -> tuple[list, str, list]:
    """The serve command's argv, the lm_eval command (one line, as a shell would read
    it) and the README's table rows."""
    found = blocks(section())
    serve = next(body for info, body in found if info == "sh" and "gateeng serve" in body)
    lm_eval = next(body for info, body in found if info == "sh" and "lm_eval" in body)
    table = next(body for info, body in found if body.lstrip().startswith("|"))
    return shlex.split(serve.strip()), lm_eval.replace("\\\n", " ").strip(), table.strip().splitlines()


def metrics(rows: list) -> dict:
    """{metric: (value, stderr)} from lm-eval's markdown table."""
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    out = {}
    for row in rows[2:]:
        cells = dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
        out[cells["Metric"]] = (cells["Value"], cells["Stderr"])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def venv_tool(word: str) -> str:
    """`.venv/bin/X` and a bare `lm_eval` are this venv's."""
    if word.startswith(".venv/bin/"):
        return str(BIN / word[len(".venv/bin/"):])
    return str(BIN / word) if word == "lm_eval" else word


def readme_port(serve: list) -> str:
    """The HTTP port the README's server listens on: its --http-port, else the default."""
    return serve[serve.index("--http-port") + 1] if "--http-port" in serve else str(HTTP_PORT)


def test_the_readme_names_one_port_and_the_table_it_shows():
    serve, lm_eval, table = commands()
    assert f"base_url=http://127.0.0.1:{readme_port(serve)}/v1/completions" in lm_eval
    assert set(metrics(table)) == {"acc", "acc_norm"}


def run_lm_eval(line: str, env: dict, out: Path) -> tuple[dict, list]:
    argv = [venv_tool(w) for w in shlex.split(line)] + ["--log_samples", "--output_path", str(out)]
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith("|")]
    assert rows, res.stdout
    (samples,) = out.rglob("samples_*.jsonl")
    lls = [(s["doc_id"], s["resps"]) for s in map(json.loads, samples.read_text().splitlines())]
    return metrics(rows), sorted(lls)


def test_the_readme_lm_eval_command_prints_the_readme_table(tmp_path):
    serve, lm_eval, table = commands()
    assert (BIN / "lm_eval").exists(), "lm-eval is part of the test extra: `make test` installs it"
    http_readme = readme_port(serve)
    http, grpc_port, metrics_port = free_port(), free_port(), free_port()
    argv = [venv_tool(w) for w in serve if w not in ("--http-port", http_readme)]
    argv += ["--http-port", str(http), "--port", str(grpc_port), "--metrics-port", str(metrics_port)]
    # No API key (the README's server takes none), and nothing read from a model hub.
    env = {k: v for k, v in os.environ.items() if k != "GATEENG_API_KEY"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = started(argv, http, ROOT, env, tmp_path / "serve.log")
    try:
        # `$(.venv/bin/gateeng model-dir)` as the shell would expand it.
        sub = re.search(r"\$\(([^)]*)\)", lm_eval)
        model_dir = subprocess.run([venv_tool(w) for w in shlex.split(sub.group(1))], cwd=ROOT, env=env,
                                   capture_output=True, text=True, check=True, timeout=120).stdout.strip()
        line = lm_eval.replace(sub.group(0), shlex.quote(model_dir))
        line = line.replace(f"127.0.0.1:{http_readme}/", f"127.0.0.1:{http}/")
        first, lls = run_lm_eval(line, env, tmp_path / "first")
        assert first == metrics(table)
        again, lls_again = run_lm_eval(line, env, tmp_path / "again")
        assert again == first
        assert lls_again == lls and len(lls) == 20
    finally:
        stop(proc)


def started(argv: list, http: int, cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """`gateeng serve` as `argv`, once its HTTP front answers /health (the model loaded)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600          # a fresh machine converts the model and builds kernels first
    while True:
        if proc.poll() is not None:
            raise AssertionError(log.read_text())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if time.time() > deadline:
            stop(proc)
            raise AssertionError("the server never answered /health")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
