"""Where the project writes PromQL: the rules, the alerts, the dashboard and the README."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def expressions() -> dict:
    """{where: expression} for every PromQL expression the project ships or documents."""
    out = {}
    for name in ("rules.yml", "alerts.yml"):
        for group in yaml.safe_load((DEPLOY / name).read_text())["groups"]:
            for rule in group["rules"]:
                out[f"{name}:{rule.get('record') or rule.get('alert')}"] = rule["expr"]
    dash = json.loads((DEPLOY / "grafana" / "gateeng.json").read_text())
    for panel in dash["panels"]:
        for t in panel["targets"]:
            # Grafana's values for its variables: the "All" of the model_name variable is ".*".
            expr = t["expr"].replace("$__rate_interval", "1m").replace("$model_name", ".*")
            out[f"dashboard:{panel['title']}:{t['refId']}"] = expr
    readme = (ROOT / "README.md").read_text()
    for i, block in enumerate(re.findall(r"```promql\n(.*?)```", readme, re.S)):
        out[f"README:block{i}"] = " ".join(block.split())
    spans = [s for s in re.findall(r"`([^`\n]+)`", readme) if "gateeng_" in s and "(" in s]
    for i, inline in enumerate(spans):
        out[f"README:inline{i}"] = inline
    return out


def metric_names(expr: str) -> set:
    return set(re.findall(r"\b(gateeng_[a-z0-9_]+)", expr))


def recorded_names(expr: str) -> set:
    return set(re.findall(r"\b(gateeng:[a-z_0-9:]+)", expr))


def readme_trigger_rate() -> str:
    """The README's overall trigger-rate query (its first promql block)."""
    return expressions()["README:block0"]
