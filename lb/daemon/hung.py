"""Hung requests, from evidence (lb.core.hung decides): the proxy registers each attempt on a
replica; every probe of that replica feeds its sample here, and an attempt the core calls
hung is ended the way a broken replica's would be: its response closed (or, while headers
are awaited, its deadline moved to now). The proxy then retries it elsewhere (non-streamed,
or before a stream's first byte) or ends the stream with an error event; the replica is
marked suspect and its circuit breaker hears of a failure.
"""
from __future__ import annotations

import asyncio
import logging
import time

from lb.core.hung import idle_since, is_hung

log = logging.getLogger("lb.hung")


class Attempt:
    """One request on one replica, as the watch sees it."""

    __slots__ = ("rep", "last_sign_at", "chunks", "seen_chunks", "resp", "deadline", "hung")

    def __init__(self, rep, now: float):
        self.rep, self.last_sign_at = rep, now
        self.chunks = self.seen_chunks = 0  # bytes arriving count as signs of life (read at probe time)
        self.resp = None  # the upstream response once its headers arrived
        self.deadline: asyncio.Timeout | None = None  # while the headers are awaited
        self.hung = False

    def end(self) -> None:
        self.hung = True
        if self.resp is not None:
            self.resp.close()  # the pending read fails as a broken connection would
        elif self.deadline is not None:
            self.deadline.reschedule(asyncio.get_running_loop().time())


class HungWatch:
    def __init__(self, cfg, registry, metrics):
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.attempts: dict[object, set[Attempt]] = {}  # by replica: only requests in flight
        self.idle: dict[object, float | None] = {}  # by replica: idle since (probe time)
        registry.on_gone(self._forget)

    def start(self, rep) -> Attempt:
        a = Attempt(rep, time.monotonic())
        self.attempts.setdefault(rep, set()).add(a)
        return a

    def finish(self, a: Attempt) -> None:
        held = self.attempts.get(a.rep)
        if held is not None:
            held.discard(a)
            if not held:
                del self.attempts[a.rep]

    def on_probe(self, rep, load, probed_at: float) -> None:
        """One good probe of `rep` (`load` None: the engine does not report its queue)."""
        busy = None if load is None or load.running is None else load.pending + load.running > 0
        idle = self.idle[rep] = idle_since(self.idle.get(rep), busy, probed_at)
        after_s = self.cfg.upstream.hung_after_s
        for a in list(self.attempts.get(rep, ())):
            if a.chunks != a.seen_chunks:
                a.seen_chunks, a.last_sign_at = a.chunks, probed_at
            if not a.hung and is_hung(a.last_sign_at, idle, probed_at, after_s):
                log.warning("replica %s suspect: a request outstanding %.1fs while its probes showed nothing "
                            "running or waiting for %.1fs; ending it there", rep.id,
                            probed_at - a.last_sign_at, probed_at - max(a.last_sign_at, idle))
                self.metrics.upstream_errors.labels(rep.id, "hung").inc()
                self.registry.outcome(rep, False, "hung")
                rep.suspect = True  # cleared by the next request it serves
                a.end()

    def _forget(self, rep) -> None:
        self.attempts.pop(rep, None)
        self.idle.pop(rep, None)
