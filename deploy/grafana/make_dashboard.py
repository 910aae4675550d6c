"""Writes deploy/grafana/lb.json: python deploy/grafana/make_dashboard.py > deploy/grafana/lb.json

Edit the panels here, not the JSON; tests/daemon/test_dashboard.py checks the JSON is this
output and that every query names metrics a live lb exports. Every query filters on
$instance and uses $__rate_interval, so the dashboard works with any scrape interval.
"""
import json

I = '{instance=~"$instance"}'


def sel(extra=""):
    """A label selector on the chosen lb instances, plus `extra` matchers."""
    return '{instance=~"$instance"' + (", " + extra if extra else "") + "}"


R = "[$__rate_interval]"
panels, y, pid = [], 0, 1  # the layout cursor: panels go left to right, rows top to bottom
x = 0


def row(title):
    global y, pid
    panels.append({"type": "row", "title": title, "id": pid, "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
    pid += 1; y += 1


def panel(title, targets, unit="short", kind="timeseries", w=8, h=7, desc=""):
    global x, y, pid
    if x + w > 24:
        x = 0; y += h
    p = {"type": kind, "title": title, "id": pid, "datasource": {"type": "prometheus", "uid": "${datasource}"},
         "gridPos": {"h": h, "w": w, "x": x, "y": y},
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
         "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": l,
                      "datasource": {"type": "prometheus", "uid": "${datasource}"}} for i, (e, l) in enumerate(targets)]}
    if desc: p["description"] = desc
    if kind == "stat": p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}}
    panels.append(p); pid += 1; x += w


def endrow(h=7):
    global x, y
    x = 0; y += h


def q(p, metric, by="le", extra=""):
    """The p-quantile of a histogram, grouped by `by` (which must keep `le`)."""
    return f'histogram_quantile({p}, sum by ({by}) (rate({metric}_bucket{sel(extra)}{R})))'


row("Overview")
panel("Requests/s by status", [(f'sum by (status) (rate(lb_requests_total{I}{R}))', "{{status}}")], "reqps", w=6)
panel("Requests/s by model", [(f'sum by (model) (rate(lb_requests_total{I}{R}))', "{{model}}")], "reqps", w=6)
panel("Healthy replicas", [(f'sum(lb_replica_healthy{I})', "healthy"), (f'count(lb_replica_healthy{I})', "known")], kind="stat", w=4)
panel("LB queue", [(f'sum(lb_queue_length{I})', "waiting")], kind="stat", w=4)
panel("Overloaded (OIT)", [(f'max(lb_overloaded{I})', "overloaded")], kind="stat", w=4)
endrow()
row("Queue and selective pushing")
panel("LB queue length", [(f'lb_queue_length{I}', "{{instance}}"), (f'lb_deferred_waiting{I}', "deferred (NIW) {{instance}}")])
panel("Queue wait", [(q(0.5, "lb_queue_wait_seconds"), "p50"), (q(0.95, "lb_queue_wait_seconds"), "p95"), (q(0.99, "lb_queue_wait_seconds"), "p99")], "s")
panel("Replicas the pushing mode would push to", [(f'sum(lb_replica_available{I})', "available"), (f'sum(lb_replica_healthy{I})', "healthy"), (f'sum(lb_replica_draining{I})', "draining")])
panel("Dispatch decisions/s by target", [(f'sum by (target) (rate(lb_routing_decisions_total{I}{R}))', "{{target}}")], "ops")
panel("Retries and upstream errors/s", [(f'sum by (reason) (rate(lb_upstream_retries_total{I}{R}))', "retry: {{reason}}"), (f'sum by (kind) (rate(lb_upstream_errors_total{I}{R}))', "error: {{kind}}")], "ops")
panel("Admission decisions/s", [(f'sum by (action, reason) (rate(lb_admission_decisions_total{I}{R}))', "{{action}} {{reason}}"), (f'sum(rate(lb_throttled_requests_total{I}{R}))', "throttled (429)")], "ops")
endrow()
row("Replicas: load and health")
panel("Outstanding (LB in flight) by replica", [(f'lb_replica_outstanding{I}', "{{replica}}")])
panel("Waiting inside the engine by replica", [(f'lb_replica_pending{I}', "{{replica}}")])
panel("Running by replica", [(f'lb_replica_running{I}', "{{replica}}")])
panel("KV-cache usage by replica", [(f'lb_replica_kv_usage{I}', "{{replica}}")], "percentunit")
panel("Health (1 = probes succeed) and draining", [(f'lb_replica_healthy{I}', "healthy {{replica}}"), (f'lb_replica_draining{I}', "draining {{replica}}")])
panel("Probes: p95 latency and failures/s", [(q(0.95, "lb_probe_latency_seconds", "le, replica"), "p95 {{replica}}"), (f'sum by (replica) (rate(lb_probe_failures_total{I}{R}))', "failures {{replica}}")], "s")
endrow()
row("Discovery (Kubernetes, DNS)")
panel("Replicas per discovery source", [(f'lb_discovery_replicas{I}', "{{source}} ({{kind}})")], w=12)
panel("Relists / lookups and errors per second", [(f'sum by (source) (rate(lb_discovery_lists_total{I}{R}))', "lists {{source}}"), (f'sum by (source) (rate(lb_discovery_errors_total{I}{R}))', "errors {{source}}")], "ops", w=12)
endrow()
row("Latency")
panel("Time to first token", [(q(0.5, "lb_ttft_seconds", "le, route"), "p50 {{route}}"), (q(0.95, "lb_ttft_seconds", "le, route"), "p95 {{route}}"), (q(0.99, "lb_ttft_seconds", "le, route"), "p99 {{route}}")], "s", w=12)
panel("End to end", [(q(0.5, "lb_e2e_seconds", "le, route"), "p50 {{route}}"), (q(0.95, "lb_e2e_seconds", "le, route"), "p95 {{route}}"), (q(0.99, "lb_e2e_seconds", "le, route"), "p99 {{route}}")], "s", w=12)
endrow()
row("Prefix cache")
panel("Cache hit (cached / prompt tokens)", [(f'sum(rate(lb_cached_tokens_total{I}{R})) / clamp_min(sum(rate(lb_prompt_tokens_total{I}{R})), 1)', "all"), (f'sum by (target) (rate(lb_cached_tokens_total{I}{R})) / clamp_min(sum by (target) (rate(lb_prompt_tokens_total{I}{R})), 1)', "{{target}}")], "percentunit")
panel("Prefix blocks matched by the routing choice", [(q(0.5, "lb_prefix_match_blocks"), "p50"), (q(0.95, "lb_prefix_match_blocks"), "p95")])
panel("Tokens/s", [(f'sum(rate(lb_prompt_tokens_total{I}{R}))', "prompt"), (f'sum(rate(lb_cached_tokens_total{I}{R}))', "cached"), (f'sum(rate(lb_output_tokens_total{I}{R}))', "output"), (f'sum(rate(lb_tokens_wasted_total{I}{R}))', "wasted (aborted)")])
panel("KV leases by replica", [(f'lb_replica_leased_tokens{I}', "{{replica}}")],
      desc="Tokens of contexts that interactions between their calls will come back for, kept out of selective pushing's headroom (docs/routing.md)")
panel("Calls naming no interaction: share known by their prompts", [
    ('sum(rate(lb_undeclared_calls_total' + sel('continues="yes"') + f'{R})) / clamp_min(sum(rate(lb_undeclared_calls_total{I}{R})), 1e-9)',
     "continue an answered call")],
      "percentunit", desc="Of the calls that send no x-lb-interaction-id or x-lb-session, the share whose prompt extended an answered call's (lb.core.continuations)")
endrow()
row("Peers (other regions)")
panel("Peer healthy / available", [(f'lb_peer_healthy{I}', "healthy {{peer}}"), (f'lb_peer_available{I}', "available {{peer}}")])
panel("Peer RTT and status age", [(f'lb_peer_rtt_seconds{I}', "rtt {{peer}}"), (f'lb_peer_status_age_seconds{I}', "status age {{peer}}")], "s")
panel("Forwards/s", [(f'sum by (peer, outcome) (rate(lb_peer_forwards_total{I}{R}))', "to {{peer}} {{outcome}}"), (f'sum by (peer) (rate(lb_peer_received_total{I}{R}))', "from {{peer}}"), (f'sum by (endpoint) (rate(lb_peer_auth_failures_total{I}{R}))', "auth failures {{endpoint}}")], "ops")
panel("Peer queue and adopted replicas", [(f'lb_peer_queue_length{I}', "queue {{peer}}"), (f'lb_peer_adopted_replicas{I}', "adopted {{peer}}")])
endrow()
row("Fairness (tenants)")
panel("Tokens served/s by tenant", [(f'sum by (tenant) (rate(lb_tenant_service_tokens_total{I}{R}))', "{{tenant}}")])
panel("Throttled/s by tenant", [(f'sum by (tenant) (rate(lb_tenant_throttled_requests_total{I}{R}))', "{{tenant}}")], "ops")
panel("Queue wait p95 by tenant", [(q(0.95, "lb_tenant_queue_wait_seconds", "le, tenant"), "{{tenant}}")], "s")
endrow()
row("Capacity")
panel("Replicas: desired vs active", [(f'lb_desired_replicas{I}', "desired {{region}}/{{model}}"), (f'lb_pool_replicas{I}', "active {{region}}/{{model}}"), (f'lb_planned_replicas{I}', "planned {{region}}/{{model}}")])
panel("Tokens/s: observed vs forecast vs service rate", [(f'lb_observed_tokens_per_s{I}', "observed {{model}}"), (f'lb_forecast_tokens_per_s{I}', "forecast {{kind}} {{model}}"), (f'lb_service_rate_tokens_per_second{I}', "service rate")])
panel("Pool KV usage, queue p95, tokens in flight", [(f'lb_pool_effective_kv_usage{I}', "KV {{model}}"), (f'lb_queue_latency_p95_seconds{I}', "queue p95 s {{model}}"), (f'lb_tokens_in_flight{I} / 1000', "k tokens in flight {{model}}")])
panel("Scaling decisions/s", [(f'sum by (direction) (rate(lb_scaling_decisions_total{I}{R}))', "{{direction}}")], "ops")
panel("Durable jobs", [(f'lb_jobs_unfinished{I}', "unfinished"), (f'sum by (status) (rate(lb_jobs_finished_total{I}{R}))', "finished/s {{status}}")])
panel("lb process", [(f'rate(process_cpu_seconds_total{I}{R})', "CPU cores {{instance}}"), (f'process_resident_memory_bytes{I} / 2^30', "RSS GiB {{instance}}")])
panel("lb event loop: timer lag and collector pauses", [
    (q(0.99, "lb_event_loop_lag_seconds", "le, instance"), "loop lag p99 {{instance}}"),
    (f'sum by (instance) (rate(lb_gc_pause_seconds_sum{I}{R}))', "GC seconds per second {{instance}}")], "s",
    desc="How late a 50 ms timer runs (every request in flight waits through a stall) and the time spent in garbage-collector passes")
endrow()

dash = {"title": "lb: LLM load balancer", "uid": "lb-overview", "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["lb", "llm"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "",
        "description": "Queue, selective pushing, per-replica load and health, TTFT/E2E, prefix-cache hit, peers, fairness and capacity of lb (docs/deploy.md).",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus", "current": {}},
            {"name": "instance", "type": "query", "label": "lb instance", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(lb_queue_length, instance)", "refId": "instances"},
             "definition": "label_values(lb_queue_length, instance)", "includeAll": True, "multi": True,
             "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "refresh": 2}]},
        "annotations": {"list": []}, "panels": panels}
print(json.dumps(dash, indent=1))
