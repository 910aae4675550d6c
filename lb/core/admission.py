"""Token-aware, SLO-feasible admission: judge at arrival whether a request can meet its
tier's TTFT/E2E targets, and if not, what to do instead — before it waits in vain.

wait  = tokens queued ahead / effective service rate (tokens/s the region completes)
TTFT  = wait + prompt tokens / prefill rate
E2E   = TTFT + output tokens / per-request decode rate, output = max_tokens or a learned estimate

Preference: admit → degrade (fewer `max_tokens`, or the next looser tier) → redirect to a
peer region that can meet the tier → reject early with Retry-After and the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from .tiers import TIER_RANK, TierConfig
from .types import RequestFacts, Tier



@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = False
    prefill_tps: float = 8000.0  # prompt tokens/s one request is prefilled at
    decode_tps: float = 30.0  # output tokens/s of one request (1 / TPOT)
    default_output_tokens: int = 256  # when neither max_tokens nor a learned estimate exists
    min_degraded_tokens: int = 32  # never degrade below this many output tokens
    max_retry_after_s: int = 60
    service_tps: float = 2000.0  # seed of the region's service rate until one is learned

    @classmethod
    def from_dict(cls, d: dict, path: str = "admission") -> "AdmissionConfig":
        d = dict(d)
        out = {}
        for name, default in (("prefill_tps", 8000.0), ("decode_tps", 30.0), ("service_tps", 2000.0)):
            v = d.pop(name, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{path}.{name}: must be a positive number, got {v!r}")
            out[name] = float(v)
        for name, default in (("default_output_tokens", 256), ("min_degraded_tokens", 32), ("max_retry_after_s", 60)):
            v = d.pop(name, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{path}.{name}: must be an integer ≥ 1, got {v!r}")
            out[name] = v
        enabled = d.pop("enabled", False)
        if not isinstance(enabled, bool):
            raise ValueError(f"{path}.enabled: must be true or false, got {enabled!r}")
        if d:
            raise ValueError(f"{path}: unknown keys {sorted(d)}")
        return cls(enabled=enabled, **out)


@dataclass(frozen=True)
class RegionLoad:
    """A region's queue as admission sees it (the local one, or a peer's)."""

    tokens_ahead: float  # prompt + expected output tokens of the requests queued ahead
    service_tps: float  # tokens/s the region has recently been completing (0: no capacity)


@dataclass(frozen=True)
class Estimate:
    wait_s: float
    ttft_s: float
    e2e_s: float


def estimate(facts: RequestFacts, load: RegionLoad, output_tokens: float, cfg: AdmissionConfig) -> Estimate:
    if load.tokens_ahead <= 0:
        wait = 0.0
    elif load.service_tps <= 0:
        wait = math.inf
    else:
        wait = load.tokens_ahead / load.service_tps
    ttft = wait + facts.prompt_tokens / cfg.prefill_tps
    return Estimate(wait, ttft, ttft + output_tokens / cfg.decode_tps)


# Why a request is rejected: no replica can serve it at all, or none in time for any tier
# (the daemon answers the first 503, the second 429; lb/daemon/gate.py).
NO_CAPACITY = "no-capacity"
TTFT_INFEASIBLE = "ttft-infeasible"


@dataclass(frozen=True)
class Admission:
    action: str  # admit | degrade | redirect | reject
    reason: str
    tier: Tier
    estimate: Estimate
    max_tokens: int | None = None  # degrade: the lowered limit to forward
    target: str | None = None  # redirect: the peer id
    retry_after_s: int = 0  # reject: when a retry may fare better

    @property
    def degraded(self) -> str:
        """What a degrade changed, `max_tokens=N; reason=...; tier=...` (the daemon sends it
        back to the client as a header)."""
        parts = [f"reason={self.reason}", f"tier={self.tier.value}"]
        if self.max_tokens is not None:
            parts.insert(0, f"max_tokens={self.max_tokens}")
        return "; ".join(parts)


def judge(facts: RequestFacts, local: RegionLoad, cfg: AdmissionConfig, tiers: TierConfig, *,
          peers: Mapping[str, RegionLoad] | None = None, expected_output: float | None = None) -> Admission:
    output = facts.max_tokens if facts.max_tokens is not None else (expected_output or cfg.default_output_tokens)
    est = estimate(facts, local, output, cfg)
    if not cfg.enabled or facts.tier is Tier.NIW:  # NIW is deferred, not judged at arrival
        return Admission("admit", "not-judged", facts.tier, est)
    own = tiers.target(facts.tier)
    if est.ttft_s <= own.ttft_s and est.e2e_s <= own.e2e_s:
        return Admission("admit", "feasible", facts.tier, est)
    fewer = _degraded_tokens(est, own.e2e_s, cfg) if est.ttft_s <= own.ttft_s else None
    if fewer is not None:
        return Admission("degrade", "e2e-needs-fewer-tokens", facts.tier, est, max_tokens=fewer)
    feasible_peers = []
    for peer, load in (peers or {}).items():
        pe = estimate(facts, load, output, cfg)
        if pe.ttft_s <= own.ttft_s and pe.e2e_s <= own.e2e_s:
            feasible_peers.append((pe.ttft_s, peer, pe))
    if feasible_peers:
        _, peer, pe = min(feasible_peers)
        return Admission("redirect", "peer-feasible", facts.tier, pe, target=peer)
    for tier in sorted(tiers.targets, key=TIER_RANK.get):
        if TIER_RANK[tier] <= TIER_RANK[facts.tier] or tier is Tier.NIW:
            continue
        looser = tiers.target(tier)
        if est.ttft_s <= looser.ttft_s:
            if est.e2e_s <= looser.e2e_s:
                return Admission("degrade", "tier-relaxed", tier, est)
            fewer = _degraded_tokens(est, looser.e2e_s, cfg)
            if fewer is not None:
                return Admission("degrade", "tier-relaxed", tier, est, max_tokens=fewer)
    if math.isinf(est.wait_s):
        return Admission("reject", NO_CAPACITY, facts.tier, est, retry_after_s=cfg.max_retry_after_s)
    loosest = max((tiers.target(t).ttft_s for t in tiers.targets if t is not Tier.NIW), default=own.ttft_s)
    retry = min(cfg.max_retry_after_s, max(1, math.ceil(est.ttft_s - loosest)))
    return Admission("reject", TTFT_INFEASIBLE, facts.tier, est, retry_after_s=retry)


def _degraded_tokens(est: Estimate, e2e_target: float, cfg: AdmissionConfig) -> int | None:
    if not est.ttft_s < e2e_target:  # also when the TTFT is infinite
        return None
    budget = int((e2e_target - est.ttft_s) * cfg.decode_tps)
    return budget if budget >= cfg.min_degraded_tokens else None


class ServiceRate:
    """The region's effective service rate: tokens (prompt + output) completed per second,
    an EWMA over intervals of at least `interval_s` in which the region was *busy* (work
    waiting in the LB queue or no replica free). An idle region completes only what it is
    given, which says nothing about what it could do, so idle intervals teach nothing."""

    def __init__(self, seed_tps: float, alpha: float = 0.3, interval_s: float = 1.0):
        self.rate = seed_tps
        self.alpha = alpha
        self.interval_s = interval_s
        self._tokens = 0.0
        self._since: float | None = None
        self._busy = False

    def completed(self, tokens: float) -> None:
        self._tokens += tokens

    def tick(self, now: float, busy: bool) -> None:
        """Called on every probe round; closes an interval once it is long enough."""
        if self._since is None:
            self._since, self._tokens = now, 0.0
        self._busy = self._busy or busy
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return
        if self._busy and self._tokens > 0:
            self.rate += self.alpha * (self._tokens / elapsed - self.rate)
        self._since, self._tokens, self._busy = now, 0.0, busy


class QueuedWork:
    """`tokens_of` summed over a queue, kept as entries come and go, so admission reads the
    work ahead in O(kinds of call) instead of walking up to `queue.max_len` entries for
    every arrival: exact token counts (prompt, and `max_tokens` where given) plus, per
    (app, stage), how many calls wait whose output is the learned estimate, which is read
    when asked (it moves)."""

    def __init__(self) -> None:
        self.known = 0  # prompt tokens, and max_tokens where a call gives them
        self.estimated: dict[tuple, int] = {}  # (app, stage) → answers waiting without max_tokens

    def add(self, facts: RequestFacts, sign: int = 1) -> None:
        self.known += sign * (facts.prompt_tokens + (facts.max_tokens or 0) * facts.samples)
        if facts.max_tokens is None:  # each parallel sample one estimated answer
            key = (facts.app, facts.interaction_stage or 0)
            n = self.estimated.get(key, 0) + sign * facts.samples
            if n:
                self.estimated[key] = n
            else:
                self.estimated.pop(key, None)

    def tokens(self, estimate: Callable[[str | None, int], float]) -> float:
        """The work waiting; `estimate(app, stage)`: the expected output of such a call."""
        return self.known + sum(n * estimate(app, stage) for (app, stage), n in self.estimated.items())


def tokens_of(facts: RequestFacts, expected_output: float) -> float:
    """Work one queued request stands for: its prompt plus the output it will likely produce
    (each of its parallel samples an answer)."""
    output = facts.max_tokens if facts.max_tokens is not None else expected_output
    return facts.prompt_tokens + output * facts.samples
