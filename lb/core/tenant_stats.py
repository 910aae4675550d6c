"""Per-tenant figures for `/metrics` with a bounded label set: service (tokens served),
throttles and queue wait, the `top_k` tenants by *recent* service under their own label and
every other tenant in one `other` bucket.

Why this shape: tenant names come from clients, so one label per tenant would let a client
grow the scrape without bound. Which tenants matter moves over time, so the labelled set is
re-ranked (at each scrape) by service decayed with a half-life. A tenant that drops out of
the top folds its totals into `other` and its series leaves; one that enters starts its own
series at zero (what it did before stays in `other`). So at every scrape the labels' sum is
the whole LB's total, and every series only grows (Prometheus counters stay counters).

The ranking itself remembers at most `max_tracked` tenants (the least recently served half
is forgotten when full), so memory is bounded whatever the number of distinct tenants.
Pure: the clock is passed in.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable

OTHER = "other"  # every tenant outside the top K
NONE = "none"  # requests that named no tenant
RESERVED = frozenset((OTHER, NONE))  # a tenant literally named so is counted in `other`


@dataclass
class TenantTotals:
    service_tokens: int = 0
    throttled: int = 0
    wait_counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), last is +Inf
    wait_sum: float = 0.0

    def add(self, other: "TenantTotals") -> None:
        self.service_tokens += other.service_tokens
        self.throttled += other.throttled
        self.wait_sum += other.wait_sum
        for i, n in enumerate(other.wait_counts):
            self.wait_counts[i] += n

    def cumulative(self) -> list[int]:
        """Bucket counts as Prometheus wants them: each includes all smaller buckets."""
        out, running = [], 0
        for n in self.wait_counts:
            running += n
            out.append(running)
        return out


class TenantStats:
    def __init__(self, top_k: int = 20, half_life_s: float = 300.0, wait_bounds: Iterable[float] = (1.0,),
                 max_tracked: int | None = None):
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.top_k = top_k
        self.half_life_s = half_life_s
        self.wait_bounds = tuple(sorted(wait_bounds))
        self.max_tracked = max_tracked or max(64, 8 * top_k)
        self._recent: dict[str, tuple[float, float]] = {}  # tenant → (decayed service, as of)
        self._labelled: dict[str, TenantTotals] = {}
        self._other = self._new()

    # -- events ----------------------------------------------------------------------------
    def served(self, tenant: str | None, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        name = self._name(tenant)
        self._totals(name).service_tokens += tokens
        self._remember(name, tokens, now)

    def throttled(self, tenant: str | None) -> None:
        self._totals(self._name(tenant)).throttled += 1

    def waited(self, tenant: str | None, seconds: float) -> None:
        totals = self._totals(self._name(tenant))
        totals.wait_counts[bisect.bisect_left(self.wait_bounds, seconds)] += 1
        totals.wait_sum += seconds

    # -- the scrape ------------------------------------------------------------------------
    def snapshot(self, now: float) -> dict[str, TenantTotals]:
        """Re-rank, then every label's totals (the top tenants, then `other`)."""
        self.rerank(now)
        return {**self._labelled, OTHER: self._other}

    def rerank(self, now: float) -> None:
        top = set(self.ranking(now)[: self.top_k])
        for name in [n for n in self._labelled if n not in top]:
            self._other.add(self._labelled.pop(name))  # its history stays counted, under `other`
        for name in top:
            self._labelled.setdefault(name, self._new())

    def ranking(self, now: float) -> list[str]:
        """Tenants by recent service, most first (ties by name, so the order is stable)."""
        scores = {n: self._decayed(n, now) for n in self._recent}
        return sorted((n for n, s in scores.items() if s > 0), key=lambda n: (-scores[n], n))

    def recent_service(self, tenant: str | None, now: float) -> float:
        return self._decayed(self._name(tenant), now)

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _name(tenant: str | None) -> str:
        return NONE if tenant is None or tenant == "" else tenant

    def _new(self) -> TenantTotals:
        return TenantTotals(wait_counts=[0] * (len(self.wait_bounds) + 1))

    def _totals(self, name: str) -> TenantTotals:
        return self._labelled.get(name, self._other) if name != OTHER else self._other

    def _decayed(self, name: str, now: float) -> float:
        score, at = self._recent.get(name, (0.0, now))
        return score * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def _remember(self, name: str, tokens: int, now: float) -> None:
        if name in RESERVED and name != NONE:
            return  # never ranked: always in `other`
        if name not in self._recent and len(self._recent) >= self.max_tracked:
            keep = self.ranking(now)[: self.max_tracked // 2]
            keep_set = set(keep) | set(self._labelled)
            self._recent = {n: v for n, v in self._recent.items() if n in keep_set}
        self._recent[name] = (self._decayed(name, now) + tokens, now)
