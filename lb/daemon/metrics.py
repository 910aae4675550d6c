"""Prometheus metrics (`GET /metrics`), on a registry of our own so each app is independent.

Per-replica gauges are read from the replica registry at scrape time, so the request path and
the probe loop pay nothing for them. Running totals are counters (`..._total`); the series a
replica labels are dropped when it is removed (`forget`), so churn does not grow the scrape;
`lb_requests_total{model}` names only models some replica serves, the rest go to `other`.
The process's own CPU, memory and descriptors come from prometheus_client's ProcessCollector.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PROBE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
MATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
OTHER_MODEL = "other"  # lb_requests_total{model}: a model no replica serves (bounded label set)
NO_MODEL = "none"  # ... a request that named none (SGLang's /generate)
MAX_CACHED_CHILDREN = 4096  # label sets are bounded already (models bucketed, replicas dropped)
REMOVED = "removed"  # target label of a request that finished after its replica was forgotten


class Metrics:
    def __init__(self, views: Callable[[], list], available: Callable[[object], bool],
                 leased: Callable[[object], int], adapters: Callable[[object], int] = lambda view: 0):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("lb_requests", "Requests answered, by route, model, status, policy and target",
                                ["route", "model", "status", "policy", "target"], registry=r)
        self.queue_length = Gauge("lb_queue_length", "Requests waiting in the LB queue", registry=r)
        self.queue_wait = Histogram("lb_queue_wait_seconds", "Time from arrival to dispatch",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("lb_ttft_seconds", "Arrival at the LB to first upstream byte forwarded",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("lb_e2e_seconds", "Arrival at the LB to the response's end",
                             ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("lb_prompt_tokens", "Prompt tokens reported by replicas", ["target"], registry=r)
        self.cached_tokens = Counter("lb_cached_tokens", "Prompt tokens served from a replica's prefix cache",
                                     ["target"], registry=r)
        self.output_tokens = Counter("lb_output_tokens", "Output tokens reported by replicas", ["target"], registry=r)
        # reason: why the policy chose the target (lb.core.types.Decision.reason, a fixed small set)
        self.decisions = Counter("lb_routing_decisions", "Dispatch decisions by policy, target and reason",
                                 ["policy", "target", "reason"], registry=r)
        self.prefix_match = Histogram("lb_prefix_match_blocks", "Prefix blocks matched by the routing choice",
                                      buckets=MATCH_BUCKETS, registry=r)
        # continues: yes | no (lb.core.continuations.continues): how much of the traffic that names no
        # interaction lb knows by its prompts
        self.undeclared = Counter("lb_undeclared_calls", "Calls naming no interaction or session, by whether "
                                  "their prompt continued an answered call", ["continues"], registry=r)
        self.retries = Counter("lb_upstream_retries", "Attempts retried on another replica before the first byte",
                               ["reason"], registry=r)
        self.upstream_errors = Counter("lb_upstream_errors", "Upstream failures by kind", ["target", "kind"], registry=r)
        self.cancelled = Counter("lb_client_cancellations", "Requests whose client went away", ["stage"], registry=r)
        self.probe_latency = Histogram("lb_probe_latency_seconds", "Load probe round trip", ["replica"],
                                       buckets=PROBE_BUCKETS, registry=r)
        self.probe_failures = Counter("lb_probe_failures", "Failed load probes", ["replica"], registry=r)
        # every garbage-collector pass, timed (lb.daemon.gctune): the event loop waits through each
        self.gc_pause = Histogram("lb_gc_pause_seconds", "Garbage-collector passes in the lb process, by generation",
                                  ["generation"], buckets=GC_BUCKETS, registry=r)
        self.loop_lag = Histogram("lb_event_loop_lag_seconds",
                                  "How late the event loop ran a timer due every 50 ms (lb.daemon.loopwatch)",
                                  buckets=LAG_BUCKETS, registry=r)
        r.register(_ReplicaCollector(views, available, leased, adapters))
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, fds
        # metrics labelled by a replica id, and that label's name
        self._by_replica = ((self.requests, "target"), (self.prompt_tokens, "target"), (self.cached_tokens, "target"),
                            (self.output_tokens, "target"), (self.decisions, "target"),
                            (self.upstream_errors, "target"), (self.probe_latency, "replica"),
                            (self.probe_failures, "replica"))
        self._forgotten: dict[str, None] = {}  # ids whose series were dropped (insertion-ordered, bounded)
        # (metric, label values) → its child: `labels()` validates and locks on every call, a few
        # microseconds each, several per request (profiled on the request path). Emptied when
        # series are dropped, so a forgotten child is never counted into again; bounded.
        self._children: dict[tuple, object] = {}

    def child(self, metric, *values: str):
        """`metric.labels(*values)`, remembered."""
        key = (metric, values)
        c = self._children.get(key)
        if c is None:
            if len(self._children) >= MAX_CACHED_CHILDREN:
                self._children.clear()
            c = self._children[key] = metric.labels(*values)
        return c

    def forget(self, replica: str) -> None:
        """The replica is gone (admin DELETE, reload, scale-in): drop every series it labels."""
        for metric, label in self._by_replica:
            metric.remove_by_labels({label: replica})
        self._children.clear()
        self._forgotten[replica] = None
        if len(self._forgotten) > 10_000:
            del self._forgotten[next(iter(self._forgotten))]

    def remember(self, replica: str) -> None:
        """The id is in use again (re-added): its requests are labelled by it once more."""
        self._forgotten.pop(replica, None)

    @staticmethod
    def model(model: str, served: Callable[[str], bool]) -> str:
        """A request's model label: the model when a replica lists it, else one bucket, so
        clients naming arbitrary models cannot grow the label set."""
        return (model if served(model) else OTHER_MODEL) if model else NO_MODEL

    def target(self, replica: str) -> str:
        """A request's target label: `removed` once its replica was forgotten, so a request that
        ends after the drain does not bring the dropped series back."""
        return REMOVED if replica in self._forgotten else replica

    def probe_done(self, replica: str, elapsed: float, ok: bool) -> None:
        self.child(self.probe_latency, replica).observe(elapsed)  # up to two probes a request
        if not ok:
            self.probe_failures.labels(replica).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaCollector:
    def __init__(self, views: Callable[[], list], available: Callable[[object], bool],
                 leased: Callable[[object], int], adapters: Callable[[object], int]):
        self.views = views
        self.available = available
        self.leased = leased
        self.adapters = adapters

    def describe(self):
        return []

    def collect(self):
        fams = {
            "pending": GaugeMetricFamily("lb_replica_pending", "Requests waiting inside the replica (last probe)", labels=["replica"]),
            "running": GaugeMetricFamily("lb_replica_running", "Requests running in the replica (last probe)", labels=["replica"]),
            "outstanding": GaugeMetricFamily("lb_replica_outstanding", "Requests the LB has in flight to the replica", labels=["replica"]),
            "kv": GaugeMetricFamily("lb_replica_kv_usage", "KV-cache usage 0..1 (last probe)", labels=["replica"]),
            "healthy": GaugeMetricFamily("lb_replica_healthy", "1 if probes succeed", labels=["replica"]),
            "available": GaugeMetricFamily("lb_replica_available", "1 if the pushing mode would push to it now", labels=["replica"]),
            "draining": GaugeMetricFamily("lb_replica_draining", "1 if removed and finishing in-flight requests", labels=["replica"]),
            "overcommits": GaugeMetricFamily("lb_replica_overcommits", "1 once its engine was seen to preempt admitting "
                                             "by prompt blocks (vLLM): it admits past its free KV, and selective pushing "
                                             "allows it a floor of unseen pushes",
                                             labels=["replica"]),
            "leased": GaugeMetricFamily("lb_replica_leased_tokens", "KV tokens of contexts that interactions under way "
                                        "will come back for, kept out of selective pushing's headroom (lb.core.leases)",
                                        labels=["replica"]),
            "loras": GaugeMetricFamily("lb_replica_lora_adapters", "LoRA adapters its batch runs, as the LB knows "
                                       "(its last probe's and the LB's own requests'; lb.core.adapters)", labels=["replica"]),
            "max_loras": GaugeMetricFamily("lb_replica_max_loras", "LoRA adapters one batch of the replica runs "
                                           "(only where the engine says)", labels=["replica"]),
            "engine": GaugeMetricFamily("lb_replica_engine", "1 for the engine the replica runs, configured or detected "
                                        "(auto until its first answer)", labels=["replica", "engine"]),
        }
        for v in self.views():
            fams["pending"].add_metric([v.id], v.pending)
            fams["running"].add_metric([v.id], v.running)
            fams["outstanding"].add_metric([v.id], v.outstanding)
            fams["kv"].add_metric([v.id], v.kv_usage)
            fams["healthy"].add_metric([v.id], 1.0 if v.healthy else 0.0)
            fams["available"].add_metric([v.id], 1.0 if self.available(v) else 0.0)
            fams["draining"].add_metric([v.id], 1.0 if v.draining else 0.0)
            fams["overcommits"].add_metric([v.id], 1.0 if v.overcommits else 0.0)
            fams["leased"].add_metric([v.id], self.leased(v))
            fams["engine"].add_metric([v.id, v.engine], 1.0)
            if v.max_loras is not None:
                fams["loras"].add_metric([v.id], self.adapters(v))
                fams["max_loras"].add_metric([v.id], v.max_loras)
        return list(fams.values())
