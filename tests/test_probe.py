"""`gateeng probe` against gateeng's own fronts: VERIFIED completions stay one per
prompt through the prefix, alone and concurrency runs; a fast plan whose logits
move from call to call (the test-only logit noise) is caught."""
import json
import subprocess
import sys

import pytest

from gateeng.config import ServerConfig
from gateeng.tools import probe as pr
from test_server import free_port, start_server, wait_health
from test_server_async import Running, tiny_config


def cli(*args):
    return subprocess.run([sys.executable, "-m", "gateeng.tools.cli", "probe", *map(str, args)],
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def noisy():
    srv = Running(tiny_config(fast_logit_noise=2.0, max_model_len=256),
                  settings=ServerConfig(port=0, metrics_port=None, http_port=0))
    yield srv, f"http://127.0.0.1:{srv.server.http.port}"
    srv.stop()


def test_the_probe_catches_completions_that_change(noisy, tmp_path):
    _, base = noisy
    res = cli("--openai", base, "--num-prompts", 8, "--concurrency", "1,4,8", "--max-tokens", 8, "--out", tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["prompts_with_several_completions"] > 0
    assert set(report["differing_from_prefix_run"]) == {"prefix", "alone", "c=4", "c=8"}
    assert "| prompt | cached prefix at its first run |" in res.stdout


@pytest.mark.parametrize("front", ["openai", "server"])
def test_verified_gives_one_completion_per_prompt_even_with_a_noisy_fast_plan(noisy, tmp_path, front):
    srv, base = noisy
    res = cli(f"--{front}", base if front == "openai" else srv.target, "--verified", "--num-prompts", 8,
              "--concurrency", "1,4,8", "--max-tokens", 8, "--out", tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["prompts_with_several_completions"] == 0 and len(report["prompts"]) == 8
    assert (tmp_path / "probe.png").stat().st_size > 10_000


def test_extension_fields_reach_the_server_and_bad_options_are_refused(noisy, tmp_path):
    _, base = noisy
    res = cli("--openai", base, "--extra", '{"determinism": {"mode": "sometimes"}}', "--num-prompts", 1,
              "--out", tmp_path)
    assert res.returncode == 2 and "determinism.mode 'sometimes' is not known" in res.stderr
    res = cli("--server", "127.0.0.1:1", "--extra", "{}", "--model", "x")
    assert res.returncode == 2 and "over gRPC use --verified" in res.stderr


def test_the_default_prompts_are_distinct_and_long_enough_to_share_kv_blocks():
    prompts = pr.default_prompts(16)
    assert len(set(prompts)) == 16 and all(len(p) > 120 for p in prompts)   # 43-56 SmolLM2 tokens


@pytest.mark.model
def test_verified_on_the_embedded_model_over_http_at_concurrency_16(tmp_path):
    """The issue's run: 16 prompts, concurrency up to 16, the fast plan on torch ops
    (--no-cpu-kernels, where OFF may change with the batch): VERIFIED gives one
    completion per prompt."""
    from grpc_health.v1 import health_pb2
    http = free_port()
    proc, target, _ = start_server("--no-cpu-kernels", "--http-port", str(http))
    try:
        wait_health(target, health_pb2.HealthCheckResponse.SERVING)
        res = cli("--openai", f"http://127.0.0.1:{http}", "--verified", "--max-tokens", 12, "--out", tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        report = json.loads((tmp_path / "probe.json").read_text())
        assert report["prompts_with_several_completions"] == 0 and len(report["prompts"]) == 16
        assert report["concurrency"] == [1, 2, 4, 8, 16]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
