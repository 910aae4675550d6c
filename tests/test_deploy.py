"""Deploy artefacts: the Helm chart renders with Helm's own engine (helm-python-sdk, Helm v4's
Go SDK, no helm binary) and its manifests validate against the Kubernetes schemas
(kubernetes-validate); the config it ships is one lb accepts; the compose example reaches its
emulators by service name; the Dockerfile's HEALTHCHECK finds the port lb listens on."""
from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.procs import PYTHON, REPO, lb

CHART = REPO / "deploy" / "helm" / "lb"
ALL_ON = {"secrets": {"adminToken": "t0ken", "peerSecret": "s3cret", "apiKeys": {"sk-a": "team-a", "sk-b": "team-b"}},
          "rbac": {"namespaces": ["engines"]}, "serviceMonitor": {"enabled": True},
          "persistence": {"enabled": True, "existingClaim": "lb-journal"},
          "engineAutoscaling": {"model": "llama", "hpa": {"enabled": True}, "keda": {"enabled": True}}}
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}


def render(values: dict) -> list[dict]:
    helm = pytest.importorskip("helm_python", reason="the deploy extra: pip install 'lb[deploy]'")
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="lb", namespace="inference")
    return [doc for text in files.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_chart_lints_clean():
    helm = pytest.importorskip("helm_python", reason="the deploy extra: pip install 'lb[deploy]'")
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


@pytest.mark.parametrize("values", [{}, ALL_ON], ids=["defaults", "all-on"])
def test_manifests_validate_against_the_kubernetes_schemas(values):
    kv = pytest.importorskip("kubernetes_validate", reason="the deploy extra: pip install 'lb[deploy]'")
    docs = render(values)
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue  # not in the Kubernetes schemas; checked field by field below
        kv.validate(doc, kv.latest_version(), strict=True)
    kinds = by_kind(docs)
    assert {"Deployment", "Service", "ConfigMap", "Secret", "ServiceAccount", "Role", "RoleBinding",
            "PodDisruptionBudget"} <= set(kinds)
    if values:
        assert {"ServiceMonitor", "HorizontalPodAutoscaler", "ScaledObject"} <= set(kinds)
        assert {r["metadata"]["namespace"] for r in kinds["Role"]} == {"inference", "engines"}


def test_deployment_probes_ports_rbac_and_monitor_agree():
    kinds = by_kind(render(ALL_ON))
    (dep,), (svc,) = kinds["Deployment"], kinds["Service"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["ports"][0]["name"] == "http" and svc["spec"]["ports"][0]["targetPort"] == "http"
    assert c["args"][c["args"].index("--port") + 1] == str(c["ports"][0]["containerPort"])
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"] == kinds["PodDisruptionBudget"][0][
        "spec"]["selector"]["matchLabels"]
    assert pod["terminationGracePeriodSeconds"] > 30  # server.shutdown_grace_s: in-flight requests finish
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]}
    assert env == {"LB_ADMIN_TOKEN": "admin-token", "LB_PEER_SECRET": "peer-secret"}
    assert set(kinds["Secret"][0]["stringData"]) >= {"admin-token", "peer-secret", "api-keys.toml"}
    assert {"name": "state", "persistentVolumeClaim": {"claimName": "lb-journal"}} in pod["volumes"]
    (rule,) = kinds["Role"][0]["rules"]
    assert rule == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    assert all(b["subjects"][0]["name"] == pod["serviceAccountName"] for b in kinds["RoleBinding"])
    (mon,) = kinds["ServiceMonitor"]
    assert svc["metadata"]["labels"] | mon["spec"]["selector"]["matchLabels"] == svc["metadata"]["labels"]
    assert mon["spec"]["endpoints"][0] | {"port": "http", "path": "/metrics"} == mon["spec"]["endpoints"][0]
    hpa, keda = kinds["HorizontalPodAutoscaler"][0], kinds["ScaledObject"][0]
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "lb_desired_replicas"
    # replicas = ceil(metric / averageValue): the engines follow lb_desired_replicas one to one
    assert hpa["spec"]["metrics"][0]["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    assert keda["spec"]["triggers"][0]["metadata"]["query"] == 'max(lb_desired_replicas{model="llama"})'


def test_rendered_config_and_api_keys_are_what_lb_accepts(tmp_path):
    """The init container's job, done here: ConfigMap lb.toml + the Secret's API keys, then
    `lb check-config` with the container's own --host/--port."""
    kinds = by_kind(render(ALL_ON))
    cm, secret, dep = kinds["ConfigMap"][0], kinds["Secret"][0], kinds["Deployment"][0]
    init = dep["spec"]["template"]["spec"]["initContainers"][0]["command"][-1]
    assert "cat /config/lb.toml /secret/api-keys.toml > /etc/lb/lb.toml" in init
    path = tmp_path / "lb.toml"
    path.write_text(cm["data"]["lb.toml"] + secret["stringData"]["api-keys.toml"])
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["serve", "--config", "/etc/lb/lb.toml"]
    out = subprocess.run(lb("check-config", str(path), *args[3:]), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    effective = tomllib.loads(out.stdout)
    assert effective["server"]["host"] == "0.0.0.0" and effective["server"]["port"] == 8080
    assert effective["discovery"][0]["kind"] == "kubernetes"
    assert sorted(effective["identity"]["api_keys"].values()) == ["team-a", "team-b"]  # masked keys, tenants kept


def test_compose_reaches_emulators_by_service_name(tmp_path):
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    services = compose["services"]
    lb_svc = services["lb"]
    cfg_path = REPO / "deploy" / "compose-lb.toml"
    cfg = tomllib.loads(cfg_path.read_text())
    emulators = {name for name, s in services.items() if "emulate" in " ".join(s.get("command", []))}
    assert len(emulators) == 2
    hosts = {r["url"].split("//")[1].split(":")[0] for r in cfg["replicas"]}
    assert hosts == emulators and "127.0.0.1" not in cfg_path.read_text()
    assert set(lb_svc["depends_on"]) == emulators
    out = subprocess.run(lb("check-config", str(cfg_path)), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr


def test_dockerignore_and_healthcheck_follow_the_port(tmp_path):
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)
    dockerfile = (REPO / "scripts" / "Dockerfile").read_text()
    health = next(line for line in dockerfile.splitlines() if line.startswith("HEALTHCHECK"))
    assert "8080" not in health and "lb.daemon.healthcheck" in health
    from lb.daemon.healthcheck import health_url

    cfg = tmp_path / "lb.toml"
    cfg.write_text("[server]\nport = 9123\n")
    assert health_url(["lb", "serve", "--config", str(cfg)]) == "http://127.0.0.1:9123/health"
    assert health_url(["lb", "serve", "--config", str(cfg), "--port", "9555"]) == "http://127.0.0.1:9555/health"
    assert health_url(["lb", "serve", f"--config={cfg}", "--host", "10.1.2.3"]) == "http://10.1.2.3:9123/health"
    assert health_url(["lb", "serve"]) == "http://127.0.0.1:8080/health"


def test_healthcheck_probes_a_live_lb_on_its_configured_port():
    from tests.daemon.conftest import start_lb

    d = start_lb("--replica", "http://127.0.0.1:9", ready=False)  # /health answers without replicas
    try:
        ok = subprocess.run([PYTHON, "-m", "lb.daemon.healthcheck", "serve", "--port", str(d.port)], timeout=30)
        assert ok.returncode == 0
    finally:
        d.proc.stop()
    down = subprocess.run([PYTHON, "-m", "lb.daemon.healthcheck", "serve", "--port", str(d.port)], timeout=30)
    assert down.returncode == 1


def test_systemd_unit_lets_lb_write_its_state_directory():
    unit = (REPO / "scripts" / "lb.service").read_text()
    settings = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert settings["ProtectSystem"] == "strict" and settings["ReadWritePaths"] == "/var/lib/lb"
    assert settings["StateDirectory"] == "lb" and settings["User"] == "lb"
    assert "useradd --system" in unit and "python3 -m venv /opt/lb/.venv" in unit
    assert settings["ExecStart"].startswith("/opt/lb/.venv/bin/lb serve")
