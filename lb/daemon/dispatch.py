"""The LB queue's asyncio side: wake on events, ask the scheduler, resolve futures.

Every placement decision is `lb.core.scheduler.Scheduler`'s (the simulator runs the same
one in virtual time). This module only turns events into scheduler passes — an arrival, a
probe result, a completion, a replica added or removed; never a timer — and placements
into answers: a future resolved with the replica (or peer) the request goes to, or an
`LBError` for a rejected one.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Callable

from lb.core.scheduler import QUEUE_FULL, SHUTTING_DOWN, Kind, Placement, Scheduler, SchedulerConfig
from lb.core.types import Decision, Policy, QueueEntry, ReplicaView, RequestFacts
from lb.daemon.config import Config
from lb.daemon.errors import LBError
from lb.daemon.fairness import Fairness
from lb.daemon.registry import Registry, Replica


# The explanation of a route that skips the queue (lb.core.routes DIRECT), for the access log.
DIRECT_CHOICE = Decision(None, "direct")


def scheduler_config(cfg: Config) -> SchedulerConfig:
    p = cfg.pushing
    return SchedulerConfig(pushing=p.mode, max_outstanding=p.max_outstanding, push_credit=p.push_credit,
                           max_unseen=p.max_unseen, lease_s=p.lease_s, affinity=cfg.affinity,
                           max_queue=cfg.queue.max_len)


class Dispatcher:
    def __init__(self, registry: Registry, cfg: Config, policy: Policy, metrics=None):
        self.registry = registry
        self._cfg = cfg
        self.policy = policy
        self.metrics = metrics
        self.fairness = Fairness(cfg)
        self.scheduler = Scheduler(scheduler_config(cfg), policy, self.fairness.make_queue())
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Capacity hooks (lb/daemon/capacity.py), off the decision itself:
        # on_dispatch(facts, replica, queue wait s, now), on_progress(request id, tokens so far, now),
        # on_complete(facts, replica, proxy Outcome, now) after each attempt — the latter two called by the proxy,
        # on_progress after a stream's first event and then every proxy.PROGRESS_EVERY events, not per chunk.
        self.on_dispatch: list[Callable] = []
        self.on_progress: list[Callable] = []
        self.on_complete: list[Callable] = []
        self.on_complete.append(self._served)  # the policy learns each replica's rates from its answers
        # the scheduler's TTFT prediction (lb.core.backlog): a stream's first event ends its prefill
        self.on_progress.append(lambda rid, events, now: self.scheduler.first_token(rid, now))
        # Cross-region peering (lb/daemon/peer_links.py): offered what no local replica can take.
        self.overflow = None
        registry.on_change(self.wake)
        registry.wants_probe = self.scheduler.wants_probe
        registry.answering = self.scheduler.answering
        registry.wants_first_tokens = self.scheduler.wants_first_tokens
        registry.on_add(lambda rep: self.scheduler.register(rep.id))
        registry.on_gone(lambda rep: self.scheduler.forget(rep.id))

    def _served(self, facts, rep, out, now: float) -> None:
        """Feed the policy what the replica took, timed from the push (the proxy times from
        arrival: take the LB queue wait off)."""
        self.scheduler.ended(facts.request_id)
        if out.status == 200 and out.e2e_s is not None:  # TTFT None: answered whole, not streamed
            wait = out.queue_wait_s or 0.0
            self.scheduler.served(facts, rep.id, None if out.ttft_s is None else out.ttft_s - wait, out.e2e_s - wait,
                                  out.answer_tokens(), now, prompt_tokens=out.usage.get("prompt_tokens"))

    @property
    def queue(self):
        return self.scheduler.queue

    def available(self, view: ReplicaView) -> bool:
        """May `view` take a push now, its leases as of now (the gate, the peer advert and
        /metrics ask between scheduling passes)."""
        self.scheduler.refresh_leases((view,), time.monotonic())
        return self.scheduler.available(view)

    def leased(self, view: ReplicaView) -> int:
        """KV tokens leased on the replica now (lb.core.leases)."""
        self.scheduler.refresh_leases((view,), time.monotonic())
        return view.leased_tokens

    @property
    def cfg(self) -> Config:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: Config) -> None:
        """A reload (SIGHUP) changed [pushing] or [queue]: the next pass decides on the new values."""
        self._cfg = cfg
        self.scheduler.reconfigure(scheduler_config(cfg))

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dispatch")

    async def close(self) -> None:
        """Fail whatever still waits: every accepted request ends with an answer."""
        for placement in self.scheduler.close():
            fut = placement.entry.payload
            if not fut.done():
                fut.set_exception(self._error(placement))
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.fairness.close()

    def wake(self) -> None:
        """A replica changed (an answer, a probe, added, removed): a pass may place what waits.
        Nothing waiting, nothing to place: no pass (an arrival runs its own, in `acquire`),
        which spares the loop a task switch and a pass per answer (profiled)."""
        if len(self.scheduler):
            self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self.dispatch_pass()

    # -- the request side ----------------------------------------------------------------------
    def ticket(self) -> tuple[float, int]:
        """A request's place in the queue, taken once when it arrives: pass it to every
        `acquire` of that request, so a retry after a replica failure keeps its place."""
        return time.monotonic(), next(self._seq)

    async def acquire(self, facts: RequestFacts, accepts: Callable[[ReplicaView], bool] | None = None,
                      exclude: frozenset[str] = frozenset(),
                      ticket: tuple[float, int] | None = None) -> tuple[Replica, float, Decision]:
        """Wait in the LB queue until a replica is chosen; returns it, the queue wait and
        why it was chosen (the placement's explanation, for the access log).

        The caller must `registry.completed(replica)` when done with it.
        """
        now = time.monotonic()
        enqueued_at, seq = ticket or (now, next(self._seq))
        fut = asyncio.get_running_loop().create_future()
        entry = QueueEntry(facts=facts, enqueued_at=enqueued_at, seq=seq, payload=fut, accepts=accepts,
                           exclude=exclude)
        rejected = self.scheduler.admit(entry, now)
        if rejected is not None:
            raise self._error(rejected)
        self.dispatch_pass()  # the common case, a free replica, is placed without a loop turn
        if fut.done():  # ...and returned without one (wait_for would add a turn)
            rep, why = fut.result()
            return rep, time.monotonic() - now, why
        try:
            rep, why = await asyncio.wait_for(asyncio.shield(fut), self.cfg.queue.timeout_s)
        except (asyncio.CancelledError, TimeoutError) as e:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.registry.completed(fut.result()[0], facts)  # placed in the same instant; give it back
            else:
                self.scheduler.withdraw(entry)
                fut.cancel()
            self._gauge()
            if isinstance(e, TimeoutError):
                raise LBError(503, f"no replica could take the request within {self.cfg.queue.timeout_s:g}s",
                              code="queue_timeout", retry_after=self.cfg.queue.retry_after_s) from None
            raise
        return rep, time.monotonic() - now, why

    def _error(self, placement: Placement) -> LBError:
        """A rejected placement as the client's answer: the one place its reason gets a status."""
        if placement.reason == QUEUE_FULL:
            return LBError(429, f"the LB queue is full ({self.cfg.queue.max_len} waiting); retry later",
                           code="queue_full", retry_after=self.cfg.queue.retry_after_s)
        assert placement.reason == SHUTTING_DOWN, placement.reason
        return LBError(503, "the load balancer is shutting down", code="shutting_down", retry_after=1)

    # -- placements ----------------------------------------------------------------------------
    def dispatch_pass(self) -> None:
        now = time.monotonic()
        peers = self.overflow.peer_set if self.overflow is not None else None
        if peers is not None and not peers.targets:  # no [[peers]]: skip the forward checks (profiled)
            peers = None
        for p in self.scheduler.schedule(now, self.registry.active(), peers):
            if p.kind is Kind.HOLD:
                if p.residency_blocked:
                    self.overflow.residency_refused(p.entry.facts, p.residency_blocked)
                continue
            rep: Replica = p.target
            if self.scheduler.wants_probe(rep.view):  # whether it admitted it or queued it, soon
                rep.reprobe.set()
            facts = p.entry.facts
            self.fairness.dispatched(facts, now)
            if p.kind is Kind.REPLICA:
                self._record(p)
                for fn in self.on_dispatch:
                    fn(facts, rep, p.waited, now)
            elif self.metrics is not None:  # a forward: why it left (peer, peer-faster, peer-lighter, peer-prefix)
                self.metrics.decisions.labels(self.policy.name, p.target_id, p.reason).inc()
            fut: asyncio.Future = p.entry.payload
            if fut.done():  # its client left in the same instant: give the slot back
                self.registry.completed(rep, facts)
            else:
                fut.set_result((rep, Decision(p.target_id, p.reason, p.matched_blocks, p.total_blocks, p.best_blocks)))
        self._gauge()

    def _record(self, p: Placement) -> None:
        if self.metrics is None:
            return
        m = self.metrics
        m.queue_wait.observe(p.waited)
        m.child(m.decisions, self.policy.name, p.target_id, p.reason).inc()
        if p.total_blocks:
            self.metrics.prefix_match.observe(p.matched_blocks)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_length.set(len(self.scheduler))
