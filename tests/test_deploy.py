"""deploy/: Prometheus config, recording rules and alerts checked and unit-tested with
promtool, and every metric they (and the dashboard and README) use really exported."""
import shutil
import subprocess

import pytest
from prometheus_client import generate_latest

from promql import DEPLOY, expressions, metric_names, recorded_names

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: apt-get install prometheus "
                                                             "(Debian's `prometheus` package; .ci/run does)")


def promtool(*args):
    res = subprocess.run([PROMTOOL, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@needs_promtool
def test_prometheus_config_and_rules_are_valid():
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    assert "SUCCESS" in promtool("check", "rules", "rules.yml", "alerts.yml")


@needs_promtool
def test_every_recording_rule_and_alert_has_a_passing_unit_test():
    import yaml
    tests = yaml.safe_load((DEPLOY / "rules_test.yml").read_text())["tests"]
    tested = {t["expr"] for case in tests for t in case.get("promql_expr_test", [])}
    tested |= {t["alertname"] for case in tests for t in case.get("alert_rule_test", [])}
    for where in expressions():
        if where.startswith(("rules.yml:", "alerts.yml:")):
            assert where.split(":", 1)[1] in tested, f"{where} has no promtool unit test"
    assert "SUCCESS" in promtool("test", "rules", "rules_test.yml")


def exported_names() -> set:
    """Sample names a serving engine exports after OFF and VERIFIED traffic (tiny model)."""
    from gateeng.config import EngineConfig
    from gateeng.engine import Engine
    from gateeng.metrics import Metrics
    from gateeng.request import DeterminismParams, Mode, SamplingParams
    from tiny import tiny_loaded
    engine = Engine(EngineConfig(dtype="float32", num_kv_blocks=32, max_model_len=128, block_size=4,
                                 attention_split=8, max_num_batched_tokens=64), loaded=tiny_loaded())
    metrics = Metrics()
    metrics.attach(engine)
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, ignore_eos=True),
                    [DeterminismParams(Mode.VERIFIED), None])
    engine.shutdown()
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_metric_used_in_rules_dashboard_and_readme_is_exported():
    exported = exported_names()
    import yaml
    recorded = {r["record"] for g in yaml.safe_load((DEPLOY / "rules.yml").read_text())["groups"]
                for r in g["rules"] if "record" in r}
    exprs = expressions()
    assert len(exprs) > 20
    for where, expr in exprs.items():
        for name in metric_names(expr):
            assert name in exported, f"{where} uses {name}, which /metrics does not export"
        for name in recorded_names(expr):
            assert name in recorded, f"{where} uses {name}, which no recording rule defines"
