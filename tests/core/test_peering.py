"""Peering decisions: availability, Algorithm 1, residency, peer choice, adoption, config."""
from __future__ import annotations

import pytest

from lb.core.peering import (PeerConfig, PeeringConfig, PeerRouter, PeerStatus, adoption_action, apply_peer_args,
                             fresh_for, local_or_peer, peer_available, peers_from_list, probe_timeout,
                             residency_allows)
from lb.core.types import RequestFacts

NOW = 100.0
STALE = 0.3


def status(region: str, *, free: int = 1, queue: int = 0, healthy: bool = True, rtt: float = 0.05,
           age: float = 0.0) -> PeerStatus:
    st = PeerStatus(region)
    st.record_status({"healthy": healthy, "queue_len": queue, "free": {"m": free} if free else {}, "models": ["m"]},
                     rtt, NOW - age)
    return st


def req(prompt: str = "p" * 400, **kw) -> RequestFacts:
    return RequestFacts(request_id=kw.pop("rid", "r"), model="m", prompt=prompt, **kw)


def test_availability_needs_fresh_healthy_free_replica_and_short_queue():
    assert peer_available(status("eu"), "m", tau=2, now=NOW, stale_s=STALE)
    assert not peer_available(status("eu", free=0), "m", tau=2, now=NOW, stale_s=STALE)
    assert not peer_available(status("eu", queue=3), "m", tau=2, now=NOW, stale_s=STALE)
    assert peer_available(status("eu", queue=2), "m", tau=2, now=NOW, stale_s=STALE)
    assert not peer_available(status("eu", healthy=False), "m", tau=2, now=NOW, stale_s=STALE)
    assert not peer_available(status("eu", age=0.5), "m", tau=2, now=NOW, stale_s=STALE)  # stale
    assert not peer_available(status("eu"), "other-model", tau=2, now=NOW, stale_s=STALE)
    st = status("eu", free=1)
    st.forwarded_since_status = 1  # we already used its one free replica
    assert not peer_available(st, "m", tau=2, now=NOW, stale_s=STALE)


def test_algorithm_1_local_then_peer_then_wait_and_never_twice():
    pcs = [(PeerConfig("eu", "http://eu"), status("eu"))]
    router = PeerRouter("nearest")
    kw = dict(router=router, tau=2, now=NOW, stale_s=STALE)
    assert local_or_peer(req(), local_available=True, peers=pcs, **kw).kind == "local"
    assert local_or_peer(req(), local_available=False, peers=pcs, **kw).region == "eu"
    assert local_or_peer(req(hops=1), local_available=False, peers=pcs, **kw).kind == "wait"
    full = [(PeerConfig("eu", "http://eu"), status("eu", free=0))]
    assert local_or_peer(req(), local_available=False, peers=full, **kw).kind == "wait"
    assert local_or_peer(req(), local_available=False, peers=pcs, exclude=frozenset({"eu"}), **kw).kind == "wait"


def test_residency_tags_only_go_where_allowed():
    assert residency_allows(None, ())
    assert not residency_allows("eu", ())
    assert residency_allows("eu", ("eu",)) and residency_allows("eu", ("*",))
    pcs = [(PeerConfig("us", "http://us"), status("us", rtt=0.01)),
           (PeerConfig("eu", "http://eu", allowed_residency=("eu",)), status("eu", rtt=0.2))]
    d = local_or_peer(req(residency="eu"), local_available=False, peers=pcs, router=PeerRouter("nearest"), tau=2,
               now=NOW, stale_s=STALE)
    assert (d.kind, d.region, d.residency_blocked) == ("peer", "eu", ("us",))
    d = local_or_peer(req(), local_available=False, peers=pcs, router=PeerRouter("nearest"), tau=2, now=NOW, stale_s=STALE)
    assert d.region == "us" and d.residency_blocked == ()


def test_snapshot_trie_keeps_a_prefix_with_the_region_it_was_sent_to():
    router = PeerRouter("prefix-trie")
    peers = [status("eu"), status("asia")]
    conversation = "system: long shared context " * 40
    first = router.choose(req(conversation), peers, NOW)
    router.observe(req(conversation), first, NOW)
    for _ in range(10):
        assert router.choose(req(conversation + " next turn"), peers, NOW) == first


def test_consistent_hash_and_nearest():
    ring = PeerRouter("consistent-hash")
    for r in ("eu", "asia", "us"):
        ring.register(r)
    peers = [status("eu"), status("asia"), status("us")]
    picks = {ring.choose(req(session=f"s{i}"), peers, NOW) for i in range(50)}
    assert len(picks) > 1
    assert ring.choose(req(session="s1"), peers, NOW) == ring.choose(req(session="s1"), peers, NOW)
    near = PeerRouter("nearest")
    assert near.choose(req(), [status("eu", rtt=0.2), status("asia", rtt=0.05)], NOW) == "asia"


def test_adoption_after_grace_and_give_back():
    pc = PeerConfig("eu", "http://eu", adopt=True)
    st = status("eu")
    assert adoption_action(pc, st, False, now=NOW, grace_s=5) is None
    st.record_failure(NOW)
    assert adoption_action(pc, st, False, now=NOW + 4, grace_s=5) is None
    assert adoption_action(pc, st, False, now=NOW + 5, grace_s=5) == "adopt"
    assert adoption_action(PeerConfig("eu", "http://eu"), st, False, now=NOW + 9, grace_s=5) is None
    assert adoption_action(pc, st, True, now=NOW + 9, grace_s=5) is None  # still down: keep them
    st.record_status({"healthy": True}, 0.01, NOW + 10)
    assert adoption_action(pc, st, True, now=NOW + 10, grace_s=5) == "give-back"


def test_config_parsing_and_cli_overrides():
    peers = peers_from_list([{"region": "eu", "url": "http://eu:8080/", "allowed_residency": ["eu"], "adopt": True}])
    assert peers == (PeerConfig("eu", "http://eu:8080", ("eu",), True),)
    with pytest.raises(ValueError, match=r"peers\[0\].url"):
        peers_from_list([{"region": "eu", "url": "eu:8080"}])
    with pytest.raises(ValueError, match=r"peering.tau"):
        PeeringConfig.from_dict({"tau": -1})
    with pytest.raises(ValueError, match=r"peering.policy"):
        PeeringConfig.from_dict({"policy": "random"})
    assert PeeringConfig.from_dict({"probe_interval_s": 1}).probe_interval_s == 1.0
    peering, merged = apply_peer_args(PeeringConfig(), peers, "us", ["eu=http://eu2:1", "asia=http://asia:1"])
    assert peering.region == "us"
    assert merged == (PeerConfig("eu", "http://eu2:1", ("eu",), True), PeerConfig("asia", "http://asia:1"))
    with pytest.raises(ValueError, match="NAME=URL"):
        apply_peer_args(PeeringConfig(), (), None, ["eu"])


def test_probe_timeout_follows_the_link_rtt_with_floor_backoff_and_cap():
    pc = PeeringConfig()  # floor 0.1 s, 3 RTTs, cap 2 s
    assert probe_timeout(pc, None) == pc.probe_timeout_max_s  # nothing measured: the first probe may take the cap
    assert probe_timeout(pc, 0.0005) == pytest.approx(0.1)  # LAN: the floor, a hung peer still fails fast
    assert probe_timeout(pc, 0.3) == pytest.approx(0.9)  # 150 ms each way: well above the 0.1 s of old
    assert probe_timeout(pc, 0.3, failures=1) == pytest.approx(1.8)  # a link that got slower is measured again
    assert probe_timeout(pc, 0.3, failures=5) == pc.probe_timeout_max_s
    assert probe_timeout(pc, 5.0) == pc.probe_timeout_max_s
    st = PeerStatus("eu")  # the EWMA the daemon feeds: failures count up, a good status resets them
    st.record_failure(NOW)
    st.record_failure(NOW)
    assert st.failures == 2
    st.record_status({"healthy": True, "models": ["m"]}, 0.3, NOW)
    assert st.failures == 0 and probe_timeout(pc, st.rtt_s, st.failures) == pytest.approx(0.9)


def test_a_slow_link_keeps_its_status_fresh_for_several_round_trips():
    pc = PeeringConfig()  # 0.1 s interval, 3 intervals
    assert fresh_for(pc, 0.001) == pytest.approx(0.3)
    assert fresh_for(pc, 0.3) == pytest.approx(0.9)  # one probe cycle is one round trip
    st = status("asia", rtt=0.3, age=0.5)
    assert not peer_available(st, "m", tau=2, now=NOW, stale_s=STALE)  # judged at LAN cycles: stale
    st.fresh_s = fresh_for(pc, st.rtt_s)
    assert peer_available(st, "m", tau=2, now=NOW, stale_s=STALE)


def test_probe_timeout_cap_below_its_floor_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="probe_timeout_max_s"):
        PeeringConfig.from_dict({"probe_timeout_s": 3.0})
