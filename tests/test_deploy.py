"""deploy/: Prometheus config, recording rules and alerts checked and unit-tested with
promtool, and every metric they (and the dashboard and README) use really exported."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

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
    from gateeng.engine.engine import Engine
    from gateeng.serving.metrics import Metrics
    from gateeng.request import DeterminismParams, Mode, SamplingParams
    from tiny import tiny_loaded
    engine = Engine(EngineConfig(dtype="float32", num_kv_blocks=32, max_model_len=128, block_size=4,
                                 attention_split=8, max_num_batched_tokens=64), loaded=tiny_loaded())
    metrics = Metrics()
    metrics.attach(engine, "tiny")
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


# ---- Dockerfile, compose and Kubernetes: schema validators from PyPI, offline ----------------
# Docker and a cluster are not available where the tests run: these check the files
# against the published schemas and linters, and against the server's real flags.

def venv_tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} is missing: it comes with `pip install -e '.[test]'`"
    return str(path)


def k8s_docs() -> list:
    import yaml
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "gateeng.yaml").read_text()) if d]


def serve_args_accepted(args: list) -> None:
    from gateeng.tools.cli import build_parser
    parsed = build_parser().parse_args(["serve", *args])
    assert parsed.func.__name__ == "cmd_serve"


def test_kubernetes_manifests_match_the_api_schema():
    import kubernetes_validate
    docs = k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"} <= kinds
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue      # a CRD: no schema in kubernetes-validate; its wiring is checked below
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_kubernetes_deployment_has_what_operators_need():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    pod = docs[("Deployment", "gateeng")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    # The limit is the quota the server sizes its threads to (gateeng.cpus): whole CPUs, as requested.
    limit = c["resources"]["limits"]["cpu"]
    assert limit == c["resources"]["requests"]["cpu"] and limit.isdigit()
    assert pod["securityContext"]["runAsNonRoot"] is True
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["model-cache"] == "/cache" and {"name": "GATEENG_CACHE", "value": "/cache"} in c["env"]
    secret = volumes["admin-token"]["secret"]["secretName"]
    token_file = c["args"][c["args"].index("--admin-token-file") + 1]
    assert token_file.startswith(mounts["admin-token"])
    serve_args_accepted(c["args"])
    readme = (DEPLOY / "README.md").read_text()
    assert f"kubectl create secret generic {secret}" in readme       # how the Secret is made
    # TLS on both fronts from a kubernetes.io/tls Secret, and probes that speak it (the kubelet's gRPC probe cannot).
    tls = volumes["tls"]["secret"]
    for flag, key in (("--ssl-certfile", "tls.crt"), ("--ssl-keyfile", "tls.key")):
        assert c["args"][c["args"].index(flag) + 1] == f"{mounts['tls']}/{key}"
        assert {"key": key, "path": key} in tls["items"]
    assert f"kubectl create secret tls {tls['secretName']}" in readme
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS" and c[probe]["httpGet"]["path"] == "/health"
    assert "headless" in readme and "ClusterIP" in readme
    # The ServiceMonitor scrapes a Service that selects these pods and names a metrics port.
    sm = docs[("ServiceMonitor", "gateeng")]["spec"]
    labels = docs[("Deployment", "gateeng")]["spec"]["template"]["metadata"]["labels"]
    services = [d for (kind, _), d in docs.items() if kind == "Service"
                and sm["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()]
    assert services and all(s["spec"]["selector"].items() <= labels.items() for s in services)
    assert all(any(p["name"] == sm["endpoints"][0]["port"] for p in s["spec"]["ports"]) for s in services)
    pdb = docs[("PodDisruptionBudget", "gateeng")]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["minAvailable"] < docs[("Deployment", "gateeng")]["spec"]["replicas"]   # drains can proceed


def test_compose_file_matches_the_compose_spec_and_keeps_admin_off_by_default():
    import yaml
    res = subprocess.run([venv_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                          str(DEPLOY / "docker-compose.yml")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    engine = compose["services"]["gateeng"]
    assert "change-me" not in (DEPLOY / "docker-compose.yml").read_text()
    assert engine["environment"] == ["GATEENG_ADMIN_TOKEN"]          # no default value
    serve_args_accepted(engine.get("command", []))


def test_dockerfile_passes_hadolint_and_installs_torch_before_the_source():
    res = subprocess.run([venv_tool("hadolint"), "--failure-threshold", "warning", "--no-color",
                          str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln.strip() for ln in (DEPLOY / "Dockerfile").read_text().splitlines()]
    first = {key: next(i for i, ln in enumerate(lines) if key in ln)
             for key in ("pip install torch", "--requirement", "COPY gateeng", "USER ", "HEALTHCHECK")}
    assert first["pip install torch"] < first["--requirement"] < first["COPY gateeng"]
    # pyproject.toml owns the torch pin; the image's own torch layer (before the
    # dependencies, for the layer cache) must install the same one.
    pin = re.search(r'"(torch==[0-9.]+)"', (DEPLOY.parent / "pyproject.toml").read_text()).group(1)
    assert f"pip install {pin} " in (DEPLOY / "Dockerfile").read_text()
    assert lines[first["USER "]].split()[1] not in ("root", "0")
    assert "gateeng health" in " ".join(lines[first["HEALTHCHECK"]:first["HEALTHCHECK"] + 3]).replace('", "', " ")
    entry = next(ln for ln in lines if ln.startswith("ENTRYPOINT"))
    serve_args_accepted(yaml_list(entry)[2:])
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[1] == "**" or "**" in ignore                      # everything out ...
    assert not any(".venv" in ln and ln.startswith("!") for ln in ignore)   # ... .venv stays out


def yaml_list(instruction: str) -> list:
    import json
    return json.loads(instruction.split(None, 1)[1])


def test_kuberay_fleet_runs_gateeng_fleet_behind_its_service():
    """deploy/k8s/fleet-kuberay.yaml: the RayJob's entrypoint is a `gateeng fleet` command
    the CLI accepts, its replicas fit the worker group, and the Service reaches the
    head pod's fronts on the ports the command serves."""
    import shlex

    import kubernetes_validate
    import yaml

    from gateeng.tools.cli import build_parser
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "k8s" / "fleet-kuberay.yaml").read_text()) if d}
    job, service = docs["RayJob"], docs["Service"]
    kubernetes_validate.validate(service, kubernetes_validate.latest_version(), strict=True)
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["gateeng", "fleet"]
    args = build_parser().parse_args(argv[1:])
    assert args.func.__name__ == "cmd_fleet" and args.ray_address == "auto" and args.host == "0.0.0.0"
    cluster = job["spec"]["rayClusterSpec"]
    workers = cluster["workerGroupSpecs"][0]
    worker = workers["template"]["spec"]["containers"][0]
    assert workers["replicas"] * int(worker["resources"]["limits"]["cpu"]) >= args.replicas * args.threads
    head = cluster["headGroupSpec"]["template"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports == {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    mounts = {m["name"]: m["mountPath"] for m in head["spec"]["containers"][0]["volumeMounts"]}
    assert args.admin_token_file.startswith(mounts["admin-token"])
