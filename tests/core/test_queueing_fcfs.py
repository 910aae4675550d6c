from __future__ import annotations

import pytest

from lb.core.queueing import QUEUE_ORDERS, FCFSQueue, StaticKeyQueue, make_queue
from lb.core.types import QueueEntry, RequestFacts


def entry(i: int, model: str = "m") -> QueueEntry:
    return QueueEntry(facts=RequestFacts(request_id=f"q{i}", model=model), enqueued_at=float(i), seq=i)


def test_fcfs_serves_in_arrival_order():
    q = make_queue("fcfs")
    es = [entry(i) for i in range(5)]
    for e in es:
        q.push(e)
    assert len(q) == 5 and list(q) == es
    assert q.peek(0.0) is es[0]
    assert [q.pop(0.0) for _ in range(5)] == es
    assert q.pop(0.0) is None and q.peek(0.0) is None


def test_same_facts_may_be_queued_twice_but_not_the_same_entry():
    q = FCFSQueue()
    facts = RequestFacts(request_id="dup", model="m")
    a, b = QueueEntry(facts, 0.0), QueueEntry(facts, 0.0)
    q.push(a)
    q.push(b)
    assert len(q) == 2
    with pytest.raises(ValueError):
        q.push(a)


def test_remove_from_the_middle():
    q = FCFSQueue()
    es = [entry(i) for i in range(4)]
    for e in es:
        q.push(e)
    assert q.remove(es[1]) is True
    assert q.remove(es[1]) is False
    assert list(q) == [es[0], es[2], es[3]] and es[1] not in q


def test_no_head_of_line_blocking_the_dispatcher_places_past_the_head():
    """The head's model has no free replica; entries behind it are placed in one pass."""
    q = FCFSQueue()
    es = [entry(0, "busy-model"), entry(1), entry(2, "busy-model"), entry(3)]
    for e in es:
        q.push(e)
    placed = []
    for e in q.iter_in_order(now=1.0):
        if e.facts.model != "busy-model":
            q.remove(e)  # removing while iterating is allowed
            placed.append(e)
    assert placed == [es[1], es[3]]
    assert list(q) == [es[0], es[2]]


def test_removed_entries_are_not_yielded_later_in_the_same_pass():
    q = FCFSQueue()
    es = [entry(i) for i in range(3)]
    for e in es:
        q.push(e)
    seen = []
    for e in q.iter_in_order(0.0):
        seen.append(e)
        q.remove(es[2])
    assert seen == es[:2]


def test_unknown_order_names_the_known_ones():
    with pytest.raises(ValueError, match="fcfs"):
        make_queue("lifo")
    assert "fcfs" in QUEUE_ORDERS


class ByDeadline(StaticKeyQueue):
    def key(self, e: QueueEntry) -> float:
        return e.facts.extra["deadline"]


def test_static_key_queue_orders_by_key_then_push_order_and_compacts():
    q = ByDeadline()
    es = [QueueEntry(RequestFacts(request_id=str(i), model="m", extra={"deadline": d}), 0.0) for i, d in enumerate([5, 1, 3, 1])]
    for e in es:
        q.push(e)
    assert list(q.iter_in_order(0.0)) == [es[1], es[3], es[2], es[0]]
    assert q.remove(es[3]) and not q.remove(es[3])
    assert q.pop(0.0) is es[1] and q.peek(0.0) is es[2] and len(q) == 2
    # removing many from the middle never lets the heap grow without bound
    for i in range(200):
        e = QueueEntry(RequestFacts(request_id=f"x{i}", model="m", extra={"deadline": 10 + i}), 0.0)
        q.push(e)
        q.remove(e)
    assert len(q._heap) <= 2 * len(q) + 17
