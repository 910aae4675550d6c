"""The NIW deferred queue: capacity-driven release (60%/50%), promotion by age/deadline."""
from __future__ import annotations

import json

import pytest

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
