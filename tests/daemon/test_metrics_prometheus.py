"""`/metrics` as a Prometheus user reads it, parsed by prometheus_client's own parser: running
totals are counters named `..._total`, `lb_requests_total` carries a bounded `model` label, a
removed replica's series leave the scrape, and the process's own metrics are there."""
from __future__ import annotations

from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb
from tests.procs import poll, scrape_metrics

pytestmark = needs_emulator

MSG = [{"role": "user", "content": "hi"}]


def chat(d, model: str) -> int:
    return http_json("POST", d.url + "/v1/chat/completions", {"model": model, "messages": MSG, "max_tokens": 2})[0]


def labelled(m: dict, family: str, **labels: str) -> list:
    return [s for s in m.get(family, []) if all(s.labels.get(k) == v for k, v in labels.items())]


def test_counters_model_label_process_metrics_and_removed_replica_series(procs):
    emus = [start_emulator(name=f"emu{i}") for i in range(2)]
    procs.extend(p for p, _ in emus)
    a, b = (u for _, u in emus)
    d = start_lb("--replica", a, "--replica", b, "--engine", "sglang", "--model", "m")
    procs.append(d.proc)
    for _ in range(6):  # round the replicas: both serve some
        assert chat(d, "m") == 200
    assert chat(d, "no-such-model") == 404
    m = scrape_metrics(d.url)

    # counters, not gauges, for running totals; the parser keeps `_total` on the samples only
    for family in ("lb_throttled_requests", "lb_tokens_wasted", "lb_interactions_aborted"):
        assert [s.name for s in m[family]] == [family + "_total"], family
    # the model label: a served model by name, anything else in one bucket
    assert sum(s.value for s in labelled(m, "lb_requests", model="m", status="200")) == 6
    assert [s.value for s in labelled(m, "lb_requests", model="other", status="404")] == [1.0]
    assert not labelled(m, "lb_requests", model="no-such-model")
    # prometheus_client's ProcessCollector
    assert m["process_resident_memory_bytes"][0].value > 0 and "process_cpu_seconds" in m
    # the collector was settled once the server listened (lb.daemon.gctune): its passes are timed
    assert {s.labels["generation"] for s in m["lb_gc_pause_seconds"] if s.name.endswith("_count")} == {"0", "1", "2"}
    # ...and the event loop's lag is watched (lb.daemon.loopwatch)
    assert [s.value for s in m["lb_event_loop_lag_seconds"] if s.name.endswith("_count")][0] > 0

    served = {s.labels["target"] for s in labelled(m, "lb_requests", status="200")}
    assert len(served) == 2
    gone = sorted(served)[0]
    kept_before = sum(s.value for s in labelled(m, "lb_requests", model="m", status="200") if s.labels["target"] != gone)
    auth = {"Authorization": f"Bearer {d.token}"}
    assert http_json("DELETE", d.url + f"/admin/replicas/{gone}", headers=auth)[0] == 202

    def dropped() -> bool:
        now = scrape_metrics(d.url)
        return not any(s.labels.get("target") == gone or s.labels.get("replica") == gone
                       for samples in now.values() for s in samples)
    poll(dropped, what=f"every series labelled {gone} to leave /metrics")
    m = scrape_metrics(d.url)
    kept = ({s.labels["target"] for s in labelled(m, "lb_requests", status="200")}
            | {s.labels["replica"] for s in m["lb_replica_healthy"]})
    assert kept == served - {gone}
    assert chat(d, "m") == 200  # the rest keep counting
    assert sum(s.value for s in labelled(scrape_metrics(d.url), "lb_requests", model="m", status="200")) == kept_before + 1
