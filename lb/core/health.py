"""Probe-health hysteresis and the retry schedule: when a replica counts as up, when to retry.

Pure: the daemon feeds probe outcomes in; nothing here reads a clock or sleeps.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HealthTracker:
    """Consecutive failures mark a target unhealthy; consecutive successes bring it back.

    Hysteresis keeps one lost probe (a GC pause, a slow scrape) from flapping a replica out
    of rotation, and one lucky probe from putting a crashing replica back.
    """

    unhealthy_after: int = 3
    healthy_after: int = 2
    healthy: bool = True
    _fails: int = 0
    _oks: int = 0

    def record(self, ok: bool) -> bool:
        """Record one probe outcome; return the (possibly changed) health."""
        if ok:
            self._fails = 0
            self._oks += 1
            if not self.healthy and self._oks >= self.healthy_after:
                self.healthy = True
        else:
            self._oks = 0
            self._fails += 1
            if self.healthy and self._fails >= self.unhealthy_after:
                self.healthy = False
        return self.healthy

    @property
    def steady(self) -> bool:
        """Healthy, and its last probe answered: nothing about its health is in doubt."""
        return self.healthy and self._fails == 0

    def mark_down(self) -> None:
        """A hard failure on the request path (connection refused): out at once."""
        self.healthy = False
        self._oks = 0
        self._fails = max(self._fails, self.unhealthy_after)


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Delay before retry number `attempt` (1-based): exponential, capped."""
    if attempt <= 0:
        return 0.0
    return min(cap_s, base_s * (2 ** (attempt - 1)))


# Upstream statuses that mean "this replica cannot take it now", not "the request is bad":
# safe to retry on another replica while no byte has reached the client.
RETRYABLE_STATUSES = frozenset({502, 503, 504})
