"""The scheduler: which queued request goes where, now. One for the daemon and the simulator.

`lb.daemon.dispatch` (real time, asyncio) and `bench.sim.model` (virtual time) both own one
`Scheduler` and call it on every event that can make a waiting request placeable (an
arrival, a probe result, a completion, a replica added or removed). Nothing here reads a
clock, sleeps or does I/O: `now` and the fleet are passed in, placements come out.

Entry points (the whole interface)::

    s = Scheduler(SchedulerConfig(...), policy, queue)      # queue: lb.core.queueing.make_queue
    s.admit(entry, now)      -> Placement | None            # None: queued; else a REJECT
    s.schedule(now, targets, peers=None) -> list[Placement] # one pass over the queue
    s.withdraw(entry)        -> bool                        # left without running (timeout, client gone)
    s.completed(facts, input_tokens, output_tokens)         # a placed request finished (WSC/VTC settle)
    s.first_token(request_id, now) / s.ended(request_id)    # its first token came back / it ended
    s.close()                -> list[Placement]             # REJECT every waiting entry
    s.register(id) / s.forget(id)                           # the fleet changed
    s.reconfigure(SchedulerConfig(...))                     # new limits (config reload)
    s.available(view), len(s), s.waiting(model), s.waiting_tokens(model)

`targets` are the local replicas, any objects with `.view` (`ReplicaView`) and `.breaker`
(`lb.core.breaker.Breaker` or None); `peers` (optional) is a `PeerSet` of peer LBs seen as
targets (`lb.core.peering`). A `Placement` says what to do with one entry — REPLICA (push
it to `target`), PEER (forward it to the peer LB `target`), HOLD (leave it queued, and why),
REJECT (answer it with the HTTP-free `reason`) — and carries its explanation: `reason` (the
policy's, from a small fixed set: safe as a metrics label) and the prefix match.

The scheduler applies the state changes a placement implies itself, so a caller only moves
bytes: the entry leaves the queue through `queue.dispatch` (WSC/VTC charge the tenant
there), the target's view counts the push (`lb.core.pushing.record_push`: outstanding,
unseen pushes and their KV tokens), the policy observes it, a peer's status counts the
forward. The caller still owns what is not a decision: resolving futures or starting the
simulated request, asking for an early re-probe, metrics, the interaction ledger.

One pass, in order (the filter chain first, then queue order, then the policy):
1. *Eligible now* (per target, once per pass): healthy, not draining, breaker not open,
   and the pushing mode says it takes one more (`lb.core.pushing.is_available`: SP-P's
   headroom includes the pushes the last probe has not seen).
2. Entries in queue order (`queue.walk`), reordered for cache affinity among the first
   `affinity.window` (`lb.core.affinity`). Per entry: targets that serve its model, that
   its `accepts` allows, not in its `exclude` (unless every healthy one is) — the
   candidates. None: SkyWalker Algorithm 1 offers it to an available peer LB
   (`lb.core.peering.local_or_peer`, never for a request that already crossed one LB), else it
   stays queued; an entry nothing can take never blocks the ones behind it.
   With peers and `forward = "predicted"`, an entry that has candidates goes to a peer when
   the TTFT predicted there plus the round trip beats the local prediction by a margin
   (`lb.core.peering.predicted_peer`; predictions from `lb.core.backlog`, which the
   scheduler keeps from its pushes and the first tokens its caller reports: `first_token`).
3. Its busy prefix holder may be worth a short wait (`AffinityScheduler.hold`): it is set
   aside, and settled once the pass has placed the rest (`_settle_held`): a replica still free
   when its line for the holder outlasts the prefill it would redo there
   (`AffinityScheduler.release`), else its holder's engine queue where that is open, else HOLD.
4. Else the policy chooses among the candidates (filters → scorers → picker,
   `lb.core.policies`), the entry is taken out and the push recorded. A target the push
   made unavailable leaves the pass's free set.

Policies implement `lb.core.types.Policy` (subclass `lb.core.policies.PolicyBase` for no-op
hooks): `choose`, `observe`, `register`, `forget`, `last` (a `Decision`) and `prefix_memory`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
import functools
import math
from enum import Enum
from typing import Iterable, Protocol, Sequence

from lb.core.adapters import Adapters
from lb.core.admission import QueuedWork
from lb.core.affinity import AffinityConfig, AffinityScheduler
from lb.core.backlog import Backlog
from lb.core.breaker import Breaker
from lb.core.continuations import declares, recognized_continuation
from lb.core.decoding import Decoding
from lb.core.leases import DEFAULT_LEASE_S, KvLeases
from lb.core.length_model import LengthModel
from lb.core.peering import (DEFAULT_TAU, LIGHTER_SHARE, PeerConfig, PeerDecision, PeerRouter, PeerStatus,
                             holder_peer, lighter_peer, local_or_peer, may_lighten, peer_available, predicted_peer)
from lb.core.policies import load
from lb.core.pushing import (DEFAULT_DECODE_RESERVE, DEFAULT_MAX_OUTSTANDING, DEFAULT_MAX_UNSEEN, DEFAULT_PUSH_CREDIT,
                             OVERCOMMIT_QUEUE, holder_queue_open, is_available, push_tokens, record_push)
from lb.core.prefix import BytesPerToken, prompt_bytes, request_chain, uncached_tokens
from lb.core.queueing import QueueOrderBase
from lb.core.types import Policy, Pushing, QueueEntry, ReplicaView, RequestFacts

# A probe answered this fast costs the engine too little to save (SGLang's /v1/loads and the
# emulator answer in 0.5-1 ms on loopback; vLLM's /metrics takes 6-17 ms).
CHEAP_PROBE_S = 0.003


class Kind(str, Enum):
    REPLICA = "replica"  # push to a local replica
    PEER = "peer"  # forward to a peer LB
    HOLD = "hold"  # stays queued, on purpose (waits for its prefix holder; a peer its tag forbids)
    REJECT = "reject"  # answer now with `reason`


# How many queued requests one pass may look up in the prefix memory for a replica that keeps its
# own queue (`_holder_queue`): with every replica's SP-P gate shut the pass no longer stops at the
# first request, and a queue of thousands must not cost thousands of prefix matches per probe.
HOLDER_QUEUE_TRIES = 64
# ...and how many it may pass over first without one, for want of any such replica within its
# rivals' bound that holds even the first block of their prompt (`_holder_queue_worth`: a dict
# lookup, where a match costs the open queues' checks and two lookups). Past capacity most
# requests the pass walks are such (their prefix's holders queue too much already): the 64
# lookups went on them, ~0.2 % finding a queue (document Q&A at 1.3x), and the requests further
# back whose holders had room waited here. Passing them over (1.3x capacity, 3 seeds, the
# simulator): document Q&A 5.41 -> 6.43 req/s on vLLM-like engines, 5.39 -> 6.50 on SGLang's,
# shared-prefix 4.06 -> 4.20 (its uncached prompts' tail longer), the rest of the suite the same;
# and the pass's CPU past capacity halved (docs/results.md, forty-sixth session).
HOLDER_QUEUE_GLANCES = 256

# Why a request is rejected (the daemon maps each to one HTTP answer: lb.daemon.dispatch.Dispatcher._error).
QUEUE_FULL = "queue_full"
SHUTTING_DOWN = "shutting_down"


@dataclass(frozen=True)
class SchedulerConfig:
    pushing: str = Pushing.SP_PENDING.value
    max_outstanding: int = DEFAULT_MAX_OUTSTANDING
    push_credit: int = DEFAULT_PUSH_CREDIT
    max_unseen: int = DEFAULT_MAX_UNSEEN
    decode_reserve: int = DEFAULT_DECODE_RESERVE  # KV a push is held to take beyond its prompt
    lease_s: float = DEFAULT_LEASE_S  # an interaction's context is kept out of SP-P's headroom this long between calls
    affinity: AffinityConfig = AffinityConfig()
    max_queue: int | None = None  # admit() rejects beyond this many waiting; None: unbounded

    def __post_init__(self) -> None:
        Pushing(self.pushing)  # fails naming the value


class Target(Protocol):
    view: ReplicaView
    breaker: Breaker | None


@dataclass(eq=False)
class PeerTarget:
    """One peer LB as a target: its `[[peers]]` entry, what its status said, the view our
    forwards count on, and the caller's handle for it (the daemon's proxy target)."""

    config: PeerConfig
    status: PeerStatus
    view: ReplicaView
    handle: object = None


class PeerSet:
    """The peer LBs the scheduler may forward to, and how (router, τ, staleness). `targets`
    is read only when some entry has no local candidate, so a caller may build it lazily."""

    def __init__(self, targets: Sequence[PeerTarget], router: PeerRouter, *, tau: int = DEFAULT_TAU,
                 stale_s: float = 0.3, forward: str = "predicted", margin_s: float = 0.0,
                 lighter_share: float = LIGHTER_SHARE):
        self.targets = targets
        self.router = router
        self.tau = tau  # a peer whose queue is longer takes no forward
        self.stale_s = stale_s  # a status older than this means unavailable
        self.predicted = forward == "predicted"  # also forward what a local replica would take, when a peer is faster
        self.margin_s = margin_s  # beyond the predictions' error
        self.lighter_share = lighter_share  # new work moves to a peer replica this much lighter (lighter_peer)

    def least_rtt_s(self) -> float | None:
        """The shortest measured round trip to any peer (None: none measured)."""
        return min((p.status.rtt_s for p in self.targets if p.status.rtt_s is not None), default=None)

    def fastest_possible_s(self, model: str, tokens: float, local_error: float) -> float | None:
        """A lower bound on what any peer could offer a request: round trip, plus predicted
        TTFT there, plus the two predictions' combined error (None: no peer measured). No
        forward can beat a local prediction below it, so the targets need not be read. Here
        the least round trip; a caller that builds its targets on demand (the simulator)
        bounds tighter without building them."""
        rtt = self.least_rtt_s()
        return None if rtt is None else rtt + local_error

    def open(self, now: float) -> bool:
        """Could any peer take a request now? (lets a full LB skip walking its queue)"""
        return any(p.view.healthy and peer_available(p.status, "", tau=self.tau, now=now, stale_s=self.stale_s)
                   for p in self.targets)


@dataclass(eq=False)
class Placement:
    entry: QueueEntry
    kind: Kind
    target: object = None  # REPLICA: the Target; PEER: the PeerTarget's handle
    target_id: str | None = None
    reason: str = ""  # REPLICA: the policy's reason; PEER: "peer"; HOLD/REJECT: why
    waited: float = 0.0
    matched_blocks: int = 0
    total_blocks: int = 0
    best_blocks: int = 0  # REPLICA: the longest prefix any candidate held (Decision.best_blocks)
    residency_blocked: tuple[str, ...] = ()  # available peers the request's residency tag ruled out


def _queued(view: ReplicaView) -> int:
    """Requests waiting in its engine as far as this LB knows: its last probe's and the pushes since."""
    return view.pending + view.pushed_since_probe


class _Pass:
    """The free targets of one pass, per model, found when an entry first asks for the
    model and shrinking as pushes fill them (a pass for one model looks at its replicas only).

    A pass asks the same questions of the same targets for every entry it walks, and past
    capacity it walks hundreds: each target's eligibility is read once (again only after a
    placement there), and the targets an entry could go to once per model. Both change within a
    pass only through its own placements, which `placed` is told of."""

    def __init__(self, scheduler: "Scheduler", targets: list, now: float):
        self.scheduler, self.targets, self.now = scheduler, targets, now
        self.by_model: dict[str, list] = {}
        self._eligible: dict[str, bool] = {}  # target id → eligible, as of its last placement this pass
        self._live: dict[str, set[str]] = {}  # model → the healthy targets serving it (`Scheduler._live`)
        self._loads: dict[str, dict[str, int]] = {}  # model → its live targets' engine queues, until a placement
        self.told = False  # the open engine queues' views told the prefill ahead, since the last placement
        self.all_keep: bool | None = None  # every open engine queue keeps one for any request (`_holder_queue`)
        self.tries, self.glances = HOLDER_QUEUE_TRIES, HOLDER_QUEUE_GLANCES  # (`Scheduler._join_holder`)
        self._ready: dict[str, set[str]] = {}  # model → open engine queues within their rivals' bound, until a placement
        self._open: set[str] | None = None  # the engine queues open for any request now, until a placement

    @functools.cached_property
    def preempted_at(self) -> dict[str, float]:
        """When each replica that preempts last did (no hold for one that has lately:
        AffinityScheduler.hold); built only when a pass first weighs a hold."""
        return {t.view.id: t.view.preempted_at for t in self.targets if t.view.preempted_at is not None}

    def eligible(self, target) -> bool:
        known = self._eligible.get(target.view.id)
        if known is None:
            known = self._eligible[target.view.id] = self.scheduler.eligible(target, self.now)
        return known

    def for_model(self, model: str) -> list:
        cands = self.by_model.get(model)
        if cands is None:
            eligible = self.eligible
            cands = self.by_model[model] = [t for t in self.targets if t.view.serves(model) and eligible(t)]
        return cands

    def free_ids(self, models: Iterable[str]) -> set[str]:
        """The free targets of the waiting models: where cache-affine ordering looks for prefixes."""
        return {t.view.id for m in models for t in self.for_model(m)}

    def live(self, entry: QueueEntry) -> set[str]:
        """`Scheduler._live`, kept per model for the entries with no limits of their own."""
        if entry.accepts is not None:
            return self.scheduler._live(entry, self.targets)
        model = entry.facts.model
        ids = self._live.get(model)
        if ids is None:
            ids = self._live[model] = self.scheduler._live(entry, self.targets)
        return ids

    def loads(self, entry: QueueEntry) -> dict[str, int]:
        """What waits in the engine of each target `entry` could go to (`_queued`), kept per
        model as `live` is, until a placement."""
        model = entry.facts.model
        loads = self._loads.get(model) if entry.accepts is None else None
        if loads is None:
            live = self.live(entry)
            loads = {t.view.id: _queued(t.view) for t in self.targets if t.view.id in live}
            if entry.accepts is None:
                self._loads[model] = loads
        return loads

    def placed(self, target) -> None:
        """A request went to `target`: its eligibility, the engine queues and the prefill ahead
        are read again when next asked."""
        self._eligible.pop(target.view.id, None)
        self._loads.clear()
        self._ready.clear()
        self._open = None
        self.told = False

    def open_now(self, queues: dict) -> set[str]:
        """The engine queues in `queues` still open for some request (`holder_queue_open` with no
        bound on the prompt): each push there narrows them."""
        if self._open is None:
            max_unseen = self.scheduler.cfg.max_unseen
            self._open = {i for i, t in queues.items() if holder_queue_open(t.view, max_unseen, math.inf)}
        return self._open

    def ready(self, entry: QueueEntry, queues: dict) -> set[str]:
        """The open engine queues (`open_now`) serving `entry`'s model within their rivals' bound
        (`Scheduler._within_rivals`): the only ones `Scheduler._holder_queue` may pick for an entry
        with no limits of its own."""
        model = entry.facts.model
        ready = self._ready.get(model)
        if ready is None:
            loads, within = self.loads(entry), self.scheduler._within_rivals
            ready = self._ready[model] = {i for i in self.open_now(queues)
                                          if queues[i].view.serves(model) and within(queues[i], loads)}
        return ready

    def drop(self, target) -> None:
        for cands in self.by_model.values():
            if target in cands:
                cands.remove(target)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, policy: Policy, queue: QueueOrderBase):
        self.policy = policy
        self.queue = queue
        self.affinity = AffinityScheduler(cfg.affinity, policy.prefix_memory, LengthModel())
        self.bytes_per_token = BytesPerToken()  # what an engine's KV size in tokens is in trie blocks
        self.leases = KvLeases(cfg.lease_s)  # contexts interactions under way come back for
        self.reconfigure(cfg)
        self.closed = False
        self._waiting: dict[str, int] = {}  # model → entries queued (kept as they come and go)
        self._waiting_tokens: dict[str, int] = {}  # model → their prompt tokens
        self.queued_work = QueuedWork()  # their tokens as admission counts them (lb.core.admission)
        self.backlog = Backlog()  # prefill ahead per target, and the TTFT it predicts
        self.decoding = Decoding()  # the KV the answers under way hold per target: not cache
        self.adapters = Adapters()  # the LoRA adapters our requests run per target

    def reconfigure(self, cfg: SchedulerConfig) -> None:
        """New limits (a config reload); the queue, its order and the policy stay."""
        self.cfg = cfg
        self.mode = Pushing(cfg.pushing)
        self.affinity.cfg = cfg.affinity
        self.leases.ttl_s = cfg.lease_s

    # -- the queue ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.queue)

    def waiting(self, model: str) -> int:
        return self._waiting.get(model, 0)

    def waiting_tokens(self, model: str) -> int:
        return self._waiting_tokens.get(model, 0)

    def admit(self, entry: QueueEntry, now: float) -> Placement | None:
        """Queue `entry`; a REJECT placement when the LB is closing or the queue is full."""
        if self.closed:
            return Placement(entry, Kind.REJECT, reason=SHUTTING_DOWN)
        if self.cfg.max_queue is not None and len(self.queue) >= self.cfg.max_queue:
            return Placement(entry, Kind.REJECT, reason=QUEUE_FULL)
        self.recognize(entry.facts, now)  # before the queue: a continuation keeps its interaction's rank there
        if entry.facts.adapter is not None:  # only where its adapter can run now (lb.core.adapters)
            entry.accepts = self.adapters.limit(entry.accepts, entry.facts.adapter)
        self.queue.push(entry)
        self._count(entry, 1)
        self.leases.arrived(entry.facts)
        return None

    def recognize(self, facts: RequestFacts, now: float) -> None:
        """Know which interaction an undeclared call continues, by its prompt (once per call;
        the daemon asks before its throttle, so OIT does not cut a recognized interaction)."""
        chain = self._undeclared_chain(facts)
        if chain is not None:
            self.leases.continuations.recognize(facts, chain, now)

    def _undeclared_chain(self, facts: RequestFacts) -> list[int] | None:
        """The prefix chain by which an undeclared call's interaction is known (None when the
        call names it, or no prefix memory hashes prompts)."""
        memory = self.affinity.memory
        if memory is None or declares(facts):
            return None
        return request_chain(facts, memory.block_chars, memory.isolate_tenants)

    def withdraw(self, entry: QueueEntry) -> bool:
        """`entry` leaves without running (timed out, client gone): nobody is charged."""
        if self.queue.remove(entry):
            self._count(entry, -1)
            return True
        return False

    def close(self) -> list[Placement]:
        """Take nothing new; every waiting entry gets a REJECT (it is answered, not dropped)."""
        self.closed = True
        out = [Placement(e, Kind.REJECT, reason=SHUTTING_DOWN) for e in list(self.queue.iter_in_order(0.0))]
        for p in out:
            self.withdraw(p.entry)
        return out

    def completed(self, facts: RequestFacts, input_tokens: int, output_tokens: int) -> None:
        """A placed request finished: orders that charged an estimate (WSC/VTC) settle it.
        (The daemon settles through `lb.daemon.fairness.Fairness.completed`, which shares
        the queue's service counters.)"""
        self.queue.completed(facts, input_tokens, output_tokens)

    def served(self, facts: RequestFacts, target_id: str, ttft_s: float | None, e2e_s: float | None,
               output_tokens: int, now: float, prompt_tokens: int | None = None) -> None:
        """A replica answered a placed request: what it took feeds the policy's learned rates,
        and the prompt tokens it counted (when it says) the bytes a token takes here.
        `output_tokens`: of all its answers; parallel samples (`facts.samples`) decode side by
        side, so the rates and the lengths learn one answer's."""
        output_tokens //= max(1, facts.samples)
        self.policy.served(facts, target_id, ttft_s, e2e_s, output_tokens, now)
        self.leases.answered(facts, target_id, prompt_tokens or facts.prompt_tokens, output_tokens, now,
                             self._undeclared_chain(facts))
        if output_tokens >= 1:
            self.affinity.lengths.observe(facts, output_tokens)
            if self.affinity.memory is not None:
                self.affinity.memory.answered(facts, target_id, output_tokens)
        if prompt_tokens and facts.prompt and self.affinity.memory is not None:  # only a trie uses it
            self.bytes_per_token.observe(prompt_bytes(facts), prompt_tokens)

    def first_token(self, request_id: str, now: float) -> None:
        """A placed request's first token came back: its prefill no longer waits ahead of
        anyone, and its TTFT teaches the prediction (`lb.core.backlog`)."""
        self.backlog.first_token(request_id, now)
        self.decoding.first_token(request_id, now)

    def ended(self, request_id: str) -> None:
        """A placed request ended (answered, failed, cancelled): nothing of it is ahead now."""
        self.backlog.ended(request_id)
        self.decoding.ended(request_id)
        self.leases.ended(request_id)
        self.adapters.ended(request_id)

    def wants_first_tokens(self, target_id: str) -> bool:
        """Pushes answered whole wait on the target: a probe whose load endpoint does not count
        first tokens reads them elsewhere too (lb.core.engines.first_tokens_source)."""
        return target_id in self.backlog.whole_open

    def answering(self, target_id: str) -> int:
        """The target's placed requests whose first token came back and that have not ended, each
        parallel sample one as the engine counts them: none of them is still on its way there
        (what `settle_probe` needs at a probe's start)."""
        return self.backlog.answering.get(target_id, 0)

    def advertise(self, targets: Iterable[Target], now: float) -> dict[str, dict]:
        """model → what a peer needs to predict a forward's TTFT here (`ttft` in
        `/lb/peer/status`): the fit and the work ahead on each replica that takes one now,
        and those replicas' loads (for the peer's `lighter_peer`), least first."""
        targets = list(targets)
        self._settle_whole_answers(targets, now)
        self.refresh_leases((t.view for t in targets), now)
        free: dict[str, list[ReplicaView]] = {}
        for t in targets:
            if self.eligible(t, now):
                for m in t.view.models:
                    free.setdefault(m, []).append(t.view)
        out = {}
        for m, views in free.items():
            advert = self.backlog.advert([v.id for v in views])
            if advert is not None:
                advert["load"] = sorted(load(v) for v in views)[:len(advert["ahead"])]
                out[m] = advert
        return out

    def _count(self, entry: QueueEntry, sign: int) -> None:
        model = entry.facts.model
        self._waiting[model] = self._waiting.get(model, 0) + sign
        self._waiting_tokens[model] = self._waiting_tokens.get(model, 0) + sign * entry.facts.prompt_tokens
        self.queued_work.add(entry.facts, sign)

    def _take(self, entry: QueueEntry) -> None:
        self.queue.dispatch(entry)  # WSC/VTC charge the tenant here
        self._count(entry, -1)

    # -- the fleet ---------------------------------------------------------------------------
    def register(self, target_id: str) -> None:
        self.policy.register(target_id)

    def forget(self, target_id: str) -> None:
        self.policy.forget(target_id)
        self.backlog.forget(target_id)
        self.decoding.forget(target_id)
        self.leases.forget(target_id)
        self.adapters.forget(target_id)

    def refresh_leases(self, views: Iterable[ReplicaView], now: float) -> None:
        """Each view's leased tokens as of `now` (expired leases out), which SP-P's headroom
        leaves out (lb.core.pushing.has_headroom). Every reader of `available` between passes
        (the peer advert, /metrics, the early re-probe) sees what a pass would."""
        leases = self.leases
        for view in views:
            view.leased_tokens = leases.leased(view.id, now)

    def available(self, view: ReplicaView) -> bool:
        """May one more request be pushed to `view` now (pushing mode and its headroom)?"""
        c = self.cfg
        return is_available(view, self.mode, max_outstanding=c.max_outstanding, push_credit=c.push_credit,
                            max_unseen=c.max_unseen)

    def wants_probe(self, view: ReplicaView) -> bool:
        """Should a push or an answer on `view` bring its next probe forward? Always when a
        probe costs the engine next to nothing; else only when a decision waits on it
        (requests in this queue, or SP-P's headroom on it spent). vLLM renders a 53 kB /metrics
        page in 6-9 ms of its API server's time (seen live on vLLM 0.32): probing after every
        push and every answer put that work beside each request (+8 to +12 ms p50 added by
        `lb` at one client, +3 to +6 ms without). A cheap probe after each push and answer
        keeps the views fresh: without them the simulator's saturated fleet, whose probes
        cost nothing, completed 1.2-1.5 % fewer requests."""
        return view.probe_s <= CHEAP_PROBE_S or len(self.queue) > 0 or not self.available(view)

    def eligible(self, target: Target, now: float) -> bool:
        """The per-target half of the filter chain: health, draining, breaker, pushing."""
        breaker = target.breaker
        return (breaker is None or breaker.allows(now)) and self.available(target.view)

    # -- one pass ----------------------------------------------------------------------------
    def schedule(self, now: float, targets: Iterable[Target], peers: PeerSet | None = None) -> list[Placement]:
        targets = list(targets)
        self._settle_whole_answers(targets, now)
        self.refresh_leases((t.view for t in targets), now)
        if not len(self.queue):
            return []
        p = _Pass(self, targets, now)
        peers_open = peers is not None and peers.open(now)
        waiting = [m for m, n in self._waiting.items() if n]
        memory = self.affinity.memory
        # replicas whose engine keeps its own queue for the prefixes it holds (`holder_queue_open`)
        queues = self._open_queues(p) if memory is not None else {}
        if not peers_open and not queues and not any(p.for_model(m) for m in waiting):
            return []  # nothing queued has a free target: skip walking the backlog
        free_ids = p.free_ids(waiting) if memory is not None else ()
        out: list[Placement] = []
        held: list[QueueEntry] = []  # waiting for a busy holder (`_settle_held`)
        blocked: set[str] = set()  # models nothing can take this pass, for any entry
        for entry in self.affinity.order(self.queue.walk(now), now, free_ids):
            facts = entry.facts
            if facts.model in blocked:
                continue
            cands = self._candidates(entry, p.for_model(facts.model), p.targets)
            if not cands and queues:
                holder = self._join_holder(entry, queues, now, p)
                if holder is not None:
                    out.append(self._place(entry, holder, now))
                    p.placed(holder)
                    continue
            if not cands:
                placed = self._to_peer(entry, peers, now, p.targets) if peers_open else None
                if placed is not None:
                    out.append(placed)
                    if placed.kind is Kind.PEER:
                        peers_open = peers.open(now)
                    continue
                if self._widest(entry, peers_open) and not (p.tries > 0 and p.open_now(queues)):
                    blocked.add(facts.model)
                    if len(blocked) >= len(waiting):
                        break  # nothing behind can be placed either
                continue
            if peers_open and memory is not None and facts.hops == 0:
                followed = self._follow(entry, peers, now, p.targets)
                if followed is not None:
                    out.append(followed)
                    peers_open = peers.open(now)
                    continue
            if memory is not None:
                # a hold for a holder that preempts ends while no more wait here than replicas are
                # free: then the free one would idle (AffinityScheduler.hold)
                preempted = p.preempted_at if len(self.queue) <= len(cands) else None
                if self.affinity.hold(entry, now, {t.view.id for t in cands}, p.live(entry), preempted):
                    held.append(entry)  # settled once the others have taken what they can
                    continue
            target = self._choose(facts, cands, now)
            if target is None:
                continue
            if peers is not None and peers.predicted and facts.hops == 0:
                forwarded = self._lighter_peer(entry, target, peers, now) or self._faster_peer(entry, target, peers, now)
                if forwarded is not None:
                    out.append(forwarded)
                    continue
            out.append(self._push(entry, target, p, now))
        if held:
            out.extend(self._settle_held(held, p, queues, now))
        return out

    def _settle_held(self, held: list[QueueEntry], p: "_Pass", queues: dict, now: float) -> list[Placement]:
        """The requests held for a busy holder this pass, after every other request has taken what
        it could: each takes a replica still free where waiting would cost it more than the prefill
        it redoes there (`AffinityScheduler.release`), else joins its holder's engine queue where
        that is open (`_holder_queue`), else waits here (a HOLD)."""
        per_token = self._prefill_token_s()
        running = {t.view.id: t.view.running for t in p.targets}
        waiting = {t.view.id: t.view.pending + t.view.pushed_since_probe for t in p.targets}
        ahead: Counter = Counter()
        out: list[Placement] = []
        for entry in held:
            facts = entry.facts
            cands = self._candidates(entry, p.for_model(facts.model), p.targets) if per_token is not None else []
            if cands and self.affinity.release(entry, {t.view.id for t in cands}, p.live(entry), running, waiting,
                                               per_token, ahead):
                target = self._choose(facts, cands, now)
                if target is not None:
                    out.append(self._push(entry, target, p, now))
                    continue
            holder = self._join_holder(entry, queues, now, p) if queues else None
            if holder is not None:
                out.append(self._place(entry, holder, now))
                p.placed(holder)
                continue
            out.append(Placement(entry, Kind.HOLD, reason="prefix-holder-busy", waited=now - entry.enqueued_at))
        return out

    def _prefill_token_s(self) -> float | None:
        """A token's prefill time: fitted from first tokens (lb.core.backlog), or where none came
        back (clients that do not stream) the policy's own estimate; None: no estimate yet."""
        fit = self.backlog.fit()
        if fit is not None:
            return fit[1]
        memory = self.affinity.memory
        return memory.prefill_token_s() if memory is not None else None

    def _choose(self, facts: RequestFacts, cands: list, now: float):
        """The policy's choice among `cands` (None: none), each told this LB's prefill ahead there."""
        self._tell_ahead(cands)
        by_id = {t.view.id: t for t in cands}
        return by_id.get(self.policy.choose(facts, [t.view for t in cands], now))

    def _settle_whole_answers(self, targets: list, now: float) -> None:
        """Pushes answered whole whose prefill is done: those the engine's first-token count says
        (vLLM's TTFT histogram: `view.engine_first_tokens`), elsewhere those past their predicted TTFT."""
        counted = self.backlog.counted
        for t in targets:
            if t.view.engine_first_tokens is not None or t.view.id in counted:
                self.backlog.engine_first_tokens(t.view.id, t.view.engine_first_tokens)
        self.backlog.expire(now)

    def _tell_ahead(self, targets) -> None:
        """Each target's view told this LB's prefill ahead there (lb.core.backlog)."""
        ahead, count = self.backlog.ahead, self.backlog.ahead_count
        for t in targets:
            t.view.prefill_ahead = ahead.get(t.view.id, 0.0)
            t.view.prefill_ahead_count = count.get(t.view.id, 0)

    def _push(self, entry: QueueEntry, target: Target, p: "_Pass", now: float) -> Placement:
        """Place `entry` on `target`; a target the push made unavailable leaves the pass's free set."""
        placed = self._place(entry, target, now)
        p.placed(target)
        if not p.eligible(target):
            p.drop(target)
        return placed

    def _open_queues(self, p: "_Pass") -> dict:
        """The targets SP-P's gate shuts whose engine may still queue the requests it holds the
        prefix of (an engine seen to preempt: lb.core.pushing.holder_queue_open)."""
        if self.mode is not Pushing.SP_PENDING:
            return {}
        max_unseen, now = self.cfg.max_unseen, p.now
        # SP-P's gate shut, the breaker closed not being why (eligibility first: below capacity
        # nearly every target is, and a pass reads it anyway)
        return {t.view.id: t for t in p.targets
                if not p.eligible(t) and (t.breaker is None or t.breaker.allows(now))
                and holder_queue_open(t.view, max_unseen, math.inf)}

    def _join_holder(self, entry: QueueEntry, queues: dict, now: float, p: "_Pass"):
        """`_holder_queue` within the pass's budget: HOLDER_QUEUE_TRIES lookups, and before them
        up to HOLDER_QUEUE_GLANCES entries passed over that no ready queue could take
        (`_holder_queue_worth`)."""
        if p.tries <= 0:
            return None
        if p.glances > 0 and not self._holder_queue_worth(entry, queues, p):
            p.glances -= 1
            return None
        p.tries -= 1
        return self._holder_queue(entry, queues, now, p)

    def _holder_queue_worth(self, entry: QueueEntry, queues: dict, p: "_Pass") -> bool:
        """Could `_holder_queue` place `entry`? False only where it could not: no open engine queue
        within its rivals' bound (`_Pass.ready`) holds the prompt's first block, where every match
        starts (the trie forgets a prefix's blocks deepest first). An entry with limits of its own
        is looked up whole."""
        if entry.accepts is not None or entry.exclude:
            return True
        ready = p.ready(entry, queues)
        return bool(ready) and any(t in ready for t in self.affinity.memory.opening_holders(entry.facts))

    def _holder_queue(self, entry: QueueEntry, queues: dict, now: float, p: "_Pass"):
        """The replica in `queues` that holds at least `min_gain` of `entry`'s prompt, if any (of
        those holding its longest match, the one with the least waiting there or unseen, then
        the least prefill ahead): it goes into that engine's queue beside its prefix instead of
        waiting here for it (and losing it). A single call does so only where some replica that
        could serve it lacks its prefix: where every one holds it, whichever frees a slot first
        serves it as well, and one line here for them all drains sooner than a line in each
        engine (a chat service's system prompts beside long documents on SGLang as it ships:
        live TTFT p50 1.35x that of waiting here; `holder_queue_open` and docs/results.md). The
        policy is asked with that one candidate, so the placement carries its decision (prefix
        match, predicted TTFT) as any other does. Asked to choose among the holders instead, the
        predicted-TTFT policy, which prices prefill ahead but not an
        engine's waiting queue, did worse than the shortest queue (long-short with `lpm`
        engines at 1.3x, 3 seeds: TTFT p90 7.0 s against 3.8).

        Not while the holder's queue is more than OVERCOMMIT_QUEUE past twice the mean of the
        other replicas' that could serve it (`_within_rivals`): then it waits here for any free one.
        What the holder runs bounds its queue (`holder_queue_open`), and one replica holding a
        prefix that many requests share (a chat service's system prompt beside long documents,
        held-out `long-short` at 1.3x capacity in the simulator) queued ~90 of them, all it ran,
        while the other three ran a fifth as much: 0.90x the requests an LB without holds
        completed, and now 1.07x what it did (docs/results.md). Where every replica holds its
        share of the prefixes (SGLang's shared-prefix benchmark) the queues stay alike and the
        bound rarely binds."""
        max_unseen, facts = self.cfg.max_unseen, entry.facts
        if p.all_keep is None:
            p.all_keep = all(t.view.requeues or t.view.orders_by_prefix for t in queues.values())
        # a single call (one that continues no interaction) may have a way in of its own
        single = not p.all_keep and not (declares(facts) or recognized_continuation(facts))
        if not p.told:
            self._tell_ahead(queues.values())
            p.told = True
        widest = max(1, facts.prompt_tokens) if single else None
        usable = {i: t for i, t in queues.items()  # each push here narrows it: asked again each time
                  if holder_queue_open(t.view, max_unseen, widest) and self._may_go(entry, t.view)
                  and i not in entry.exclude}
        if not usable:
            return None
        live = p.live(entry)
        # Past capacity most entries asked find every such queue far longer than the others' (the
        # bound below): known before any prefix lookup, since it holds for the holder chosen
        loads = p.loads(entry)
        if not any(self._within_rivals(t, loads) for t in usable.values()):
            return None
        if single and self._held_everywhere(entry, live):  # then one line here serves it as well
            usable = {i: t for i, t in usable.items() if holder_queue_open(t.view, max_unseen, None)}
            if not usable:
                return None
        depth, blocks, holders = self.affinity.memory.affinity(facts, usable.keys())
        if not blocks or not holders or depth < self.affinity.cfg.min_gain * blocks:
            return None
        # every replica holding the match is as good a cache: the least queued takes it, so a prefix
        # many requests share (a chat service's system prompt) spreads over its holders; of equal
        # queues, the one with the least prefill ahead (this LB's pushes there with no first token
        # yet), since a long document's chunked prefill holds back what is admitted after it
        ahead = self.backlog.ahead
        target = min((usable[h] for h in holders), key=lambda t: (_queued(t.view), ahead.get(t.view.id, 0.0)))
        if not self._within_rivals(target, loads):
            return None
        return target if self.policy.choose(facts, [target.view], now) == target.view.id else None

    @staticmethod
    def _within_rivals(target, loads: dict[str, int]) -> bool:
        """Is `target`'s engine queue under OVERCOMMIT_QUEUE past twice the mean of the others'
        that could serve the request (`loads`: each one's `_queued`)? (`_holder_queue`)"""
        own = _queued(target.view)
        others = len(loads) - (target.view.id in loads)
        if not others:
            return True
        return own < OVERCOMMIT_QUEUE + 2 * (sum(loads.values()) - loads.get(target.view.id, 0)) / others

    def _held_everywhere(self, entry: QueueEntry, live: set[str]) -> bool:
        """Every replica that could serve `entry` holds its prefix (at least `min_gain` of it)."""
        depth, blocks, holders = self.affinity.memory.affinity(entry.facts, live)
        return bool(blocks) and depth >= self.affinity.cfg.min_gain * blocks and len(holders) == len(live)

    def _uncached(self, facts: RequestFacts) -> float:
        """The prompt tokens the policy's last choice will not find cached (its prefix match)."""
        d = self.policy.last
        return uncached_tokens(max(1, facts.prompt_tokens), d.matched_blocks, d.total_blocks)

    def _place(self, entry: QueueEntry, target: Target, now: float) -> Placement:
        facts = entry.facts
        self._take(entry)
        record_push(target.view, push_tokens(facts, self.cfg.decode_reserve), now, facts.samples)
        self.leases.placed(facts)
        self.adapters.placed(facts.request_id, target.view.id, facts.adapter)
        predicted = self.policy.last.predicted_ttft_s
        if facts.stream:  # its first event will say when its prefill is done
            self.backlog.placed(facts.request_id, target.view.id, self._uncached(facts), now, samples=facts.samples)
        elif predicted is not None:
            # An answer that comes back whole says nothing until it ends: counted until then it
            # looked like prefill ahead through its whole decode, and left out the replica's
            # prefill went unseen. Its prefill is assumed done at its predicted TTFT (measured,
            # all clients not streaming, p90 at 0.9x: bursty 1,997 -> 1,243 ms, mixed-tree
            # 1,048 -> 825, streamed 1,168 and 840; docs/results.md).
            self.backlog.placed(facts.request_id, target.view.id, self._uncached(facts), now,
                                expires_at=now + predicted, samples=facts.samples)
        memory = self.affinity.memory
        if memory is not None:
            tid = target.view.id
            self.decoding.placed(facts.request_id, tid, self._answer_tokens(facts),
                                 None if facts.stream else now + (predicted or 0.0), facts.samples)
            room = self.cache_room(target.view, now)
            if room is not None:  # the trie remembers what its cache has room for
                memory.cache_size(tid, room, self.bytes_per_token.value())
        self.policy.observe(facts, target.view.id, now)
        d = self.policy.last
        if memory is not None:  # an answer it continues there is spent: its siblings find it no more
            memory.answer_after(facts, target.view.id, d.matched_blocks, take=True)
        return Placement(entry, Kind.REPLICA, target, target.view.id, d.reason, now - entry.enqueued_at,
                         d.matched_blocks, d.total_blocks, d.best_blocks)

    def cache_room(self, view: ReplicaView, now: float) -> int | None:
        """The KV tokens `view`'s engine has for its prefix cache, its answers under way taken out
        (`lb.core.decoding`); None where its KV size is unknown or no trie remembers prefixes."""
        memory = self.affinity.memory
        if memory is None or not view.kv_total_tokens:
            return None
        return self.decoding.cache_room(view.id, view.kv_total_tokens, now, memory.decode_step_s(view.id))

    def _answer_tokens(self, facts: RequestFacts) -> float:
        """The answer tokens a push is expected to decode: its max_tokens, else the lengths
        learned, for each of its parallel samples."""
        if facts.max_tokens is not None:
            return facts.max_tokens * facts.samples
        lengths = self.affinity.lengths
        return (lengths.expected(facts) if lengths is not None else self.cfg.decode_reserve) * facts.samples

    def _live(self, entry: QueueEntry, targets: list) -> set[str]:
        """The healthy local targets that could serve `entry`, free or busy (where its prefix may be)."""
        return {t.view.id for t in targets if t.view.healthy and not t.view.draining and self._may_go(entry, t.view)}

    @staticmethod
    def _may_go(entry: QueueEntry, view: ReplicaView) -> bool:
        return view.serves(entry.facts.model) and (entry.accepts is None or entry.accepts(view))

    @staticmethod
    def _widest(entry: QueueEntry, peers_open: bool) -> bool:
        """No limits of its own: an entry like this finding nothing means no entry for its
        model can find anything this pass (limits only narrow the candidates)."""
        return (entry.accepts is None and not entry.exclude
                and (not peers_open or (entry.facts.residency is None and entry.facts.hops == 0)))

    def _candidates(self, entry: QueueEntry, free_for_model: list, targets: list) -> list:
        """The per-request half of the filter chain: `accepts`, then retry exclusion."""
        cands = free_for_model if entry.accepts is None else [t for t in free_for_model if entry.accepts(t.view)]
        if not entry.exclude:
            return cands
        fresh = [t for t in cands if t.view.id not in entry.exclude]
        if fresh:
            return fresh
        # every free one already failed it: wait for another healthy one, if any exists
        others_exist = any(t.view.healthy and not t.view.draining and t.view.id not in entry.exclude
                           and self._may_go(entry, t.view) for t in targets)
        return [] if others_exist else cands

    def _usable_peers(self, entry: QueueEntry, peers: PeerSet) -> tuple[list[PeerTarget], frozenset[str]]:
        """The peers `entry` may go to (healthy, its `accepts`), and the regions it already failed on."""
        usable = [p for p in peers.targets if p.view.healthy and (entry.accepts is None or entry.accepts(p.view))]
        for p in usable:
            p.status.in_flight = p.view.outstanding
        return usable, frozenset(p.config.region for p in usable if p.view.id in entry.exclude)

    def _to_peer(self, entry: QueueEntry, peers: PeerSet, now: float, targets: list) -> Placement | None:
        """SkyWalker Algorithm 1, second branch: no local replica can take it; an available peer?
        First where its prefix is: kept for a busy local holder (a HOLD), or sent to the peer
        region that holds it (`AffinityScheduler.across_regions`)."""
        usable, exclude = self._usable_peers(entry, peers)
        facts = entry.facts
        if self.affinity.memory is not None and facts.hops == 0:
            where, region = self.affinity.across_regions(entry, now, self._live(entry, targets),
                                                         peers.router.uncached(facts))
            if where == "keep":
                return Placement(entry, Kind.HOLD, reason="prefix-here", waited=now - entry.enqueued_at)
            if where == "follow":
                followed = self._to_holder(entry, region, usable, exclude, peers, now)
                if followed is not None:
                    return followed
        d = local_or_peer(entry.facts, local_available=False, peers=[(p.config, p.status) for p in usable],
                          router=peers.router, tau=peers.tau, now=now, stale_s=peers.stale_s, exclude=exclude)
        if d.kind != "peer":
            if d.residency_blocked:
                return Placement(entry, Kind.HOLD, reason="residency", waited=now - entry.enqueued_at,
                                 residency_blocked=d.residency_blocked)
            return None
        return self._forward(entry, usable, d, peers, now)

    def _follow(self, entry: QueueEntry, peers: PeerSet, now: float, targets: list) -> Placement | None:
        """A local replica could take `entry`, but a peer region holds much more of its prompt
        (`AffinityScheduler.across_regions`: a tree or conversation whose earlier calls went
        there). It follows them, so the tree is not split: placed here it recomputes their
        context, takes a free slot a request with its cache here could have had, and its own
        later calls find their context on two sides (three regions, 2 seeds x 300 s: TTFT p90
        at 1.1x 562/713 -> 496/536 ms, throughput at 1.3x 85.8/85.3 -> 94.7/90.4 req/s with
        the half-`min_gain` threshold and no τ for the holder; docs/results.md)."""
        remote = peers.router.uncached(entry.facts)
        if not self.affinity.may_follow(entry.facts, remote):
            return None  # no peer region remembers enough of it: skip the local match
        where, region = self.affinity.across_regions(entry, now, self._live(entry, targets), remote)
        if where != "follow":
            return None
        usable, exclude = self._usable_peers(entry, peers)
        return self._to_holder(entry, region, usable, exclude, peers, now)

    def _to_holder(self, entry: QueueEntry, region: str, usable: list[PeerTarget], exclude: frozenset[str],
                   peers: PeerSet, now: float) -> Placement | None:
        d = holder_peer(entry.facts, region, peers=[(p.config, p.status) for p in usable], now=now,
                        stale_s=peers.stale_s, exclude=exclude)
        return self._forward(entry, usable, d, peers, now, "peer-prefix") if d.kind == "peer" else None

    def _faster_peer(self, entry: QueueEntry, target: Target, peers: PeerSet, now: float) -> Placement | None:
        """A local replica would take it (`target`, the policy's choice): a peer whose predicted
        TTFT plus the round trip is lower by the margin takes it instead (None: stay local)."""
        local = self.backlog.predict(target.view.id, self._uncached(entry.facts))
        if local is None:  # no fit yet: Algorithm 1 alone
            return None
        error = self.backlog.error_s or 0.0
        remote = peers.router.uncached(entry.facts)  # a peer that holds its prefix computes less
        least = min(remote.values(), default=float(max(1, entry.facts.prompt_tokens)))
        bound = peers.fastest_possible_s(entry.facts.model, least, error)
        if bound is None or local <= bound + peers.margin_s:
            return None  # no peer could win by the margin even with nothing ahead there
        usable, exclude = self._usable_peers(entry, peers)
        d = predicted_peer(entry.facts, local_ttft=local, local_error=error,
                           peers=[(p.config, p.status) for p in usable], router=peers.router, tau=peers.tau,
                           now=now, stale_s=peers.stale_s, margin_s=peers.margin_s, exclude=exclude,
                           remote_tokens=remote)
        # "peer-faster": a local replica would have taken it (`peer`: none could)
        return self._forward(entry, usable, d, peers, now, "peer-faster") if d.kind == "peer" else None

    def _lighter_peer(self, entry: QueueEntry, target: Target, peers: PeerSet, now: float) -> Placement | None:
        """A local replica would take it (`target`), holding less than `min_gain` of its prompt
        (new here: a tree or conversation that has not started in this region): a peer whose
        least-loaded replica carries at most `lighter_share` of `target`'s load takes it
        instead (`lb.core.peering.lighter_peer`; None: stay local)."""
        here = load(target.view)
        if not may_lighten(here, peers.lighter_share):
            return None
        chosen = self.policy.last
        if chosen.total_blocks and chosen.matched_blocks >= self.cfg.affinity.min_gain * chosen.total_blocks:
            return None  # its context is cached here: it stays with it
        usable, exclude = self._usable_peers(entry, peers)
        d = lighter_peer(entry.facts, here, peers=[(p.config, p.status) for p in usable], tau=peers.tau, now=now,
                         stale_s=peers.stale_s, share=peers.lighter_share, exclude=exclude)
        return self._forward(entry, usable, d, peers, now, "peer-lighter") if d.kind == "peer" else None

    def _forward(self, entry: QueueEntry, usable: list[PeerTarget], d: PeerDecision, peers: PeerSet,
                 now: float, reason: str = "peer") -> Placement:
        facts = entry.facts
        peer = next(p for p in usable if p.config.region == d.region)
        self._take(entry)
        peer.status.forwarded(now, facts.model, max(1, facts.prompt_tokens))
        record_push(peer.view, 0, now)
        peers.router.observe(facts, d.region, now)
        return Placement(entry, Kind.PEER, peer.handle, peer.view.id, reason, now - entry.enqueued_at,
                         residency_blocked=d.residency_blocked)
