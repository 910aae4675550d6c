"""The daemon's side of fairness (issue 5): one object per LB holding the shared-state store,
the interaction ledger, the service counters and the overload detector, and turning core
decisions into HTTP answers (identity → 400/401, OIT/RPM throttle → 429 with headers).
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from lb.core.admission import ServiceRate
from lb.core.fairness import (VTC_CONFIG, InteractionLedger, OverloadDetector, WeightedService, rate_limits,
                              throttle_decision)
from lb.core.identity import IdentityError, parse_identity
from lb.core.queueing import make_queue
from lb.core.tenant_stats import TenantStats
from lb.core.types import RequestFacts
from lb.daemon.budgets import Budgets
from lb.daemon.errors import LBError
from lb.daemon.metrics import LATENCY_BUCKETS
from lb.daemon.state import make_store


class Fairness:
    def __init__(self, cfg):
        self.cfg = cfg
        self.store = make_store(cfg.state)
        self.ledger = InteractionLedger(cfg.fairness.interaction_ttl_s)
        wsc = cfg.fairness.wsc if cfg.queue.order != "vtc" else VTC_CONFIG
        self.service = WeightedService(wsc)
        self.overload = OverloadDetector.from_config(cfg.fairness)
        self.throttled = 0
        self.rate = ServiceRate(cfg.admission.service_tps)  # learned tokens/s the region completes
        self.tenants = TenantStats(cfg.fairness.tenant_labels, cfg.fairness.tenant_half_life_s, LATENCY_BUCKETS)
        self.budgets: Budgets | None = None  # set by attach_budgets when [budgets] sets a limit
        self.queue = None  # the LB queue, once made (make_queue): whose calls wait, for a sync round

    def make_queue(self):
        self.queue = make_queue(self.cfg.queue.order, tiers=self.cfg.tiers, service=self.service,
                                in_progress=self.ledger.in_progress)
        return self.queue

    def identify(self, headers: Mapping[str, str], doc: dict, facts: RequestFacts) -> RequestFacts:
        try:
            return parse_identity(headers, doc, self.cfg.identity).apply(facts)
        except IdentityError as e:
            raise LBError(401 if e.unauthenticated else 400, e.message, code=e.code, param=e.param) from None

    async def check_throttle(self, facts: RequestFacts, now: float, queue_len: int,
                             any_available: Callable[[], bool]) -> None:
        """Counts the request in its windows; raises the 429 when OIT/RPM says throttle.
        `any_available` is asked only then: it asks SP-P about every replica, per request, for
        nothing where no limit applies (the default)."""
        if self.budgets is not None:
            await self.budgets.check(facts)  # 429 once the tenant's tokens per minute are spent
        cfg = self.cfg.fairness
        rules = rate_limits(facts, cfg)
        if cfg.throttle == "none" or not rules:
            return
        self.overload.observe(now, queue_len, any_available())
        wall = time.time()  # windows are shared between LBs: wall time, not monotonic
        hits = [(rule, await self.store.hit(rule.key, wall, rule.window_s, rule.limit)) for rule in rules]
        decision = throttle_decision(cfg, hits, overloaded=self.overload.overloaded(now),
                                     mid_interaction=self.ledger.in_progress(facts, now))
        if decision is not None:
            self.ledger.throttled(facts, now)
            self.throttled += 1
            self.tenants.throttled(facts.user)
            raise LBError(429, decision.message, code="rate_limit_exceeded", retry_after=decision.retry_after_s,
                          headers={"x-ratelimit-limit-requests": str(decision.limit),
                                   "x-ratelimit-remaining-requests": str(decision.remaining),
                                   "x-ratelimit-reset-requests": f"{decision.reset_s:.3f}s"})

    def dispatched(self, facts: RequestFacts, now: float) -> None:
        self.ledger.dispatched(facts, now)

    def completed(self, facts: RequestFacts, now: float, usage: dict) -> None:
        prompt = int(usage.get("prompt_tokens") or facts.prompt_tokens)
        output = int(usage.get("completion_tokens") or 0)
        if usage:
            self.rate.completed(prompt + output)
        self.service.complete(facts, input_tokens=prompt, output_tokens=output)
        if self.budgets is not None and usage:
            self.budgets.spent(facts, prompt, output)
        self.tenants.served(facts.user, prompt + output if usage else 0, now)
        self.ledger.completed(facts, now, prompt + output)

    def queue_waited(self, facts: RequestFacts, replica, waited: float, now: float) -> None:
        """The dispatcher's `on_dispatch` hook: the tenant's queue wait, for /metrics."""
        self.tenants.waited(facts.user, waited)

    def attach_budgets(self, registry) -> None:
        if self.cfg.budgets.enabled:
            self.budgets = Budgets(self.cfg, self.store, registry)

    async def sync_counters(self) -> None:
        """Push this LB's service-counter changes to the shared store and adopt the totals, so
        several LBs behind one name order tenants by one history. Runs off the request path."""
        if self.budgets is not None:
            await self.budgets.flush()
        deltas = self.service.drain_deltas()
        try:
            for user, delta in deltas.items():
                if delta:
                    await self.store.add(f"wsc:{user}", delta)
            waiting = (self.service.user_of(e.facts) for e in self.queue) if self.queue is not None else ()
            users = self.service.read_back(deltas, waiting)  # bounded: a round must not hold the loop
            totals = await self.store.get_many(f"wsc:{u}" for u in users)
        except Exception:
            self.service.restore_deltas(deltas)
            raise
        self.service.set_counters({k[len("wsc:"):]: v for k, v in totals.items()})

    async def close(self) -> None:
        await self.store.close()


class TenantCollector:
    """Per-tenant series at scrape time from `Fairness.tenants` (top-K labels + `other`)."""

    def __init__(self, fairness: Fairness):
        self.fairness = fairness

    def describe(self):
        return []

    def collect(self):
        service = CounterMetricFamily("lb_tenant_service_tokens", "Prompt and output tokens served per tenant "
                                      "(top tenants by recent service; the rest as `other`)", labels=["tenant"])
        throttled = CounterMetricFamily("lb_tenant_throttled_requests", "Requests throttled (429) by OIT/RPM "
                                        "per tenant", labels=["tenant"])
        wait = HistogramMetricFamily("lb_tenant_queue_wait_seconds", "Time from arrival to dispatch per tenant",
                                     labels=["tenant"])
        bounds = [*map(str, self.fairness.tenants.wait_bounds), "+Inf"]
        for tenant, t in self.fairness.tenants.snapshot(time.monotonic()).items():
            service.add_metric([tenant], t.service_tokens)
            throttled.add_metric([tenant], t.throttled)
            wait.add_metric([tenant], list(zip(bounds, t.cumulative())), t.wait_sum)
        return [service, throttled, wait]
