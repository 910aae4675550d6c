"""Tenant token budgets: tokens per minute per tenant (the API key's tenant), and the spend
ledger's keys. Pure: the daemon reads bucket totals from the shared store and asks `verdict`.

Tokens are only known when a request ends (the usage the engine reports), so the window is
kept as counters in `bucket_s`-long buckets, keyed by wall-clock bucket number so every LB
sharing the store adds into the same ones. The last minute is the current bucket, the
`window_s / bucket_s - 1` before it, and the part of the oldest one still inside the window
(weighted by that fraction: a sliding window from fixed counters). A request is admitted
while the tenant's window is below its limit; the one that crosses it is served in full and
later ones get 429 until enough buckets have left the window (`retry_after_s`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_TENANT = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


@dataclass(frozen=True)
class BudgetConfig:
    """The `[budgets]` section."""

    tokens_per_minute: int = 0  # every tenant's limit (prompt + output tokens per window_s); 0: none
    overrides: dict = field(default_factory=dict)  # tenant -> its own tokens per minute (0: unlimited)
    window_s: float = 60.0
    bucket_s: float = 5.0  # granularity of the shared window counters (window_s must be a multiple)
    ledger_ttl_s: float = 90 * 86400.0  # a tenant's spend totals live this long after its last request

    @classmethod
    def from_dict(cls, d: dict, path: str = "budgets") -> "BudgetConfig":
        d = dict(d)
        cfg = cls(**{k: float(v) if isinstance(getattr(cls, k, None), float) and isinstance(v, int) else v
                     for k, v in d.items()})
        cfg.check(path)
        return cfg

    def check(self, path: str = "budgets") -> None:
        if self.tokens_per_minute < 0:
            raise ValueError(f"{path}.tokens_per_minute: must be >= 0 (0: no limit), got {self.tokens_per_minute}")
        for tenant, limit in self.overrides.items():
            if not _TENANT.match(str(tenant)):
                raise ValueError(f"{path}.overrides: tenant {tenant!r} must match {_TENANT.pattern}")
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"{path}.overrides.{tenant}: expected tokens per minute, an integer >= 0, got {limit!r}")
        for key in ("window_s", "bucket_s", "ledger_ttl_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{path}.{key}: must be > 0, got {getattr(self, key)}")
        n = self.window_s / self.bucket_s
        if abs(n - round(n)) > 1e-9 or round(n) > 120:
            raise ValueError(f"{path}.bucket_s: window_s ({self.window_s}) must be a whole multiple of it, at most "
                             f"120 buckets; e.g. bucket_s = {self.window_s / 12:g}")

    @property
    def enabled(self) -> bool:
        return self.tokens_per_minute > 0 or any(self.overrides.values())


def limit_for(cfg: BudgetConfig, tenant: str | None) -> int | None:
    """The tenant's tokens per window, or None: no budget (no tenant, or 0)."""
    if tenant is None:
        return None
    limit = cfg.overrides.get(tenant, cfg.tokens_per_minute)
    return limit or None


def window_key(tenant: str, bucket: int) -> str:
    return f"tpm:{tenant}:{bucket}"


def ledger_key(tenant: str, kind: str) -> str:
    """The spend ledger: `kind` is prompt or output; totals since the ledger's TTL began."""
    return f"spend:{tenant}:{kind}"


def current_bucket(cfg: BudgetConfig, now_wall: float) -> int:
    return math.floor(now_wall / cfg.bucket_s)


def window_buckets(cfg: BudgetConfig, now_wall: float) -> list[tuple[int, float]]:
    """The buckets the window covers, oldest first, with the fraction of each inside it."""
    n = round(cfg.window_s / cfg.bucket_s)
    cur = current_bucket(cfg, now_wall)
    into = now_wall / cfg.bucket_s - cur  # how far into the current bucket we are
    return [(cur - n, 1.0 - into)] + [(cur - n + i, 1.0) for i in range(1, n + 1)]


@dataclass(frozen=True)
class BudgetVerdict:
    allowed: bool
    limit: int
    used: float
    retry_after_s: float  # 0 when allowed

    @property
    def remaining(self) -> int:
        return max(0, int(self.limit - self.used))


def verdict(cfg: BudgetConfig, limit: int, totals: dict[int, float], now_wall: float) -> BudgetVerdict:
    """`totals`: tokens per bucket number (missing: 0). Over budget: how long until enough
    old buckets have left the window for it to fall below the limit."""
    buckets = window_buckets(cfg, now_wall)
    used = sum(totals.get(b, 0.0) * w for b, w in buckets)
    if used < limit:
        return BudgetVerdict(True, limit, used, 0.0)
    left, wait = used, 0.0
    for b, w in buckets:  # oldest first: each leaves the window when its bucket end passes it
        left -= totals.get(b, 0.0) * w
        wait = (b + 1) * cfg.bucket_s + cfg.window_s - now_wall
        if left < limit:
            break
    return BudgetVerdict(False, limit, used, max(cfg.bucket_s, min(cfg.window_s + cfg.bucket_s, wait)))
