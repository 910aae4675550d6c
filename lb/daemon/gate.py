"""The request path's SLO gate (issue 5): admission at arrival, NIW deferral, the `priority`
forwarded to each engine, and the background round that feeds them.

- `admit()` runs `lb.core.admission.judge` with the region's learned service rate and the
  tokens queued ahead: admit; degrade (lower `max_tokens`/`max_completion_tokens` in the
  forwarded body, say so in `x-lb-degraded`); or reject at once with 429/503, Retry-After
  and the reason (`code: slo_infeasible`). NIW requests are then *held*: the connection
  stays open while the deferred queue keeps them out of the LB queue, and they continue
  like any other request once released.
- `body_for()` gives the bytes for one replica: the tier's `priority` in that engine's
  direction, plus any rewrite admission made.
- `round()` runs once per probe interval, off the request path: it closes service-rate
  intervals, releases deferred work by effective KV utilization (1 below 60%, 2 below 50%,
  or promoted by age/deadline), and syncs service counters with the shared store.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace

import orjson
from aiohttp import web
from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily

from lb.core.admission import NO_CAPACITY, Admission, RegionLoad, judge
from lb.core.deferred import DeferredQueue
from lb.core.tiers import engine_priority
from lb.core.types import QueueEntry, RequestFacts, Tier
from lb.daemon.errors import LBError

log = logging.getLogger("lb.admission")

RESPONSE_HEADERS = "lb_response_headers"  # request key: headers every response to it carries
REWRITTEN = "lb_body_rewritten"  # request key: the parsed body differs from the bytes received
OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens")
DEGRADED_HEADER = "x-lb-degraded"  # what a degrade changed, on the answer


def rejection(decision: Admission) -> LBError:
    """A rejected admission as the client's answer: 503 when nothing can serve it at all,
    429 when nothing can serve it in time now; Retry-After either way."""
    status = 503 if decision.reason == NO_CAPACITY else 429
    return LBError(status, f"Request cannot meet its SLO: {decision.reason} (estimated TTFT "
                           f"{decision.estimate.ttft_s:.2f}s). Retry after {decision.retry_after_s}s.",
                   code="slo_infeasible", retry_after=decision.retry_after_s,
                   headers={"x-lb-reject-reason": decision.reason})


async def add_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp `on_response_prepare`: e.g. `x-lb-degraded` on a streamed or plain answer."""
    for k, v in (request.get(RESPONSE_HEADERS) or {}).items():
        response.headers[k] = v


class Gate:
    def __init__(self, cfg, registry, dispatcher, metrics):
        self.cfg = cfg
        self.registry = registry
        self.dispatcher = dispatcher
        self.fairness = dispatcher.fairness
        self.deferred = DeferredQueue(cfg.deferred, cfg.tiers)
        self._seq = itertools.count()
        self._task: asyncio.Task | None = None
        self._last_sync = 0.0
        r = metrics.registry
        self.decisions = Counter("lb_admission_decisions", "Admission decisions by action and reason",
                                 ["action", "reason"], registry=r)
        self.released = Counter("lb_deferred_released", "NIW requests released from the deferred queue",
                                ["why"], registry=r)
        Gauge("lb_deferred_waiting", "NIW requests held in the deferred queue",
              registry=r).set_function(lambda: len(self.deferred))
        Gauge("lb_service_rate_tokens_per_second", "Learned tokens/s the region completes when busy",
              registry=r).set_function(lambda: self.fairness.rate.rate)
        Gauge("lb_overloaded", "1 while the region counts as overloaded for OIT",
              registry=r).set_function(lambda: float(self.fairness.overload.overloaded(time.monotonic())))
        r.register(_ThrottleTotals(self.fairness))

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="admission-gate")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for entry in list(self.deferred):
            self.deferred.remove(entry)
            if not entry.payload.done():
                entry.payload.set_exception(
                    LBError(503, "the load balancer is shutting down", code="shutting_down", retry_after=1))

    async def _run(self) -> None:
        interval = self.cfg.probes.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.round(time.monotonic())
            except Exception as e:  # a store outage must not stop releases
                log.warning("admission round failed: %s: %s", type(e).__name__, e)

    async def round(self, now: float) -> None:
        queue = self.dispatcher.queue
        active = list(self.registry.active())
        any_available = any(self.dispatcher.available(r.view) for r in active)
        busy = len(queue) > 0 or not any_available
        self.fairness.rate.tick(now, busy)
        self.fairness.overload.observe(now, len(queue), any_available)  # not only on arrivals
        if len(self.deferred):
            for rel in self.deferred.release_round(now, queued=len(queue), replicas=[r.view for r in active],
                                                   available=self.dispatcher.available):
                self.released.labels("promoted" if rel.promoted else "capacity").inc()
                if not rel.entry.payload.done():
                    rel.entry.payload.set_result(None)
        if now - self._last_sync >= self.cfg.state.get("sync_interval_s", 0.5):
            self._last_sync = now
            await self.fairness.sync_counters()

    # -- the request side ----------------------------------------------------------------------
    def load(self) -> RegionLoad:
        # kept by the scheduler as entries come and go: no walk of the queue per arrival
        ahead = self.dispatcher.scheduler.queued_work.tokens(self.fairness.service.expected_for)
        return RegionLoad(tokens_ahead=ahead, service_tps=self.fairness.rate.rate)

    async def admit(self, request: web.Request, facts: RequestFacts, doc: dict) -> RequestFacts:
        """Judge the request against its tier; returns the facts it continues with (maybe a
        degraded tier or limit). Raises the early 429/503. Holds NIW requests until released."""
        if self.cfg.admission.enabled:
            decision = judge(facts, self.load(), self.cfg.admission, self.cfg.tiers,
                             expected_output=self.fairness.service.expected_output(facts))
            self.decisions.labels(decision.action, decision.reason).inc()
            if decision.action == "reject":
                raise rejection(decision)
            if decision.action == "degrade":
                request[RESPONSE_HEADERS] = {**request.get(RESPONSE_HEADERS, {}), DEGRADED_HEADER: decision.degraded}
                if decision.max_tokens is not None:
                    field = next((f for f in OUTPUT_FIELDS if f in doc), "max_tokens")
                    doc[field] = decision.max_tokens
                    request[REWRITTEN] = True
                facts = replace(facts, tier=decision.tier,
                                max_tokens=decision.max_tokens if decision.max_tokens is not None else facts.max_tokens)
        if facts.tier is Tier.NIW:
            await self.hold(facts)
        return facts

    async def hold(self, facts: RequestFacts) -> None:
        """Keep a NIW request out of the LB queue until the deferred queue releases it."""
        fut = asyncio.get_running_loop().create_future()
        entry = QueueEntry(facts=facts, enqueued_at=time.monotonic(), seq=next(self._seq), payload=fut)
        try:
            self.deferred.push(entry)
        except OverflowError as e:
            raise LBError(429, f"batch work is not accepted right now: {e}", code="deferred_full",
                          retry_after=self.cfg.queue.retry_after_s) from None
        try:
            await fut
        finally:
            self.deferred.remove(entry)  # a client that left is no longer waited for

    def body_for(self, request: web.Request, engine: str, facts: RequestFacts, doc: dict, body: bytes) -> bytes:
        """The bytes to send one replica: the tier's `priority` for its engine, and any rewrite."""
        priority = engine_priority(facts.tier, engine, self.cfg.tiers)
        if priority is None and not request.get(REWRITTEN):
            return body
        out = dict(doc)
        if priority is not None:
            out["priority"] = priority
        return orjson.dumps(out)


class _ThrottleTotals:
    """Running totals the fairness state keeps, exported as counters (`..._total`) at scrape time."""

    def __init__(self, fairness):
        self.fairness = fairness

    def describe(self):
        return []

    def collect(self):
        f = self.fairness
        for name, doc, value in (
                ("lb_throttled_requests", "Requests throttled (429) by OIT/RPM", f.throttled),
                ("lb_tokens_wasted", "Tokens spent on interactions later aborted by a throttle", f.ledger.tokens_wasted),
                ("lb_interactions_aborted", "Interactions throttled after they had started",
                 f.ledger.interactions_aborted)):
            yield CounterMetricFamily(name, doc, value=value)
