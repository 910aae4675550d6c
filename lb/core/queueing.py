"""The LB queue. With selective pushing requests wait here, so this order *is* the schedule.

Every order implements `QueueOrder` (push / pop / peek / remove / len / iter) plus
`iter_in_order(now)`, which the dispatcher walks to take the first entry it can place: a
head whose model has no free replica must not block the entries behind it. Orders register
by config name in `QUEUE_ORDERS`; `make_queue(name, **options)` builds one.

Two bases to extend from:
  FCFSQueue       arrival order, O(1) per operation (an OrderedDict is a linked hash list).
  StaticKeyQueue  smallest `key(entry)` first, key fixed at push (EDF deadlines, PF tiers):
                  a heap with lazy deletion, O(log n) push/pop and O(1) remove.
Orders whose keys move while entries wait (service counters, urgency classes) override
`iter_in_order`/`pop` themselves.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Iterator

from lb.core.types import QueueEntry, RequestFacts


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

    def __init__(self) -> None:
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


QUEUE_ORDERS: dict[str, Callable[..., QueueOrderBase]] = {"fcfs": FCFSQueue}


def make_queue(name: str, **options) -> QueueOrderBase:
    if name not in QUEUE_ORDERS:
        raise ValueError(f"unknown queue order {name!r}; choose one of {', '.join(sorted(QUEUE_ORDERS))}")
    return QUEUE_ORDERS[name](**options)

# The fair and SLO-aware orders (wsc, vtc, edf, pf, dpa, srpt) register themselves here.
from lb.core import orders as _orders  # noqa: E402,F401  (import cycle by design: after QUEUE_ORDERS)
