"""Per-request records and their aggregation into the run JSON (docs/bench.md, run JSON).

Shared by the live client, the scenarios and the simulator, so a number means the same thing
wherever it was measured. Pure Python: no numpy on the client's path.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

QUANTILE_POINTS = 21  # ttft_quantiles_s: every 5th percentile, enough to draw a CDF
# The first fifth of a run fills an empty fleet: clients start in step, caches are cold and a
# router that learns rates online is still learning. `steady` leaves it out, as the
# simulator's `sim-compare` does (bench/sim/compare.py), so live and simulated figures
# measure the same thing. Seen 2026-11-27: live 30-ToT-client runs of 20 s put lb's cached
# ratio at 0.83-0.85 against 0.87-0.90 from the second fifth of a 60 s run on.
WARM_SHARE = 0.2


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; `start` is relative to the run's start."""

    request_id: str
    start: float
    ok: bool = False
    error: str | None = None  # error kind: http_<status>, connect, deadline, stream_error, incomplete
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # inter-token (inter-chunk) times
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    tenant: str | None = None
    tier: str | None = None
    interaction_id: str | None = None
    final: bool | None = None


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 1]."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def latency_summary(values: Iterable[float]) -> dict[str, float | None]:
    """`{p50, p90, p99, mean}`; None for each when there is no sample."""
    xs = sorted(values)
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {"p50": quantile(xs, 0.5), "p90": quantile(xs, 0.9), "p99": quantile(xs, 0.99),
            "mean": sum(xs) / len(xs)}


def quantile_curve(values: Iterable[float], points: int = QUANTILE_POINTS) -> list[float]:
    xs = sorted(values)
    return [quantile(xs, i / (points - 1)) for i in range(points)] if xs else []


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """The aggregate every report shares: counts, throughput, latency, cache ratio."""
    ok = [r for r in records if r.ok]
    kinds = Counter(r.error for r in records if not r.ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    per = duration_s if duration_s > 0 else math.nan
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "errors_by_kind": dict(sorted(kinds.items(), key=lambda kv: str(kv[0]))),
        "duration_s": duration_s,
        "throughput_rps": len(ok) / per if ok else 0.0,
        "output_tokens_per_s": output / per if ok else 0.0,
        "ttft_s": latency_summary(r.ttft for r in ok if r.ttft is not None),
        "e2e_s": latency_summary(r.e2e for r in ok if r.e2e is not None),
        "itl_s": latency_summary(x for r in ok for x in r.itl),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "cached_token_ratio": cached / prompt if prompt else 0.0,
    }


# A tenant's p90 needs this many requests after the warm-up to mean anything
MIN_TENANT_REQUESTS = 20


def tenant_p90s(by_tenant: dict[str, list[float]]) -> list[float]:
    """Each tenant's TTFT p90 (its waits as given: the simulator and the live runs both count a
    request still without a first token at its wait so far), for the tenants that sent
    MIN_TENANT_REQUESTS or more; empty unless two or more did. A p90 over all requests is the
    heaviest tenant's when it sends most of them (bursty tenants at 1.3x: one of eight sends
    55 %); the median tenant's p90 says what the others got, the worst what the heaviest paid
    for it: `lb`'s fair queue is meant to move the wait onto the tenant over its share, and
    the two together show whether it does."""
    p90s = [quantile(sorted(ts), 0.9) for ts in by_tenant.values() if len(ts) >= MIN_TENANT_REQUESTS]
    return p90s if len(p90s) >= 2 else []


def tenant_waits(records: Sequence[RequestRecord], since: float, end: float) -> dict[str, list[float]]:
    """Per tenant (`group_by`: a request that names none belongs to no tenant), the TTFT of each
    request sent at `since` or later, one that never got a first token (cut at the deadline,
    failed) counted at its wait until `end` (a lower bound): the simulator's
    `Arena.waited_by_user` on a live run's records."""
    return {tenant: [r.ttft if r.ttft is not None else max(0.0, end - r.start) for r in rs if r.start >= since]
            for tenant, rs in group_by(records, "tenant").items()}


def tenant_summary(by_tenant: dict[str, list[float]]) -> dict:
    p90s = tenant_p90s(by_tenant)
    return {"p90_median_s": quantile(sorted(p90s), 0.5) if p90s else None,
            "p90_worst_s": max(p90s) if p90s else None, "tenants": len(p90s)}


def programs_finished_rps(finished: Sequence[tuple[float, float]], since: float, end: float) -> float | None:
    """Programs (trees, conversations, agent sessions) started at `since` or later that ran whole
    by `end`, per second of that window: the simulator's `programs_rps` and a live run's
    `programs.finished_rps`. Past capacity a system can answer many calls and finish few
    programs, and a program's user has nothing until it ends."""
    if end <= since:
        return None
    return sum(since <= a and b <= end for a, b in finished) / (end - since)


def steady_summary(records: Sequence[RequestRecord], duration_s: float, warm_share: float = WARM_SHARE) -> dict:
    """The run after its first `warm_share`: throughput counts the answers that ended inside
    [warm, duration], latencies and the cached ratio the requests sent after the warm-up that
    ended by then (the simulator's definitions)."""
    warm = duration_s * warm_share
    ok = [r for r in records if r.ok and r.e2e is not None]
    ended = sum(1 for r in ok if warm <= r.start + r.e2e <= duration_s)
    sent = [r for r in ok if r.start >= warm and r.start + r.e2e <= duration_s]
    prompt = sum(r.prompt_tokens for r in sent)
    per = duration_s - warm
    return {
        "from_s": warm,
        "throughput_rps": ended / per if per > 0 else 0.0,
        "ttft_s": latency_summary(r.ttft for r in sent if r.ttft is not None),
        "e2e_s": latency_summary(r.e2e for r in sent),
        "cached_token_ratio": sum(r.cached_tokens for r in sent) / prompt if prompt else 0.0,
    }


def group_by(records: Iterable[RequestRecord], key: str) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        value = getattr(r, key)
        if value is not None:
            groups[str(value)].append(r)
    return dict(sorted(groups.items()))


def run_report(records: Sequence[RequestRecord], duration_s: float, issuing_s: float | None = None,
               **context) -> dict:
    """The full run JSON: `context` (target, workload, ...) + the aggregate + per tenant/tier,
    and `steady`, the run from the end of its warm-up to `issuing_s` (when the clients stopped
    sending: the drain after it is no steady state) or its end."""
    report = {**context, **summarize(records, duration_s)}
    report["steady"] = steady_summary(records, min(issuing_s or duration_s, duration_s))
    report["ttft_quantiles_s"] = quantile_curve(r.ttft for r in records if r.ok and r.ttft is not None)
    report["per_tenant"] = {k: summarize(v, duration_s) for k, v in group_by(records, "tenant").items()}
    # each tenant's p90 over the requests sent after the warm-up, the unanswered at their wait
    report["tenants"] = tenant_summary(tenant_waits(records, report["steady"]["from_s"], duration_s))
    report["per_tier"] = {k: summarize(v, duration_s) for k, v in group_by(records, "tier").items()}
    return report
