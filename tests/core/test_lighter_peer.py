"""New work goes where there is room: a request with little of its prompt cached here, that a
local replica would take, moves to a peer region whose least-loaded replica carries at most
half that replica's load (lb.core.peering.lighter_peer, the scheduler's peer step). Real
scheduler, real prefix tries, time passed in."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lb.core.backlog import parse_advert
from lb.core.peering import PeerConfig, PeeringConfig, PeerRouter, PeerStatus
from lb.core.policies import make_policy
from lb.core.queueing import make_queue
from lb.core.scheduler import Kind, PeerSet, PeerTarget, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, ReplicaView, RequestFacts

NOW = 1000.0
CONTEXT = "a question and its first thoughts " * 100  # ~3,400 characters: many prefix blocks


class Rep:
    def __init__(self, rid: str, running: int):
        self.view = ReplicaView(id=rid, url="", engine="sglang", models=frozenset({"m"}), running=running)
        self.breaker = None


def advert(*loads: float) -> dict:
    return {"base_s": 0.05, "per_token_s": 0.0002, "error_s": 0.01, "ahead": [0.0] * len(loads), "load": list(loads)}


def status(region: str, loads: tuple, *, queue: int = 0, at: float = NOW) -> PeerStatus:
    st = PeerStatus(region)
    st.record_status({"healthy": True, "queue_len": queue, "free": {"m": len(loads)}, "models": ["m"],
                      "ttft": {"m": advert(*loads)}}, 0.15, at)
    return st


def peer_set(*, forward: str = "predicted", share: float = 0.5, allowed: tuple = (), **loads: tuple) -> PeerSet:
    r = PeerRouter("prefix-trie")
    targets = []
    for region, ls in loads.items():
        r.register(region)
        targets.append(PeerTarget(PeerConfig(region, f"http://{region}", allowed_residency=allowed),
                                  status(region, ls), ReplicaView(id=f"peer:{region}", url="", engine="peer",
                                                                  region=region), handle=region))
    return PeerSet(targets, r, tau=2, stale_s=1.0, forward=forward, lighter_share=share)


def scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(), make_policy("predicted-ttft"), make_queue("fcfs"))


def new(rid: str, residency: str | None = None) -> RequestFacts:
    return RequestFacts(rid, "m", prompt=f"an unrelated question {rid} " * 100, prompt_tokens=1000,
                        residency=residency)


def place(s: Scheduler, facts: RequestFacts, local: Rep, peers: PeerSet, seq: int = 1):
    s.admit(QueueEntry(facts, enqueued_at=NOW, seq=seq), NOW)
    (p,) = s.schedule(NOW, [local], peers)
    return p


def test_a_new_request_goes_to_a_peer_replica_carrying_under_half_the_local_load():
    """The local replica runs 20; eu's lightest runs 6, asia's 12: eu takes it."""
    p = place(scheduler(), new("r1"), Rep("a", running=20), peer_set(eu=(6, 9), asia=(12,)))
    assert (p.kind, p.target, p.reason) == (Kind.PEER, "eu", "peer-lighter")


def test_a_peer_over_half_the_local_load_or_a_light_local_replica_keeps_it_here():
    p = place(scheduler(), new("r1"), Rep("a", running=20), peer_set(eu=(11,)))
    assert (p.kind, p.target.view.id) == (Kind.REPLICA, "a")  # 11 > 20 / 2
    p = place(scheduler(), new("r2"), Rep("a", running=6), peer_set(eu=(3,)))
    assert (p.kind, p.target.view.id) == (Kind.REPLICA, "a")  # half, but 3 fewer: batches this close decode alike


def test_a_request_whose_context_is_cached_here_stays_with_it():
    s = scheduler()
    s.policy.observe(RequestFacts("root", "m", prompt=CONTEXT, prompt_tokens=850), "a", NOW)
    child = RequestFacts("c1", "m", prompt=CONTEXT + " thought 1", prompt_tokens=1000)
    p = place(s, child, Rep("a", running=20), peer_set(eu=(0,)))
    assert (p.kind, p.target.view.id) == (Kind.REPLICA, "a")


def test_our_forwards_the_peers_status_has_not_counted_make_it_heavier():
    """eu's lightest runs 7 and the local replica 20: four forwards take it to 10 (half of
    20); the fifth stays here."""
    s, local, ps = scheduler(), Rep("a", running=20), peer_set(eu=(7,))
    kinds = [place(s, new(f"r{i}"), local, ps, seq=i).kind for i in range(5)]
    assert kinds == [Kind.PEER] * 4 + [Kind.REPLICA]


def test_a_busy_stale_or_disallowed_peer_or_the_rule_turned_off_keeps_it_here():
    queued = peer_set(eu=(0,))
    queued.targets[0].status.queue_len = 3  # over tau (2)
    stale = peer_set(eu=(0,))
    stale.targets[0].status = status("eu", (0,), at=NOW - 5.0)
    for ps, facts in ((queued, new("q")), (stale, new("s")), (peer_set(allowed=("us",), eu=(0,)), new("t", "eu")),
                      (peer_set(forward="overflow", eu=(0,)), new("o")), (peer_set(share=0.0, eu=(0,)), new("z"))):
        p = place(scheduler(), facts, Rep("a", running=20), ps)
        assert (p.kind, p.target.view.id) == (Kind.REPLICA, "a"), facts.request_id


def test_a_request_forwarded_to_us_is_never_passed_on():
    facts = replace(new("r1"), hops=1)
    p = place(scheduler(), facts, Rep("a", running=20), peer_set(eu=(0,)))
    assert p.kind is Kind.REPLICA


def test_the_advert_carries_its_replicas_loads_least_first():
    s = scheduler()
    reps = [Rep("a", running=9), Rep("b", running=4)]
    for i in range(25):  # the backlog's fit needs samples before it advertises anything
        s.backlog.placed(f"w{i}", "a", 100.0 * (i + 1), NOW)
        s.backlog.first_token(f"w{i}", NOW + 0.05 + 0.001 * i)
    ad = s.advertise(reps, NOW + 1)
    assert ad["m"]["load"] == [4, 9]
    st = PeerStatus("eu")
    st.record_status({"healthy": True, "models": ["m"], "ttft": ad}, 0.1, NOW + 1)
    assert st.least_load("m") == 4 and st.least_load("other") is None


def test_a_malformed_or_missing_load_list_drops_the_loads_not_the_advert():
    for bad in ("7", [1, "x"], [1, -2], [float("nan")], None):
        parsed = parse_advert({**advert(1), "load": bad})
        assert parsed is not None and parsed["load"] == []
    assert parse_advert(advert(*range(40)))["load"] == list(range(16))  # bounded


def test_a_share_outside_0_to_1_is_a_config_error_naming_the_key():
    with pytest.raises(ValueError, match=r"peering.lighter_share: must be >= 0 and < 1"):
        PeeringConfig.from_dict({"lighter_share": 1.5})
    assert PeeringConfig.from_dict({"lighter_share": 0}).lighter_share == 0.0
