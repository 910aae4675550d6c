"""deploy/grafana/lb.json names only metrics (and labels) a live `lb` exports: lb over an
emulator serves a few requests, its /metrics is scraped, and every PromQL query of the
dashboard is checked against what came back."""
from __future__ import annotations

import json
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.conftest import http_json, needs_emulator, start_lb_with_emulator
from tests.procs import REPO

pytestmark = needs_emulator
DASHBOARD = REPO / "deploy" / "grafana" / "lb.json"
METRIC = re.compile(r"\b(?:lb|process)_[a-zA-Z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("_sum", "_count", ""), "info": ("_info",), "untyped": ("",)}
ADDED_BY_PROMETHEUS = {"instance", "job", "le"}


def queries() -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every target, rows' panels included."""
    doc = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            out.extend((p["title"], t["expr"], t.get("legendFormat", "")) for t in p.get("targets", []))
    walk(doc["panels"])
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["definition"], ""))
    return out


def exported(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Sample names /metrics can carry (from each family's type) and the labels seen on each."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        names |= {fam.name + s for s in SUFFIXES[fam.type]}
        for s in fam.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return names, labels


def test_every_dashboard_query_names_metrics_lb_exports(tmp_path, procs):
    d, _ = start_lb_with_emulator(procs, tmp_path, '[fairness]\n')
    for i in range(4):
        status, _ = http_json("POST", d.url + "/v1/chat/completions",
                              {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": f"hello {i}"}]},
                              headers={"x-lb-user": f"tenant-{i % 2}"})
        assert status == 200
    with urllib.request.urlopen(d.url + "/metrics", timeout=10) as r:
        names, labels = exported(r.read().decode())
    qs = queries()
    assert len(qs) >= 40
    missing, bad_labels = [], []
    for title, expr, legend in qs:
        used = set(METRIC.findall(expr))
        assert used, f"{title}: {expr} names no lb metric"
        missing += [f"{title}: {m}" for m in sorted(used - names)]
        # labels the query groups by or prints must be on one of its metrics (where lb sent samples)
        wanted = set(re.findall(r"\{\{(\w+)\}\}", legend))
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            wanted |= {g.strip() for g in group.split(",")}
        known = [labels[m] for m in used if m in labels]
        if known and len(known) == len(used):
            have = set().union(*known) | ADDED_BY_PROMETHEUS
            bad_labels += [f"{title}: {lab}" for lab in sorted(wanted - have)]
    assert not missing, f"metrics the dashboard names but lb does not export: {missing}"
    assert not bad_labels, f"labels the dashboard uses that lb's metrics lack: {bad_labels}"
    # the panels the issue asks for are there
    titles = " ".join(t for t, _, _ in qs).lower()
    for topic in ("queue", "push", "replica", "first token", "end to end", "cache hit", "peer", "tenant", "desired"):
        assert topic in titles, topic


def test_dashboard_json_is_the_generator_output():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(DASHBOARD.parent / "make_dashboard.py")], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out == DASHBOARD.read_text(), "run: python deploy/grafana/make_dashboard.py > deploy/grafana/lb.json"
