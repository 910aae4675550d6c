"""Per-tenant service, throttles and queue wait in `/metrics` (a real lb over an emulator,
parsed by prometheus_client): more tenants than labels, the top ones by recent service
labelled, the rest in `other`, a tenant moving in and out, and totals that add up."""
from __future__ import annotations

from tests.daemon.conftest import http_json, needs_emulator, start_lb_with_emulator
from tests.procs import scrape_metrics

pytestmark = needs_emulator

TOML = ('[fairness]\ntenant_labels = 2\nthrottle = "rpm"\nwindow_s = 600.0\n'
        'user_rpm_overrides = { "t-heavy" = 4 }\n')


def chat(lb, tenant: str) -> tuple[int, int]:
    """(status, tokens served) of one request as `tenant`."""
    status, doc = http_json("POST", lb.url + "/v1/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "hi " * 8}], "max_tokens": 4},
                            headers={"x-lb-user": tenant})
    assert status in (200, 429), doc
    usage = doc.get("usage") or {}
    return status, int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))


def by_tenant(m: dict, sample: str) -> dict[str, float]:
    return {s.labels["tenant"]: s.value for samples in m.values() for s in samples if s.name == sample}


def test_top_tenants_labelled_rest_in_other_totals_consistent_as_tenants_move(procs, tmp_path):
    lb, _ = start_lb_with_emulator(procs, tmp_path, TOML, "--speed", "50")
    sent = {"served": 0, "ok": 0, "throttled": 0}

    def send(tenant: str, n: int) -> int:
        before = sent["served"]
        for _ in range(n):
            status, tokens = chat(lb, tenant)
            sent["served"] += tokens
            sent["ok"] += status == 200
            sent["throttled"] += status == 429
        return sent["served"] - before

    def check_totals(m: dict) -> dict[str, float]:
        service = by_tenant(m, "lb_tenant_service_tokens_total")
        assert sum(service.values()) == sent["served"] > 0
        assert sum(by_tenant(m, "lb_tenant_throttled_requests_total").values()) == sent["throttled"]
        assert sum(by_tenant(m, "lb_tenant_queue_wait_seconds_count").values()) == sent["ok"]
        assert set(by_tenant(m, "lb_tenant_queue_wait_seconds_count")) == set(service)
        return service

    # 5 tenants, 2 labels: t-heavy (4 served, 2 throttled), t-mid 2, three light ones 1 each
    for tenant, n in {"t-heavy": 6, "t-mid": 2, "t-a": 1, "t-b": 1, "t-c": 1}.items():
        send(tenant, n)
    assert sent["throttled"] == 2
    check_totals(scrape_metrics(lb.url))  # this scrape ranks: the top two count under their names from now on
    send("t-heavy", 1)  # throttled
    send("t-mid", 1)
    send("t-a", 1)
    m = scrape_metrics(lb.url)
    service = check_totals(m)
    assert set(service) == {"t-heavy", "t-mid", "other"}
    assert by_tenant(m, "lb_tenant_throttled_requests_total") == {"t-heavy": 1, "t-mid": 0, "other": 2}
    waits = by_tenant(m, "lb_tenant_queue_wait_seconds_count")
    assert waits["t-mid"] == 1 and waits["t-heavy"] == 0
    inf = {s.labels["tenant"]: s.value for s in m["lb_tenant_queue_wait_seconds"]
           if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"}
    assert inf == waits

    # t-a becomes the busiest (7 served); t-mid (3) drops out, t-heavy (4) stays
    a_tokens = send("t-a", 5)  # counted under `other` until the next scrape ranks t-a
    scrape_metrics(lb.url)
    m = scrape_metrics(lb.url)
    after = check_totals(m)
    assert set(after) == {"t-a", "t-heavy", "other"}
    assert after["other"] == service["other"] + service["t-mid"] + a_tokens  # t-mid's history folded in
    assert after["t-heavy"] == service["t-heavy"]
