"""The NIW deferred queue: capacity-driven release (60%/50%), promotion by age/deadline."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lb.core.deferred import (DeferredConfig, DeferredQueue, effective_kv_utilization, from_record,
                              to_record)
from lb.core.tiers import TierConfig, TierTarget
from lb.core.types import QueueEntry, ReplicaView, RequestFacts, Tier

TIERS = TierConfig(targets={Tier.IW_F: TierTarget(1, 10), Tier.IW_N: TierTarget(5, 60),
                            Tier.NIW: TierTarget(3600, 3600)})
CFG = DeferredConfig(promote_after_s=1800, deadline_margin_s=300)


def niw(rid: str, t: float) -> QueueEntry:
    return QueueEntry(RequestFacts(request_id=rid, model="m", arrival=t, tier=Tier.NIW), t)


def ids(releases) -> list[str]:
    return [r.entry.facts.request_id for r in releases]


def test_releases_one_below_60_two_below_50_none_above():
    q = DeferredQueue(CFG, TIERS)
    for i in range(6):
        q.push(niw(f"r{i}", t=float(i)))
    assert q.release(10.0, 0.75) == []
    assert q.release(10.0, 0.60) == []  # "below", not at
    assert ids(q.release(10.0, 0.55)) == ["r0"]
    assert ids(q.release(10.0, 0.30)) == ["r1", "r2"]
    assert len(q) == 3 and all(not r.promoted for r in q.release(10.0, 0.49))


def test_earliest_deadline_first():
    q = DeferredQueue(CFG, TIERS)
    q.push(niw("late", t=100.0))
    q.push(niw("early", t=50.0))
    assert ids(q.release(120.0, 0.0)) == ["early", "late"]


def test_promotion_by_age_or_near_deadline_releases_regardless_of_load():
    q = DeferredQueue(DeferredConfig(promote_after_s=1800, deadline_margin_s=300), TIERS)
    q.push(old := niw("old", t=0.0))
    q.push(niw("young", t=1000.0))
    assert q.release(1799.0, 0.99) == []
    out = q.release(1800.0, 0.99)
    assert [(r.entry, r.promoted) for r in out] == [(old, True)]
    # deadline 1000+3600=4600; within 300 s of it at 4300, before its age (1800 s) would promote it
    q2 = DeferredQueue(DeferredConfig(promote_after_s=10_000, deadline_margin_s=300), TIERS)
    q2.push(niw("young", t=1000.0))
    assert q2.release(4299.0, 0.99) == [] and ids(q2.release(4300.0, 0.99)) == ["young"]


def test_remove_and_bounds():
    q = DeferredQueue(DeferredConfig(max_entries=2), TIERS)
    a, b = niw("a", 0), niw("b", 1)
    q.push(a)
    q.push(b)
    with pytest.raises(OverflowError):
        q.push(niw("c", 2))
    with pytest.raises(ValueError):
        q.push(a)
    assert q.remove(a) and not q.remove(a) and list(q) == [b]
    assert ids(q.release(5.0, 0.0)) == ["b"] and len(q) == 0


def test_effective_utilization_counts_waiting_replicas_as_full():
    reps = [ReplicaView("a", "u", kv_usage=0.2), ReplicaView("b", "u", kv_usage=0.4),
            ReplicaView("c", "u", kv_usage=0.1, pending=3), ReplicaView("d", "u", healthy=False, kv_usage=0.0)]
    assert effective_kv_utilization(reps) == pytest.approx((0.2 + 0.4 + 1.0) / 3)
    assert effective_kv_utilization([]) == 1.0


def test_records_round_trip_through_json():
    e = QueueEntry(RequestFacts(request_id="r", model="m", prompt="hi", prompt_tokens=1, arrival=3.0, tier=Tier.NIW,
                                user="u", interaction_id="i", interaction_stage=2), 3.0, seq=7)
    back = from_record(json.loads(json.dumps(to_record(e))), payload=b"{}")
    assert back.facts == e.facts and back.enqueued_at == 3.0 and back.seq == 7 and back.payload == b"{}"


def test_config_validation():
    assert DeferredConfig.from_dict({"promote_after_s": 60}).promote_after_s == 60
    for bad in ({"release_one_below": 0.4, "release_two_below": 0.5}, {"promote_after_s": -1}, {"nope": 1}):
        with pytest.raises(ValueError, match="deferred"):
            DeferredConfig.from_dict(bad)


def test_a_replica_the_pushing_mode_would_not_push_to_counts_as_full():
    from lb.core.deferred import effective_kv_utilization
    from lb.core.types import ReplicaView

    views = [ReplicaView("a", "u", kv_usage=0.2), ReplicaView("b", "u", kv_usage=0.2, running=8)]
    assert effective_kv_utilization(views) == pytest.approx(0.2)
    assert effective_kv_utilization(views, available=lambda v: v.running < 8) == pytest.approx(0.6)


def test_a_release_round_hands_out_nothing_while_the_lb_queue_holds_work():
    q = DeferredQueue(CFG, TIERS)
    for i in range(3):
        q.push(niw(f"r{i}", t=float(i)))
    idle = [ReplicaView("a", "u", kv_usage=0.1)]
    assert q.release_round(10.0, queued=1, replicas=idle, available=lambda v: True) == []  # no spare capacity
    assert ids(q.release_round(10.0, queued=0, replicas=idle, available=lambda v: True)) == ["r0", "r1"]
    assert q.release_round(10.0, queued=0, replicas=idle, available=lambda v: False) == []  # nothing would take it
    # a deadline near is released whatever the load
    assert ids(q.release_round(3600.0 - 200.0, queued=5, replicas=idle, available=lambda v: False)) == ["r2"]


class _ScanAll(DeferredQueue):
    """The promotion rule read off every entry, as a round did before: the reference."""

    def _promoted_now(self, now):
        return [e for e in self.iter_in_order(now) if self.promoted(e, now)]


@given(st.lists(st.tuples(st.sampled_from(["push", "push", "remove", "pop", "release"]),
                          st.floats(0, 50), st.floats(0, 100), st.integers(0, 10 ** 6)), max_size=80))
@settings(max_examples=150, deadline=None)
def test_a_round_finds_the_promoted_by_their_heaps_exactly_as_a_full_scan(ops):
    """Deadline promotions are a prefix of the deadline heap, age promotions of the age heap:
    a round that reads only those prefixes releases what a scan of every entry releases, in
    the same order, whatever the pushes (arrival and queueing times apart, as for a job read
    back from its journal), removals and clock."""
    tiers = TierConfig(targets={Tier.NIW: TierTarget(10.0, 60.0)})
    cfg = DeferredConfig(promote_after_s=30.0, deadline_margin_s=20.0)
    fast, ref = DeferredQueue(cfg, tiers), _ScanAll(cfg, tiers)
    now, pushed = 0.0, []
    for i, (op, arrival_ago, step, pick) in enumerate(ops):
        now += step / 10
        if op == "push":
            facts = RequestFacts(request_id=f"r{i}", model="m", tier=Tier.NIW, arrival=now - arrival_ago)
            entry, twin = QueueEntry(facts, now, i, None), QueueEntry(facts, now, i, None)
            fast.push(entry), ref.push(twin)
            pushed.append((entry, twin))
        elif op == "remove" and pushed:
            entry, twin = pushed[pick % len(pushed)]
            assert fast.remove(entry) == ref.remove(twin)
        elif op == "pop":
            a, b = fast.pop(now), ref.pop(now)
            assert (a and a.facts.request_id) == (b and b.facts.request_id)
        else:
            util = (pick % 100) / 100
            got, want = fast.release(now, util), ref.release(now, util)
            assert [(r.entry.facts.request_id, r.promoted) for r in got] == \
                   [(r.entry.facts.request_id, r.promoted) for r in want]
        assert len(fast) == len(ref)


def test_a_round_with_nothing_due_looks_at_no_entry_beyond_the_first_of_each_heap():
    q = DeferredQueue()
    for i in range(2000):
        q.push(QueueEntry(RequestFacts(request_id=f"r{i}", model="m", tier=Tier.NIW, arrival=float(i)), float(i), i, None))
    looked = []
    q.promoted = lambda e, now: looked.append(e) or False  # the per-entry rule is not consulted
    q.iter_in_order = lambda now: iter(looked.append("scan") or ())
    assert q.release(2000.0, 0.9) == [] and looked == []


def test_entries_promoted_by_age_leave_in_deadline_order_not_age_order():
    tiers = TierConfig(targets={Tier.NIW: TierTarget(10.0, 60.0)})
    q = DeferredQueue(DeferredConfig(promote_after_s=30.0, deadline_margin_s=5.0), tiers)
    late = QueueEntry(RequestFacts(request_id="late-deadline", model="m", tier=Tier.NIW, arrival=10.0), 0.0)
    soon = QueueEntry(RequestFacts(request_id="sooner-deadline", model="m", tier=Tier.NIW, arrival=5.0), 1.0)
    q.push(late), q.push(soon)  # queued in that order (a job read back from its journal keeps its arrival)
    assert ids(q.release(40.0, 0.9)) == ["sooner-deadline", "late-deadline"]  # both by age, deadlines 65 and 70


def test_the_entries_held_per_model_are_counted_as_they_come_and_go():
    q = DeferredQueue(CFG, TIERS)
    a, b, c = niw("a", 0), niw("b", 1), QueueEntry(RequestFacts(request_id="c", model="other", arrival=2,
                                                                 tier=Tier.NIW), 2)
    for e in (a, b, c):
        q.push(e)
    assert q.by_model() == {"m": 2, "other": 1}
    q.remove(b), q.pop(0.0)
    assert q.by_model() == {"other": 1} and len(q) == 1
    q.release(10_000.0, 0.0)  # promoted or released by capacity: gone from the count too
    assert q.by_model() == {} and len(q) == 0
