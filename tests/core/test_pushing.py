from __future__ import annotations

import pytest

from lb.core.pushing import is_available, probe_gap
from lb.core.types import Pushing, ReplicaView


def view(**kw) -> ReplicaView:
    return ReplicaView(id=kw.pop("id", "r"), url="http://127.0.0.1:1", **kw)


@pytest.mark.parametrize("mode", list(Pushing))
def test_unhealthy_or_draining_is_never_available(mode):
    assert not is_available(view(healthy=False), mode)
    assert not is_available(view(draining=True), mode)
    assert is_available(view(), mode)


def test_sp_pending_needs_no_pending_and_credit_left():
    assert not is_available(view(pending=1), Pushing.SP_PENDING)
    assert is_available(view(pending=0, running=50, outstanding=500), Pushing.SP_PENDING)
    assert is_available(view(pushed_since_probe=3), "sp-pending", push_credit=4)
    assert not is_available(view(pushed_since_probe=4), "sp-pending", push_credit=4)


def test_sp_pending_falls_back_to_outstanding_for_plain_openai_servers():
    plain = dict(engine="openai", reports_pending=False)
    assert is_available(view(outstanding=7, **plain), Pushing.SP_PENDING, max_outstanding=8)
    assert not is_available(view(outstanding=8, **plain), Pushing.SP_PENDING, max_outstanding=8)
    # no probe ever sees such a server, so pushes since a probe must not lock it out
    assert is_available(view(outstanding=0, pushed_since_probe=99, **plain), Pushing.SP_PENDING)


def test_sp_outstanding_ignores_pending_and_caps_outstanding():
    assert is_available(view(pending=9, outstanding=3), Pushing.SP_OUTSTANDING, max_outstanding=4)
    assert not is_available(view(outstanding=4), Pushing.SP_OUTSTANDING, max_outstanding=4)


def test_blind_pushes_to_any_healthy_replica():
    assert is_available(view(pending=100, outstanding=1000, pushed_since_probe=50), Pushing.BLIND)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError):
        is_available(view(), "push-harder")


def test_burst_onto_idle_replicas_spreads_and_never_stalls():
    """100 requests onto 4 idle replicas: each round places at most push_credit per replica;
    an early re-probe (pending still 0) restores credit, so the burst drains in rounds."""
    views = [view(id=f"r{i}") for i in range(4)]
    placed, rounds = {v.id: 0 for v in views}, 0
    remaining = 100
    while remaining:
        rounds += 1
        progressed = False
        for v in views:
            while remaining and is_available(v, "sp-pending", push_credit=4):
                v.pushed_since_probe += 1
                placed[v.id] += 1
                remaining -= 1
                progressed = True
        assert progressed, "stalled"
        for v in views:
            if v.pushed_since_probe:
                v.pushed_since_probe = 0  # the early re-probe after a push saw the new ones running
    assert sum(placed.values()) == 100
    assert max(placed.values()) - min(placed.values()) <= 4  # no pile-up beyond one credit
    assert rounds == 7  # ceil(100 / (4 replicas * 4 credit))


def test_an_idle_replica_with_a_clean_record_is_probed_less_often():
    def gap(view, idle_intervals=5, health_steady=True, models_known=True):
        return probe_gap(view, 0.1, idle_intervals, health_steady=health_steady, models_known=models_known)
    idle = ReplicaView(id="a", url="", engine="sglang")
    assert gap(idle) == pytest.approx(0.5)
    assert gap(idle, idle_intervals=1) == pytest.approx(0.1)  # idle_intervals = 1: as before
    assert gap(idle, health_steady=False) == 0.1  # a failed probe or health in doubt: fast
    assert gap(idle, models_known=False) == 0.1  # its models not yet read
    assert gap(ReplicaView(id="a", url="", engine="auto")) == 0.1  # its engine not yet detected
    for busy in (ReplicaView(id="a", url="", engine="sglang", outstanding=1),  # this LB's request on it
                 ReplicaView(id="a", url="", engine="sglang", running=3),  # another client's batch, seen by the last probe
                 ReplicaView(id="a", url="", engine="sglang", pending=2)):
        assert gap(busy) == 0.1
