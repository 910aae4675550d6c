"""Is a request hung? Decided from evidence, not only from a timer.

A replica that accepted a request and never answers looks, from the LB, like a slow one:
only its own load probes tell them apart. While the engine works on a request its probe
shows it running or waiting; an engine whose probes show nothing running and nothing
waiting for `after_s`, all the while one of our requests is outstanding on it, has lost or
wedged that request. Pure: the daemon feeds probe samples and times in.
"""
from __future__ import annotations


def idle_since(previous: float | None, busy: bool | None, probed_at: float) -> float | None:
    """Fold one probe sample into "idle since when": None while the replica shows work (or
    cannot tell: `busy` None, an engine without a running count), else the first idle probe's
    time of the current idle stretch."""
    if busy is None or busy:
        return None
    return previous if previous is not None else probed_at


def is_hung(last_sign_at: float, idle_from: float | None, last_probe_at: float, after_s: float) -> bool:
    """A request whose last sign of life (sent, or its latest byte back) was at `last_sign_at`
    is hung when every probe from then on (or from the start of the idle stretch, whichever
    is later) up to the latest one showed the replica idle, for at least `after_s`.
    `after_s` <= 0: never."""
    if after_s <= 0 or idle_from is None:
        return False
    return last_probe_at - max(last_sign_at, idle_from) >= after_s
