"""How late the event loop runs a timer, as `lb_event_loop_lag_seconds`.

Every request in flight waits through whatever holds the loop: a garbage-collector pass
(lb.daemon.gctune), a slow callback, a burst of work that saturates the core. A timer that
wakes every INTERVAL_S and records how much later than due it ran shows those stalls to an
operator directly, where request latencies mix them with the engines' time. 20 wake-ups a
second cost next to nothing. uvloop's timers have millisecond resolution, so lags under
~1 ms are the clock, not a stall.
"""
from __future__ import annotations

import asyncio
import time

INTERVAL_S = 0.05


async def watch(lag, interval_s: float = INTERVAL_S) -> None:
    """Run until cancelled; `lag`: a histogram (or anything with `observe(seconds)`)."""
    while True:
        due = time.monotonic() + interval_s
        await asyncio.sleep(interval_s)
        lag.observe(max(0.0, time.monotonic() - due))
