"""Tenant token budgets on the request path (decisions: lb.core.budgets).

`check` reads the tenant's window buckets from the state store (shared through Redis by every
LB of a region) plus what this LB has not flushed yet, and raises the 429 in the OpenAI shape
with Retry-After and `x-ratelimit-*-tokens` headers. `spent` records a finished request's
prompt and output tokens locally; `flush` (the admission gate's round, off the request path)
adds them to the store's window buckets and spend ledger.

Metrics have bounded labels: a tenant named in the config (`[identity] api_keys` values,
`[budgets] overrides`) is its own label, every other tenant is `other`.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict

from prometheus_client import Counter

from lb.core.budgets import (BudgetConfig, current_bucket, ledger_key, limit_for, verdict, window_buckets,
                             window_key)
from lb.core.types import RequestFacts
from lb.daemon.errors import LBError

log = logging.getLogger("lb.budgets")
MAX_LABELS = 1000  # configured tenants exported by name; beyond (and unconfigured ones): `other`
MAX_PENDING = 100_000  # unflushed (tenant, bucket) entries; beyond, the oldest are dropped with a warning


class Budgets:
    def __init__(self, cfg, store, registry):
        self.cfg: BudgetConfig = cfg.budgets
        self.store = store
        named = [*cfg.identity.api_keys.values(), *self.cfg.overrides]
        self.labels = set(list(dict.fromkeys(named))[:MAX_LABELS])
        self.pending: dict[tuple[str, int], float] = defaultdict(float)  # window tokens not in the store yet
        self.ledger: dict[tuple[str, str], float] = defaultdict(float)  # spend not in the store yet
        self.spend = Counter("lb_tenant_spend_tokens", "Tokens served per tenant and kind (prompt, output): the "
                             "spend ledger as this LB saw it", ["tenant", "kind"], registry=registry)
        self.rejected = Counter("lb_tenant_budget_rejected", "Requests refused (429) because the tenant's tokens "
                                "per minute were spent", ["tenant"], registry=registry)

    def label(self, tenant: str | None) -> str:
        return tenant if tenant in self.labels else "other"

    async def check(self, facts: RequestFacts) -> None:
        limit = limit_for(self.cfg, facts.user)
        if limit is None:
            return
        now = time.time()  # buckets are shared between LBs: wall time
        buckets = window_buckets(self.cfg, now)
        try:
            stored = await self.store.get_many(window_key(facts.user, b) for b, _ in buckets)
        except Exception as e:  # the shared store is down: judge on what this LB knows (fail open)
            log.warning("budget window unreadable (%s: %s): judging on this LB's own counts", type(e).__name__, e)
            stored = {}
        totals = {b: stored.get(window_key(facts.user, b), 0.0) + self.pending.get((facts.user, b), 0.0)
                  for b, _ in buckets}
        v = verdict(self.cfg, limit, totals, now)
        if v.allowed:
            return
        self.rejected.labels(self.label(facts.user)).inc()
        retry = max(1, round(v.retry_after_s))
        raise LBError(429, f"Rate limit reached for tenant {facts.user} on tokens per min (TPM): limit {limit}, "
                           f"used {int(v.used)}. Please try again in {retry}s.",
                      code="rate_limit_exceeded", retry_after=retry,
                      headers={"x-ratelimit-limit-tokens": str(limit),
                               "x-ratelimit-remaining-tokens": str(v.remaining),
                               "x-ratelimit-reset-tokens": f"{v.retry_after_s:.3f}s"})

    def spent(self, facts: RequestFacts, prompt: int, output: int) -> None:
        """A request ended having used these tokens (the engine's usage)."""
        tenant = facts.user
        if tenant is None or prompt + output <= 0:
            return
        label = self.label(tenant)
        self.spend.labels(label, "prompt").inc(prompt)
        self.spend.labels(label, "output").inc(output)
        if len(self.pending) >= MAX_PENDING:  # the store has been unreachable for long: keep the newest
            for key in list(self.pending)[: MAX_PENDING // 10]:
                del self.pending[key]
            log.warning("budget window counters could not reach the store; dropped the oldest 10%")
        self.pending[(tenant, current_bucket(self.cfg, time.time()))] += prompt + output
        if len(self.ledger) < 2 * MAX_PENDING:
            self.ledger[(tenant, "prompt")] += prompt
            self.ledger[(tenant, "output")] += output

    async def flush(self) -> None:
        """Add what this LB spent since the last flush to the shared window and ledger."""
        pending, self.pending = self.pending, defaultdict(float)
        ledger, self.ledger = self.ledger, defaultdict(float)
        ttl = self.cfg.window_s + 2 * self.cfg.bucket_s
        try:
            for (tenant, bucket), tokens in pending.items():
                await self.store.add(window_key(tenant, bucket), tokens, ttl_s=ttl)
                pending[(tenant, bucket)] = 0.0
            for (tenant, kind), tokens in ledger.items():
                await self.store.add(ledger_key(tenant, kind), tokens, ttl_s=self.cfg.ledger_ttl_s)
                ledger[(tenant, kind)] = 0.0
        finally:  # what did not reach the store is tried again next round
            for k, v in pending.items():
                if v:
                    self.pending[k] += v
            for k, v in ledger.items():
                if v:
                    self.ledger[k] += v

    async def ledger_totals(self, tenants) -> dict[str, dict[str, float]]:
        """The shared spend ledger for `tenants`: {tenant: {prompt, output}}."""
        keys = {ledger_key(t, k): (t, k) for t in tenants for k in ("prompt", "output")}
        got = await self.store.get_many(keys)
        out: dict[str, dict[str, float]] = {}
        for key, (t, k) in keys.items():
            out.setdefault(t, {"prompt": 0.0, "output": 0.0})[k] = got.get(key, 0.0) + self.ledger.get((t, k), 0.0)
        return out
