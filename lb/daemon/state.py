"""Shared state for several LB processes per region: sliding-window rate counters and
service counters, behind one async interface.

`MemoryStore` (default) keeps them in this process. `RedisStore` keeps them in Redis so
several LBs behind one name enforce one limit and see one service history: each update is
one Lua script, atomic on the server, and every key carries a TTL so abandoned tenants do
not accumulate. `now` is passed in by the caller; LBs sharing a store must pass wall-clock
time (`time.time()`), which is what the daemon does.
"""
from __future__ import annotations

import math
import uuid
from collections import deque
from typing import Iterable, Protocol

from lb.core.fairness import HitResult


class StateStore(Protocol):
    async def hit(self, key: str, now: float, window_s: float, limit: int) -> HitResult:
        """Record one request in `key`'s sliding window if it has room (atomically)."""

    async def add(self, key: str, amount: float, ttl_s: float | None = None) -> float:
        """Add to a counter; returns its new total. `ttl_s`: it expires that long after its last
        add (default: the store's counter TTL; the memory store keeps counters for its life)."""

    async def get_many(self, keys: Iterable[str]) -> dict[str, float]:
        """Totals of the counters that exist (missing keys are left out)."""

    async def close(self) -> None: ...


def _reset_after(oldest: float, now: float, window_s: float) -> float:
    """Seconds until the oldest request leaves the window (a slot frees)."""
    return max(0.0, oldest + window_s - now)


class MemoryStore:
    """In-process store. Windows prune themselves on every hit, and idle windows are swept
    when `max_keys` is reached; counters (one per tenant) live as long as the process."""

    def __init__(self, max_keys: int = 100_000):
        self.max_keys = max_keys
        self._windows: dict[str, deque[float]] = {}
        self._counters: dict[str, float] = {}

    async def hit(self, key: str, now: float, window_s: float, limit: int) -> HitResult:
        times = self._windows.get(key)
        if times is None:
            if len(self._windows) >= self.max_keys:
                self._sweep(now, window_s)
            times = self._windows[key] = deque()
        while times and times[0] <= now - window_s:
            times.popleft()
        allowed = len(times) < limit
        if allowed:
            times.append(now)
        reset = _reset_after(times[0], now, window_s) if times else 0.0
        return HitResult(allowed, len(times), reset)

    async def add(self, key: str, amount: float, ttl_s: float | None = None) -> float:
        if len(self._counters) >= self.max_keys and key not in self._counters:
            self._counters.pop(next(iter(self._counters)))  # bounded: the oldest counter goes
        total = self._counters[key] = self._counters.get(key, 0.0) + amount
        return total

    async def get_many(self, keys: Iterable[str]) -> dict[str, float]:
        return {k: self._counters[k] for k in keys if k in self._counters}

    async def close(self) -> None:
        pass

    def _sweep(self, now: float, window_s: float) -> None:
        for k in [k for k, t in self._windows.items() if not t or t[-1] <= now - window_s]:
            del self._windows[k]


# KEYS[1] window zset; ARGV: now, window_s, limit, unique member, ttl_ms.
_HIT = """
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
local count = redis.call('ZCARD', key)
local allowed = 0
if count < limit then
  redis.call('ZADD', key, now, ARGV[4])
  count = count + 1
  allowed = 1
end
redis.call('PEXPIRE', key, ARGV[5])
local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
local first = now
if oldest[2] then first = tonumber(oldest[2]) end
return {allowed, count, tostring(first)}
"""

# KEYS[1] counter; ARGV: amount, ttl_ms.
_ADD = """
local total = redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return total
"""


class RedisStore:
    """Redis-backed store (redis.asyncio). Keys are `prefix + key`; windows expire one
    window after their last hit, counters `counter_ttl_s` after their last add."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", prefix: str = "lb:",
                 counter_ttl_s: float = 86400.0, client=None):
        import redis.asyncio as aioredis  # the `redis` extra: only needed when configured

        self.prefix = prefix
        self.counter_ttl_ms = int(counter_ttl_s * 1000)
        self._redis = client or aioredis.from_url(url, decode_responses=True)
        self._hit = self._redis.register_script(_HIT)
        self._add = self._redis.register_script(_ADD)

    async def hit(self, key: str, now: float, window_s: float, limit: int) -> HitResult:
        ttl_ms = max(1, math.ceil(window_s * 1000))
        allowed, count, oldest = await self._hit(
            keys=[self.prefix + key], args=[repr(now), repr(window_s), limit, uuid.uuid4().hex, ttl_ms])
        return HitResult(bool(allowed), int(count), _reset_after(float(oldest), now, window_s))

    async def add(self, key: str, amount: float, ttl_s: float | None = None) -> float:
        ttl_ms = self.counter_ttl_ms if ttl_s is None else max(1, math.ceil(ttl_s * 1000))
        return float(await self._add(keys=[self.prefix + key], args=[repr(float(amount)), ttl_ms]))

    async def get_many(self, keys: Iterable[str]) -> dict[str, float]:
        keys = list(keys)
        if not keys:
            return {}
        values = await self._redis.mget([self.prefix + k for k in keys])
        return {k: float(v) for k, v in zip(keys, values) if v is not None}

    async def close(self) -> None:
        await self._redis.aclose()


def make_store(cfg: dict | None) -> StateStore:
    """`[state] backend = "memory" | "redis"`, `url`, `prefix`, `counter_ttl_s`, `sync_interval_s`."""
    cfg = dict(cfg or {})
    backend = cfg.pop("backend", "memory")
    ttl = float(cfg.pop("counter_ttl_s", 86400.0))
    cfg.pop("sync_interval_s", None)  # how often service counters meet the store (lb.daemon.gate)
    cfg.pop("share_pushes", None)  # pushes told to the other instances (lb.daemon.instances)
    if backend == "memory":
        if cfg:
            raise ValueError(f"state: unknown keys for the memory backend {sorted(cfg)}")
        return MemoryStore()
    if backend == "redis":
        url = cfg.pop("url", "redis://127.0.0.1:6379/0")
        prefix = cfg.pop("prefix", "lb:")
        if cfg:
            raise ValueError(f"state: unknown keys {sorted(cfg)}")
        return RedisStore(url, prefix, ttl)
    raise ValueError(f"state.backend: {backend!r} is not memory or redis")
