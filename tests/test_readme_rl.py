"""The README's "Reinforcement learning" recipe runs as printed: its shell block (the
admin token file and the `gateeng serve` command, moved to free ports), then its
Python loop with this venv's python, in a fresh directory. Every step prints a ratio
of exactly 1, and the server ends at the weights the last step pushed."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gateeng.config import GRPC_PORT, HTTP_PORT
from test_readme_lm_eval import blocks, free_port, section, started, stop

pytestmark = pytest.mark.model
BIN = Path(sys.executable).parent
SECTION = "## Reinforcement learning"


def recipe() -> tuple[list, str]:
    """The shell block's lines and the Python block."""
    found = blocks(section(SECTION))
    shell = next(body for info, body in found if info == "sh" and "gateeng serve" in body)
    script = next(body for info, body in found if info == "python" and "logprobs_from" in body)
    return shell.strip().splitlines(), script


def local(text: str) -> str:
    """`.venv/bin/X` as this venv's."""
    return text.replace(".venv/bin/", f"{BIN}/")


def test_the_readme_rl_recipe_runs_as_printed(tmp_path):
    shell, script = recipe()
    assert len(shell) == 2 and "admin-token" in shell[0] and shell[1].split()[:2] == [".venv/bin/gateeng", "serve"]
    assert f"127.0.0.1:{HTTP_PORT}/v1" in script and f"127.0.0.1:{GRPC_PORT}" in script
    http, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "GATEENG_API_KEY"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(local(shell[0]), shell=True, cwd=tmp_path, env=env, check=True, timeout=60)
    serve = shlex.split(local(shell[1])) + ["--port", str(grpc_port), "--http-port", str(http),
                                           "--metrics-port", str(free_port())]
    proc = started(serve, http, tmp_path, env, tmp_path / "serve.log")
    try:
        code = local(script).replace(f"127.0.0.1:{HTTP_PORT}/", f"127.0.0.1:{http}/")
        code = code.replace(f"127.0.0.1:{GRPC_PORT}", f"127.0.0.1:{grpc_port}")
        (tmp_path / "loop.py").write_text(code)
        res = subprocess.run([sys.executable, "loop.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=900)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        steps = re.findall(r"^step (\d): reward [0-9.]+, ratio (\S+) to (\S+)$", res.stdout, re.M)
        assert [s[0] for s in steps] == ["0", "1"] and all(s[1:] == ("1.0", "1.0") for s in steps), res.stdout
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10) as r:
            card = json.loads(r.read())["data"][0]
        assert card["weight_version"] == 2 and card["trainable"] is True
    finally:
        stop(proc)
