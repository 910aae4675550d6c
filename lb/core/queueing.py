"""The LB queue and its orders. With selective pushing requests wait here, so this order
*is* the schedule.

Every order implements push / pop / peek / remove / dispatch / len / iter plus
`iter_in_order(now)`, which the scheduler walks (`walk`) to take the first entry it can
place: a head whose model has no free replica must not block the entries behind it. Orders
register by config name in `QUEUE_ORDERS`; `make_queue(name, tiers=..., service=...,
in_progress=...)` builds one, handing it the context it uses.

- `fcfs`: arrival order (a retry keeps the place it arrived with).
- `wsc` / `vtc`: least-served user first (FairServe WSC, VTC baseline), per-user FIFO.
- `edf`: earliest TTFT deadline first (an expired request has the earliest deadline).
- `pf`: tier first (IW-F strictly before IW-N before NIW), FIFO within a tier.
- `dpa`: SageServe's deadline- and priority-aware classes (see `dpa_class`).
- `srpt`: weighted shortest remaining work first, with aging so nothing starves.

Taking an entry out to run it is `pop(now)` or `dispatch(entry)`; for WSC/VTC that is where
the service counter is charged (`remove` is for entries that leave without running).

Two bases to extend from:
  FCFSQueue       arrival order, O(1) per operation (an OrderedDict is a linked hash list).
  StaticKeyQueue  smallest `key(entry)` first, key fixed at push (EDF deadlines, PF tiers):
                  a heap with lazy deletion, O(log n) push/pop and O(1) remove.
Orders whose keys move while entries wait (service counters, urgency classes) override
`iter_in_order`/`pop` themselves.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Iterable, Iterator

from lb.core.continuations import interaction_key, interaction_of, recognized_continuation
from lb.core.fairness import VTC_CONFIG, WeightedService
from lb.core.tiers import TIER_RANK, TierConfig
from lb.core.types import QueueEntry, RequestFacts, Tier


class QueueOrderBase:
    name = "base"

    def push(self, entry: QueueEntry) -> None:
        raise NotImplementedError

    def remove(self, entry: QueueEntry) -> bool:
        """Drop `entry` if queued (client gone, or placed by the dispatcher)."""
        raise NotImplementedError

    def iter_in_order(self, now: float) -> Iterator[QueueEntry]:
        """Entries from first to last served. The caller may `remove` entries while
        iterating (removed ones are not yielded), so it can place several in one pass."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[QueueEntry]:
        return self.iter_in_order(0.0)

    def __contains__(self, entry: QueueEntry) -> bool:
        raise NotImplementedError

    def peek(self, now: float) -> QueueEntry | None:
        return next(self.iter_in_order(now), None)

    def pop(self, now: float) -> QueueEntry | None:
        entry = self.peek(now)
        if entry is not None:
            self.dispatch(entry)
        return entry

    def dispatch(self, entry: QueueEntry) -> bool:
        """Take `entry` out to run it. Orders that keep service counters (WSC, VTC) charge
        its tenant here; `remove` is for entries that leave without running."""
        return self.remove(entry)

    def completed(self, facts: RequestFacts, input_tokens: int, output_tokens: int) -> None:
        """A request taken out earlier finished with this usage (WSC/VTC settle the charge)."""

    def anchor(self, interaction: str | None) -> float | None:
        """The rank an interaction's calls keep (WSC: its anchor), where the order keeps one."""
        return None

    def heard_anchor(self, interaction: str, anchor: float) -> None:
        """Another LB instance let the interaction in at this rank (lb.core.instances)."""

    def walk(self, now: float) -> Iterator[QueueEntry]:
        """`iter_in_order(now)`, but head by head (`peek`) while the caller keeps taking the
        head: a full walk snapshots the whole queue, and a pass that places one request off
        a backlog of thousands (every completion under overload) would then cost O(backlog).
        Only once a head stays queued does the walk go on past it."""
        while True:
            head = self.peek(now)
            if head is None:
                return
            yield head
            if head in self:
                break
        rest = self.iter_in_order(now)
        for entry in rest:
            if entry is not head:
                yield entry
                break
        yield from rest


class FCFSQueue(QueueOrderBase):
    name = "fcfs"

    def __init__(self, **_) -> None:
        self._entries: OrderedDict[QueueEntry, None] = OrderedDict()

    def push(self, entry: QueueEntry) -> None:
        """In arrival order: `seq` is the arrival ticket. Arrivals append in O(1); an entry
        with an earlier ticket — a request retried after its replica failed keeps the one
        it arrived with — goes back to its place, ahead of everyone who came after it."""
        if entry in self._entries:
            raise ValueError("entry is already queued")
        later = []
        for other in reversed(self._entries):
            if other.seq <= entry.seq:
                break
            later.append(other)
        self._entries[entry] = None
        for other in reversed(later):
            self._entries.move_to_end(other)

    def remove(self, entry: QueueEntry) -> bool:
        return self._entries.pop(entry, False) is None

    def iter_in_order(self, now: float) -> Iterator[QueueEntry]:
        # A snapshot (a C-speed list copy) so the caller may remove while iterating.
        for entry in list(self._entries):
            if entry in self._entries:
                yield entry

    def peek(self, now: float) -> QueueEntry | None:
        return next(iter(self._entries), None)

    def pop(self, now: float) -> QueueEntry | None:
        return self._entries.popitem(last=False)[0] if self._entries else None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry: QueueEntry) -> bool:
        return entry in self._entries


class StaticKeyQueue(QueueOrderBase):
    """Smallest key first; equal keys in push order. Subclasses define `key`."""

    name = "static-key"

    def __init__(self) -> None:
        self._heap: list[tuple[object, int, QueueEntry]] = []
        self._live: set[QueueEntry] = set()
        self._counter = itertools.count()

    def key(self, entry: QueueEntry) -> object:
        raise NotImplementedError

    def push(self, entry: QueueEntry) -> None:
        if entry in self._live:
            raise ValueError("entry is already queued")
        self._live.add(entry)
        heapq.heappush(self._heap, (self.key(entry), next(self._counter), entry))

    def remove(self, entry: QueueEntry) -> bool:
        if entry not in self._live:
            return False
        self._live.discard(entry)  # its heap item goes when it surfaces, or at compaction
        if len(self._heap) > 2 * len(self._live) + 16:
            self._heap = [item for item in self._heap if item[2] in self._live]
            heapq.heapify(self._heap)
        return True

    def _settle(self) -> None:
        heap = self._heap
        while heap and heap[0][2] not in self._live:
            heapq.heappop(heap)

    def peek(self, now: float) -> QueueEntry | None:
        self._settle()
        return self._heap[0][2] if self._heap else None

    def pop(self, now: float) -> QueueEntry | None:
        self._settle()
        if not self._heap:
            return None
        entry = heapq.heappop(self._heap)[2]
        self._live.discard(entry)
        return entry

    def iter_in_order(self, now: float) -> Iterator[QueueEntry]:
        # Pop lazily from a copy: O(n) to start, O(log n) per entry actually looked at.
        heap = list(self._heap)
        while heap:
            entry = heapq.heappop(heap)[2]
            if entry in self._live:
                yield entry

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, entry: QueueEntry) -> bool:
        return entry in self._live


class EDFQueue(StaticKeyQueue):
    name = "edf"

    def __init__(self, tiers: TierConfig | None = None, **_):
        super().__init__()
        self.tiers = tiers or TierConfig()

    def key(self, entry: QueueEntry) -> object:
        return self.tiers.ttft_deadline(entry.facts)


class PFQueue(StaticKeyQueue):
    name = "pf"

    def __init__(self, **_):
        super().__init__()

    def key(self, entry: QueueEntry) -> object:
        return (TIER_RANK[entry.facts.tier], entry.enqueued_at)


class SRPTQueue(StaticKeyQueue):
    """Weighted SRPT: work = prefill_weight·prompt + expected output, divided by the tier's
    weight, minus `aging_per_s` per second waited. The credit grows alike for everyone, so
    work + aging·enqueued_at orders the queue the same at every `now`: a static key."""

    name = "srpt"

    def __init__(self, tier_weights: dict | None = None, prefill_weight: float = 0.1,
                 default_output: int = 256, aging_per_s: float = 100.0, **_):
        super().__init__()
        self.tier_weights = tier_weights or {Tier.IW_F: 4.0, Tier.IW_N: 2.0, Tier.NIW: 1.0}
        self.prefill_weight = prefill_weight
        self.default_output = default_output
        self.aging_per_s = aging_per_s

    def key(self, entry: QueueEntry) -> object:
        f = entry.facts
        output = f.max_tokens if f.max_tokens is not None else self.default_output
        work = self.prefill_weight * f.prompt_tokens + output
        return work / self.tier_weights[f.tier] + self.aging_per_s * entry.enqueued_at


# DPA classes, in the order they are served.
SEVERELY_EXPIRED, URGENT_F, URGENT_N, RELAXED_F, RELAXED_N, RECENTLY_EXPIRED = range(6)


def dpa_class(tier: Tier, slack_s: float, tau_n_s: float, tau_p_s: float) -> int:
    """SageServe DPA; slack = time left to the TTFT deadline. Past it by more than τp:
    severely expired, served first (it has waited far too long); past it by less: recently
    expired, served last (its SLO is lost while a live one can still be saved); under τn
    left: urgent. NIW is urgent-normal: it reaches the LB queue only when the deferred queue
    releases it (spare capacity, when the LB queue was empty; or its deadline near), so it
    is due now; judged against an interactive TTFT deadline it would wait behind every live
    request and, above capacity, miss its own deadline (sim-compare tiers, NIW on time)."""
    if tier is Tier.NIW:
        return URGENT_N
    if slack_s < -tau_p_s:
        return SEVERELY_EXPIRED
    if slack_s < 0:
        return RECENTLY_EXPIRED
    fast = tier is Tier.IW_F
    if slack_s < tau_n_s:
        return URGENT_F if fast else URGENT_N
    return RELAXED_F if fast else RELAXED_N


class _MembershipQueue(QueueOrderBase):
    """Entries with O(1) membership, ranked among equals by their arrival ticket (`seq`: a
    request retried after its replica failed keeps the one it arrived with, so it goes
    back ahead of everyone who came after it), then push order; subclasses decide the order."""

    def __init__(self) -> None:
        self._seq: dict[QueueEntry, tuple[int, int]] = {}
        self._next = 0

    def push(self, entry: QueueEntry) -> None:
        if entry in self._seq:
            raise ValueError("entry is already queued")
        self._seq[entry] = (entry.seq, self._next)
        self._next += 1

    def remove(self, entry: QueueEntry) -> bool:
        return self._seq.pop(entry, None) is not None

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, entry: QueueEntry) -> bool:
        return entry in self._seq

    def _walk(self, ordered: Iterable[QueueEntry]) -> Iterator[QueueEntry]:
        for entry in ordered:  # the caller may remove while iterating
            if entry in self._seq:
                yield entry


class DPAQueue(_MembershipQueue):
    """Classes move with `now`, but within a tier an entry's class follows its TTFT deadline
    (slack = deadline - now, the same for all), so each tier is kept sorted by deadline and
    a class is a slice of it found by bisection: a peek reads a few slice heads, not every
    entry (ranking every entry cost O(n) per peek and a sort per pass; 4,096 entries queued
    is `queue.max_len`)."""

    name = "dpa"

    def __init__(self, tiers: TierConfig | None = None, **_):
        super().__init__()
        self.tiers = tiers or TierConfig()
        self._by_tier: dict[Tier, list[tuple[float, tuple, QueueEntry]]] = {}  # (deadline, seq, entry), sorted

    def push(self, entry: QueueEntry) -> None:
        super().push(entry)
        bisect.insort(self._by_tier.setdefault(entry.facts.tier, []),
                      (self.tiers.ttft_deadline(entry.facts), self._seq[entry], entry))

    def remove(self, entry: QueueEntry) -> bool:
        seq = self._seq.get(entry)
        if not super().remove(entry):
            return False
        items = self._by_tier[entry.facts.tier]
        del items[bisect.bisect_left(items, (self.tiers.ttft_deadline(entry.facts), seq))]
        return True

    def _classes(self, now: float) -> list[list[tuple[list, int, int]]]:
        """Per DPA class, in serving order, the (sorted list, start, end) slices it holds: each
        tier cut where its slack crosses -τp, 0 and τn (the bounds `dpa_class` tests), each
        piece in the class `dpa_class` gives its first entry."""
        t = self.tiers
        out: list[list[tuple[list, int, int]]] = [[] for _ in range(6)]
        for tier, items in self._by_tier.items():
            cuts = [0]
            for bound in (-t.tau_p_s, 0.0, t.tau_n_s):
                cuts.append(bisect.bisect_left(items, True, lo=cuts[-1], key=lambda it: it[0] - now >= bound))
            cuts.append(len(items))
            for a, b in zip(cuts, cuts[1:]):
                if a < b:
                    out[dpa_class(tier, items[a][0] - now, t.tau_n_s, t.tau_p_s)].append((items, a, b))
        return out

    def peek(self, now: float) -> QueueEntry | None:
        for slices in self._classes(now):
            heads = [items[a] for items, a, b in slices if a < b]
            if heads:
                return min(heads, key=lambda it: it[:2])[2]
        return None

    def iter_in_order(self, now: float) -> Iterator[QueueEntry]:
        # copies of the slices: the caller may take entries out while it walks
        merged = (heapq.merge(*(items[a:b] for items, a, b in slices), key=lambda it: it[:2])
                  for slices in self._classes(now))
        return self._walk(it[2] for cls in merged for it in cls)


def mid_interaction(facts: RequestFacts, now: float) -> bool:
    """Default in-progress test: the client says this is a later stage of an interaction, or
    its prompt showed it continues one (lb.core.continuations) (the daemon passes
    `InteractionLedger.in_progress` to also know what it dispatched)."""
    if facts.interaction_id is None:
        return recognized_continuation(facts)
    return (facts.interaction_stage or 0) > 0


# Interactions whose anchor `WSCQueue` keeps: a few MB at most, and more than an LB has under way.
ANCHORS_KEPT = 65_536


class WSCQueue(_MembershipQueue):
    """Least-served user first; within a user, calls of interactions in progress first, then
    FIFO. Users rank by `WeightedService.standing`, their counters; a user becoming active is
    placed among the active ones when it pushes (`WeightedService.place`: by its recent
    service, or with `half_life_s = 0`, the papers' rule, at the least active counter) —
    unless the call continues an interaction in progress: a user between the stages of an
    interaction is not idle, and placing it again would hand the interaction's next stage to
    the back of a flooding user's line at every stage. Ties go to the user with fewer calls
    running, so a lifted newcomer is not queued behind the user it was lifted to.

    A call continuing an interaction ranks its user no later than the standing the user had
    when the interaction's first call was dispatched (its anchor), for up to
    `interaction_credit` of service beyond it: the interaction was let in at that rank, and
    its later calls keep it. Ranked by the standing now, an interaction that has had more
    service than the ones started since waits behind all of them — least attained service
    first, which past capacity never reaches the biggest: Mixed Tree at 1.3x (4 seeds), the
    4-branch trees' leaves made up the whole slowest tenth, nearly all still queued at the
    end (TTFT p90 counting the unanswered 68.7 s against llm-d's 17.8; anchored 19.4). The
    credit bounds what one interaction, however long, takes at an old rank."""

    name = "wsc"

    def __init__(self, service: WeightedService | None = None,
                 in_progress: Callable[[RequestFacts, float], bool] | None = None, **_):
        super().__init__()
        self.service = service or WeightedService()
        self.in_progress = in_progress or mid_interaction
        self._by_user: dict[str, dict[QueueEntry, None]] = {}
        # Users by rank in a heap, stale items skipped when they surface: a user's key changes
        # only when its counter, its calls running (the service says: `_changed`) or its first
        # waiting entry do, so a peek re-ranks those, not every user queued (4,000 users
        # queued cost 5.9 ms per placement ranking them all; measured).
        self._ranks: list[tuple[tuple, str]] = []
        self._rank: dict[str, tuple] = {}
        self._changed = self.service.watch(self._by_user.__contains__)
        self._anchors: OrderedDict[str, float] = OrderedDict()  # interaction → its anchor, least recent first
        self._interactive: dict[str, dict[QueueEntry, None]] = {}  # user → its queued calls naming an interaction

    def push(self, entry: QueueEntry) -> None:
        super().push(entry)
        user = self.service.user_of(entry.facts)
        if user not in self._by_user:
            if not self.service.is_active(user) and not self.in_progress(entry.facts, entry.enqueued_at):
                self.service.place(user, self._active_newest_first(), entry.enqueued_at)
            self._by_user[user] = {}
        mine = self._by_user[user]
        last = next(reversed(mine), None)
        mine[entry] = None
        if last is not None and self._seq[entry] < self._seq[last]:  # a retry: back to its arrival place
            self._by_user[user] = dict.fromkeys(sorted(mine, key=self._seq.__getitem__))
        if interaction_of(entry.facts) is not None:
            self._interactive.setdefault(user, {})[entry] = None
        self._changed.add(user)  # a new user, or a retry at its head

    def _active_newest_first(self) -> Iterator[str]:
        """Users with work queued or running, the most recently active first, queued and
        running in turn (a placement reads the first few)."""
        pairs = itertools.zip_longest(reversed(self._by_user), reversed(self.service.inflight))
        return (u for pair in pairs for u in pair if u is not None)

    def remove(self, entry: QueueEntry) -> bool:
        if not super().remove(entry):
            return False
        user = self.service.user_of(entry.facts)
        del self._by_user[user][entry]
        calls = self._interactive.get(user)
        if calls is not None and calls.pop(entry, 1) is None and not calls:
            del self._interactive[user]
        if not self._by_user[user]:
            del self._by_user[user]
            self._rank.pop(user, None)  # its heap items are stale now
        else:
            self._changed.add(user)  # its first waiting entry may be another
        return True

    def dispatch(self, entry: QueueEntry) -> bool:
        """Take `entry` out to run it: charge its user's counter with the estimate."""
        if not self.remove(entry):
            return False
        self._anchor(entry.facts)
        self.service.charge(entry.facts)
        return True

    def _anchor(self, facts: RequestFacts) -> None:
        """An interaction's first dispatch sets its anchor: its user's counter before the
        charge. Kept for the `ANCHORS_KEPT` interactions dispatched to most recently (one
        forgotten just loses its credit). A call that names no interaction and continues none
        may start one (`interaction_key`: its own): it is anchored too, so its continuations,
        recognized by their prompts, rank where it was let in, as a declared interaction's
        do. Anchored from its second call on, a tree's first children ranked by their
        tenant's standing after the root's service, behind every tree started since: past
        capacity, with clients that send no headers nor max_tokens, ToT's TTFT p90 counting
        the requests still waiting was 2.6x llm-d's (a minute or more for a third of the
        leaves; docs/results.md)."""
        iid = interaction_key(facts)
        if iid is None or self.service.cfg.interaction_credit <= 0:
            return
        if iid in self._anchors:
            self._anchors.move_to_end(iid)
            return
        self._anchors[iid] = self.service.get(self.service.user_of(facts))
        if len(self._anchors) > ANCHORS_KEPT:
            self._anchors.popitem(last=False)

    def completed(self, facts: RequestFacts, input_tokens: int, output_tokens: int) -> None:
        self.service.complete(facts, input_tokens=input_tokens, output_tokens=output_tokens)

    def anchor(self, interaction: str | None) -> float | None:
        return self._anchors.get(interaction) if interaction is not None else None

    def heard_anchor(self, interaction: str, anchor: float) -> None:
        """The instance that dispatched the interaction's first call set its anchor (the service
        counters are shared, so it is a rank here too); an anchor of our own stays."""
        if self.service.cfg.interaction_credit > 0 and interaction not in self._anchors:
            self._anchors[interaction] = anchor
            if len(self._anchors) > ANCHORS_KEPT:
                self._anchors.popitem(last=False)

    def _user_key(self, user: str, now: float) -> tuple:
        # ties: the user with fewer calls running, then whose oldest waiting entry came first
        return (self._rank_of(user, now), self.service.inflight.get(user, 0),
                self._seq[next(iter(self._by_user[user]))])

    def _rank_of(self, user: str, now: float) -> float:
        """The user's standing, or its oldest waiting interaction's anchor where that is lower,
        by no more than the credit."""
        standing = self.service.standing(user, now)
        for entry in itertools.islice(self._interactive.get(user, ()), 16):  # the oldest few
            anchor = self._anchors.get(interaction_of(entry.facts))
            if anchor is not None and self.in_progress(entry.facts, now):
                return min(standing, max(anchor, standing - self.service.cfg.interaction_credit))
        return standing

    def _user_entries(self, user: str, now: float) -> list[QueueEntry]:
        entries = list(self._by_user[user])
        return [e for e in entries if self.in_progress(e.facts, now)] + [e for e in entries if not self.in_progress(e.facts, now)]

    def _rerank(self, now: float) -> list[tuple[tuple, str]]:
        """The heap, with the users whose rank changed since the last look re-ranked; its
        first item is current (stale ones surface and go)."""
        for user in self._changed:
            if user in self._by_user:
                key = self._user_key(user, now)
                if self._rank.get(user) != key:
                    self._rank[user] = key
                    heapq.heappush(self._ranks, (key, user))
        self._changed.clear()
        ranks = self._ranks
        while ranks and ranks[0][0] != self._rank.get(ranks[0][1]):  # re-ranked or gone since
            heapq.heappop(ranks)
        if len(ranks) > 2 * len(self._rank) + 16:  # stale items pile up: keep the heap small
            self._ranks = ranks = [(k, u) for u, k in self._rank.items()]
            heapq.heapify(ranks)
        return ranks

    def peek(self, now: float) -> QueueEntry | None:
        if not self._by_user:
            return None
        entries = self._by_user[self._rerank(now)[0][1]]
        return next((e for e in entries if self.in_progress(e.facts, now)), next(iter(entries)))

    def iter_in_order(self, now: float) -> Iterator[QueueEntry]:
        """Users in rank order, popped lazily from a copy of the heap: a pass that looks at the
        first few (the affinity window) pays O(log n) for each, not a sort of every user."""
        ranks = list(self._rerank(now))

        def users() -> Iterator[str]:
            seen = set()  # a key left and taken again leaves two items alike
            while ranks:
                key, user = heapq.heappop(ranks)
                if self._rank.get(user) == key and user not in seen:
                    seen.add(user)
                    yield user

        return self._walk(e for u in users() for e in self._user_entries(u, now))


class VTCQueue(WSCQueue):
    """VTC baseline: equal token service (no app/stage weights, no priority factors) and no
    preference for interactions in progress."""

    name = "vtc"

    def __init__(self, service: WeightedService | None = None, **_):
        super().__init__(service or WeightedService(VTC_CONFIG),
                         in_progress=lambda facts, now: False)


QUEUE_ORDERS: dict[str, Callable[..., QueueOrderBase]] = {
    q.name: q for q in (FCFSQueue, WSCQueue, VTCQueue, EDFQueue, PFQueue, DPAQueue, SRPTQueue)}


def make_queue(name: str, *, tiers: TierConfig | None = None, service: WeightedService | None = None,
               in_progress: Callable[[RequestFacts, float], bool] | None = None) -> QueueOrderBase:
    """The order called `name` in config, handed the context it uses (tier deadlines, the
    service counters it charges, the interaction ledger's in-progress test)."""
    if name not in QUEUE_ORDERS:
        raise ValueError(f"unknown queue order {name!r}; choose one of {', '.join(sorted(QUEUE_ORDERS))}")
    return QUEUE_ORDERS[name](tiers=tiers, service=service, in_progress=in_progress)
