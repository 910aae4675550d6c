"""Prefill work ahead and the TTFT it predicts (lb.core.backlog), and forwarding by predicted
TTFT (lb.core.peering.predicted_peer, the scheduler's peer step). Time is passed in."""
from __future__ import annotations

import math

from lb.core.backlog import MAX_REMOTE, MIN_SAMPLES, Backlog, parse_advert, remote_ttft
from lb.core.peering import PeerConfig, PeeringConfig, PeerRouter, PeerStatus, predicted_peer
from lb.core.policies import make_policy
from lb.core.queueing import make_queue
from lb.core.scheduler import Kind, PeerSet, PeerTarget, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, ReplicaView, RequestFacts

import pytest

NOW = 1000.0
BASE, PER_TOKEN = 0.1, 0.0005  # the "engine" the tests' samples come from


def trained(samples: int = 3 * MIN_SAMPLES) -> Backlog:
    """A backlog that has seen first tokens from an engine with TTFT = BASE + PER_TOKEN × work."""
    b = Backlog()
    t = 0.0
    for i in range(samples):
        ahead = (i * 997) % 6000  # work already ahead on the replica when it was pushed
        b.placed(f"warm-ahead-{i}", "x", ahead, t)
        b.placed(f"warm-{i}", "x", 500, t)
        b.first_token(f"warm-{i}", t + BASE + PER_TOKEN * (ahead + 500))
        b.ended(f"warm-ahead-{i}")
        t += 10
    return b


def test_work_ahead_counts_pushes_until_their_first_token_or_end():
    b = Backlog()
    b.placed("a", "r1", 1000, NOW)
    b.placed("b", "r1", 300, NOW)
    b.placed("c", "r2", 50, NOW)
    assert b.ahead == {"r1": 1300, "r2": 50} and b.ahead_count == {"r1": 2, "r2": 1}
    b.first_token("a", NOW + 1)
    b.ended("c")
    assert b.ahead == {"r1": 300} and b.ahead_count == {"r1": 1}
    b.placed("b", "r2", 300, NOW + 2)  # a retry elsewhere replaces its first push
    assert b.ahead == {"r2": 300} and b.ahead_count == {"r2": 1}
    b.placed("d", "r2", 0, NOW + 2)  # fully cached: no tokens, still one push waiting there
    assert b.ahead == {"r2": 300} and b.ahead_count == {"r2": 2}
    b.placed("e", "r3", 10, NOW, expires_at=NOW + 1)  # not streamed: until its assumed prefill end
    b.expire(NOW + 1)
    assert "r3" not in b.ahead_count
    b.forget("r2")
    assert b.ahead == {} and b.ahead_count == {} and not b._open


def test_tracking_is_bounded():
    b = Backlog(max_tracked=3)
    for i in range(10):
        b.placed(f"r{i}", "x", 100, NOW)
    assert len(b._open) == 3 and b.ahead == {"x": 300}


def test_the_fit_learns_the_engine_from_first_tokens_and_predicts_from_work_ahead():
    b = Backlog()
    assert b.predict("x", 500) is None  # nothing learned: no prediction, no forwarding on it
    b = trained()
    base, per_token = b.fit()
    assert base == pytest.approx(BASE, rel=1e-3) and per_token == pytest.approx(PER_TOKEN, rel=1e-3)
    b.placed("q", "x", 4000, NOW)
    assert b.predict("x", 1000) == pytest.approx(BASE + PER_TOKEN * 5000, rel=1e-3)
    assert b.predict("idle", 1000) == pytest.approx(BASE + PER_TOKEN * 1000, rel=1e-3)
    assert b.error_s < 1e-3  # the samples lie on the line: predictions hit them


def test_error_is_measured_out_of_sample():
    b = trained()
    b.placed("slow", "x", 500, NOW)
    b.first_token("slow", NOW + BASE + PER_TOKEN * 500 + 2.0)  # 2 s later than predicted
    assert b.error_s == pytest.approx(0.02 * 2.0, rel=0.05)  # one EW sample (alpha 0.02) of a 2 s miss


def test_advert_lists_the_least_work_first_and_is_bounded():
    b = trained()
    for i, (target, tokens) in enumerate([("r1", 3000), ("r2", 100), ("r3", 900)]):
        b.placed(f"p{i}", target, tokens, NOW)
    ad = b.advert(["r1", "r2", "r3", "r4"])
    assert ad["ahead"] == [0, 100, 900, 3000]
    assert len(b.advert([f"r{i}" for i in range(40)])["ahead"]) == 16
    assert Backlog().advert(["r1"]) is None


def test_remote_prediction_adds_our_unseen_forwards_to_its_least_loaded_replicas():
    ad = {"base_s": 0.1, "per_token_s": 0.001, "error_s": 0.0, "ahead": [0, 500]}
    assert remote_ttft(ad, 100) == pytest.approx(0.1 + 0.1)
    assert remote_ttft(ad, 100, [300]) == pytest.approx(0.1 + 0.001 * (300 + 100))  # 300 on the idle one
    assert remote_ttft(ad, 100, [300, 300]) == pytest.approx(0.1 + 0.001 * (500 + 100))  # both now hold work
    assert remote_ttft({**ad, "ahead": []}, 100) is None


@pytest.mark.parametrize("bad", [None, [], {"ahead": "x"}, {"base_s": -1, "ahead": [1]},
                                 {"per_token_s": math.nan, "ahead": [1]}, {"ahead": [1, "a"]},
                                 {"ahead": [-5]}])
def test_a_malformed_advert_is_ignored(bad):
    assert parse_advert(bad) is None


def test_a_long_advert_is_cut():
    assert len(parse_advert({"base_s": 0, "per_token_s": 0, "ahead": list(range(10**5))})["ahead"]) == 16


# -- the decision -------------------------------------------------------------------------

def peer_status(region: str, *, ahead=(0,), rtt: float = 0.15, queue: int = 0, error: float = 0.05,
                age: float = 0.0) -> PeerStatus:
    st = PeerStatus(region)
    st.record_status({"healthy": True, "queue_len": queue, "free": {"m": len(ahead)}, "models": ["m"],
                      "ttft": {"m": {"base_s": BASE, "per_token_s": PER_TOKEN, "error_s": error,
                                     "ahead": list(ahead)}}}, rtt, NOW - age)
    return st


def facts(**kw) -> RequestFacts:
    return RequestFacts(kw.pop("rid", "r"), "m", prompt_tokens=kw.pop("tokens", 1000), **kw)


def decide(local_ttft: float, peers, **kw):
    kw.setdefault("local_error", 0.05)
    return predicted_peer(kw.pop("req", facts()), local_ttft=local_ttft, peers=peers, router=PeerRouter("nearest"),
                          tau=2, now=NOW, stale_s=0.3, **kw)


def test_forward_when_the_peer_plus_the_round_trip_wins_by_the_margin():
    eu = [(PeerConfig("eu", "http://eu"), peer_status("eu"))]
    remote = 0.15 + BASE + PER_TOKEN * 1000  # 0.75 s
    margin = math.hypot(0.05, 0.05)
    assert decide(remote + margin + 0.01, eu).region == "eu"
    assert decide(remote + margin - 0.01, eu).kind == "local"  # within the predictions' error: stay
    assert decide(remote + margin + 0.01, eu, margin_s=0.05).kind == "local"  # an operator's extra margin
    assert decide(5.0, eu, req=facts(hops=1)).kind == "local"  # already forwarded once: never again


def test_only_fresh_short_queued_peers_offering_a_replica_and_allowed_by_residency():
    def only(st, pc=None):
        return [(pc or PeerConfig(st.region, "http://x"), st)]
    assert decide(5.0, only(peer_status("eu", age=1.0))).kind == "local"  # stale status
    assert decide(5.0, only(peer_status("eu", queue=3))).kind == "local"  # its own queue is over tau
    assert decide(5.0, only(peer_status("eu", ahead=()))).kind == "local"  # no replica takes one there
    d = decide(5.0, only(peer_status("eu"), PeerConfig("eu", "http://eu", allowed_residency=("eu",))),
               req=facts(residency="us"))
    assert d.kind == "local" and d.residency_blocked == ("eu",)
    assert decide(5.0, only(peer_status("eu"), PeerConfig("eu", "http://eu", allowed_residency=("us",))),
                  req=facts(residency="us")).region == "eu"


def test_our_own_unseen_forwards_close_the_gap():
    st = peer_status("eu", ahead=(0,))
    eu = [(PeerConfig("eu", "http://eu"), st)]
    sent = 0
    while decide(3.0, eu).kind == "peer":
        st.forwarded(NOW, "m", 1000)
        sent += 1
        assert sent < 50
    # 3.0 s local vs 0.15 + 0.1 + 0.0005 x (1000 x sent + 1000) + 0.07 margin: wins while sent < 4.36
    assert sent == 5
    st.record_status({"healthy": True, "queue_len": 0, "models": ["m"], "ttft": {
        "m": {"base_s": BASE, "per_token_s": PER_TOKEN, "error_s": 0.05, "ahead": [5000]}}}, 0.15, NOW + 1,
        sent_at=NOW - 1)  # a probe sent before our forwards: they are still unseen by it
    assert len(st.unseen) == 5
    st.record_status({"healthy": True, "queue_len": 0, "models": ["m"]}, 0.15, NOW + 2, sent_at=NOW + 1)
    assert not st.unseen and st.ttft == {}  # this one saw them (and offers no prediction)


def test_a_peer_holding_the_prefix_is_predicted_for_what_it_would_compute():
    """A tree whose root went to eu: its next call is a cache hit there, not a full prefill."""
    router = PeerRouter("prefix-trie")
    for region in ("eu", "asia"):
        router.register(region)
    context = "a question and its first thoughts " * 100  # ~3,400 characters
    router.observe(RequestFacts("root", "m", prompt=context, prompt_tokens=850), "eu", NOW)
    child = RequestFacts("child", "m", prompt=context + " one more thought", prompt_tokens=1000)
    remote = router.uncached(child)
    assert remote["asia"] == 1000 and remote["eu"] < 200  # eu holds the context
    peers = [(PeerConfig(r, f"http://{r}"), peer_status(r)) for r in ("eu", "asia")]
    local = 0.15 + BASE + PER_TOKEN * 500 + 0.1  # half the prompt cached here: under a full prefill there
    kw = dict(local_ttft=local, local_error=0.05, peers=peers, router=router, tau=2, now=NOW, stale_s=0.3)
    assert predicted_peer(child, **kw).kind == "local"  # as a full prefill no peer wins
    d = predicted_peer(child, remote_tokens=remote, **kw)
    assert (d.kind, d.region) == ("peer", "eu")  # as the cache hit it is, eu does
    assert PeerRouter("nearest").uncached(child) == {}  # no regions registered, nothing remembered


def test_config_names_the_key():
    with pytest.raises(ValueError, match="peering.forward"):
        PeeringConfig.from_dict({"forward": "always"})
    with pytest.raises(ValueError, match="forward_margin_s"):
        PeeringConfig.from_dict({"forward_margin_s": -1})
    assert PeeringConfig().forward == "predicted"


# -- in the scheduler -----------------------------------------------------------------------

class Rep:
    def __init__(self, rid: str):
        self.view = ReplicaView(id=rid, url="", engine="sglang", models=frozenset({"m"}))
        self.breaker = None


def scheduler() -> Scheduler:
    s = Scheduler(SchedulerConfig(), make_policy("least-load"), make_queue("fcfs"))
    s.backlog = trained()
    return s


def peer_set(forward: str = "predicted") -> tuple[PeerSet, PeerTarget]:
    eu = PeerTarget(PeerConfig("eu", "http://eu"), peer_status("eu"),
                    ReplicaView(id="peer:eu", url="", engine="peer", region="eu"), handle="eu")
    return PeerSet([eu], PeerRouter("nearest"), tau=2, stale_s=1.0, forward=forward), eu


def admit(s: Scheduler, rid: str, stream: bool = True) -> None:
    s.admit(QueueEntry(facts(rid=rid, stream=stream), enqueued_at=NOW, seq=int(rid[1:])), NOW)


def test_a_push_answered_whole_counts_as_prefill_ahead_until_its_predicted_ttft():
    """Only a stream's first event says its prefill is done. A non-streamed request counted
    until its answer ends would look like prefill ahead through its whole decode: it counts
    until the TTFT the policy predicted for it, or not at all when the policy predicts none."""
    s, local = scheduler(), Rep("a")  # least-load: predicts no TTFT
    admit(s, "r1", stream=False)
    s.schedule(NOW, [local], None)
    assert s.backlog.ahead == {}
    s = Scheduler(SchedulerConfig(), make_policy("predicted-ttft"), make_queue("fcfs"))
    admit(s, "r2", stream=False)
    (p,) = s.schedule(NOW, [local], None)
    predicted = s.policy.last.predicted_ttft_s
    assert p.kind is Kind.REPLICA and predicted > 0 and s.backlog.ahead == {"a": 1000}
    admit(s, "r3")  # streamed: counts until its first token
    s.schedule(NOW, [local], None)
    assert s.backlog.ahead == {"a": 2000}
    s.schedule(NOW + predicted, [local], None)  # a pass after r2's predicted TTFT
    assert s.backlog.ahead == {"a": 1000}
    s.backlog.first_token("r3", NOW + predicted)
    assert s.backlog.ahead == {}


def test_an_engine_s_first_token_count_releases_the_shortest_pushes_answered_whole():
    """vLLM counts every first token it produces (its TTFT histogram's count). From a target's
    first count on, its pushes answered whole stay ahead until that count passes them, not until
    their predicted TTFT, the shortest prefill first; first tokens we know of (a stream's, an
    answer that came back whole before the count passed it) are not counted twice; a count
    beyond ours (another client) is not carried into our next pushes; a restarted engine
    starts over."""
    b = Backlog()
    b.placed("early", "a", 10, NOW, expires_at=NOW + 1)  # before any count: its predicted TTFT
    b.engine_first_tokens("a", 500)  # the first report: a baseline, nothing released
    assert b.ahead == {"a": 10}
    b.expire(NOW + 1)
    assert b.ahead == {}
    for rid, tokens in (("w1", 400), ("w2", 100), ("w3", 200)):
        b.placed(rid, "a", tokens, NOW, expires_at=NOW + 0.1)
    b.placed("s1", "a", 1000, NOW)  # streamed
    b.expire(NOW + 5)  # long past their predicted TTFT: the count has not passed them
    assert b.ahead == {"a": 1700}
    b.first_token("s1", NOW + 1)  # relayed: the engine's next count includes it
    b.engine_first_tokens("a", 502)  # s1 and one more: the shortest answered whole
    assert b.ahead == {"a": 600} and b.ahead_count == {"a": 2}
    b.engine_first_tokens("a", 502)  # the same count again: nothing
    assert b.ahead == {"a": 600}
    b.ended("w3")  # answered whole before the count passed it: its first token is one it will hold
    b.engine_first_tokens("a", 503)
    assert b.ahead == {"a": 400}
    b.engine_first_tokens("a", 510)  # 7 more: one of ours, six another client's
    assert b.ahead == {} and b._unexplained["a"] == 0
    b.placed("w4", "a", 50, NOW, expires_at=NOW + 0.1)
    b.engine_first_tokens("a", 510)
    assert b.ahead == {"a": 50}  # not released by the other client's first tokens
    b.engine_first_tokens("a", 3)  # restarted: a new baseline
    assert b.ahead == {"a": 50}
    b.engine_first_tokens("a", 4)
    assert b.ahead == {}
    for i in range(10):  # relayed before the count reaches them: bounded, then met
        b.placed(f"s{i + 2}", "a", 5, NOW)
        b.first_token(f"s{i + 2}", NOW)
    b.placed("w5", "a", 70, NOW, expires_at=NOW + 0.1)
    b.engine_first_tokens("a", 4)
    assert b._unexplained["a"] == -10 and b.ahead == {"a": 70}
    b.engine_first_tokens("a", 14)
    assert b.ahead == {"a": 70}
    b.engine_first_tokens("a", 15)
    assert b.ahead == {}
    b.forget("a")
    assert not b._whole and not b.counted and not b._unexplained


def test_the_other_instance_s_pushes_stand_in_the_count_s_line_beside_ours():
    """Two LBs over the same replicas (lb.core.instances): the engine counts the other's first
    tokens too. Its pushes stand in the line the count passes, shortest first beside ours, so
    a first token of theirs does not release a push of ours; one that ended is known to the
    count; a restarted engine or a target forgotten drops them; the line is bounded."""
    b = Backlog()
    b.remote_placed("x0", "a", 10)  # no count from that engine yet: nothing waits on one
    assert not b._remote
    fresh = Backlog()  # an instance that has placed nothing yet: the probed count is the baseline
    fresh.remote_placed("y0", "a", 10, count=7)
    assert fresh.counted == {"a": 7} and fresh.awaiting_count("a") == {"ours": 0, "others": 1}
    fresh.engine_first_tokens("a", 8)
    assert fresh.awaiting_count("a") == {"ours": 0, "others": 0}
    b.engine_first_tokens("a", 100)  # the first report: a baseline
    b.placed("w1", "a", 300, NOW, expires_at=NOW + 0.1)
    b.remote_placed("t1", "a", 50)
    b.remote_placed("t2", "a", 500)
    b.engine_first_tokens("a", 101)  # one first token: the shortest prefill in the line, theirs
    assert b.ahead == {"a": 300}
    b.remote_ended("t2", "a")  # answered at the other instance: its first token is in the count or will be
    b.remote_ended("t9", "a")  # one we never heard of: nothing
    b.engine_first_tokens("a", 102)  # that one
    assert b.ahead == {"a": 300}
    b.engine_first_tokens("a", 103)
    assert b.ahead == {} and not b._remote["a"]
    for i in range(MAX_REMOTE + 10):
        b.remote_placed(f"k{i}", "a", 1.0)
    assert len(b._remote["a"]) == MAX_REMOTE and "k0" not in b._remote["a"]
    b.engine_first_tokens("a", 2)  # restarted: what it counted before is gone, and so is the line
    assert "a" not in b._remote
    b.remote_placed("k", "a", 1.0)
    b.forget("a")
    assert not b._remote


def test_the_scheduler_reads_each_view_s_first_token_count():
    s = Scheduler(SchedulerConfig(), make_policy("predicted-ttft"), make_queue("fcfs"))
    local = Rep("a")
    local.view.engine_first_tokens = 7
    s.schedule(NOW, [local], None)  # the first count: a baseline
    admit(s, "r1", stream=False)
    (p,) = s.schedule(NOW, [local], None)
    predicted = s.policy.last.predicted_ttft_s
    assert p.kind is Kind.REPLICA and s.backlog.ahead == {"a": 1000}
    s.schedule(NOW + 10 * predicted, [local], None)
    assert s.backlog.ahead == {"a": 1000}  # its engine has not counted its first token
    assert s.wants_first_tokens("a")  # a probe whose load endpoint does not count asks
    local.view.engine_first_tokens = 8
    s.schedule(NOW + 10 * predicted, [local], None)
    assert s.backlog.ahead == {} and not s.wants_first_tokens("a")
    admit(s, "r2", stream=False)
    s.schedule(NOW, [local], None)
    assert s.backlog.ahead == {"a": 1000} and s.wants_first_tokens("a")  # from its push on
    s.ended("r2")  # answered: nothing waits on the count there
    assert not s.wants_first_tokens("a")
    admit(s, "r3", stream=False)
    s.schedule(NOW, [local], None)
    local.view.engine_first_tokens = None  # its probe no longer says: what waited on the count is done
    s.schedule(NOW, [local], None)
    assert s.backlog.ahead == {} and "a" not in s.backlog.counted


def test_assumed_ends_of_prefill_are_bounded():
    b = Backlog(max_tracked=4)
    for i in range(100):  # answered before their assumed end: the heap is rebuilt, not kept
        b.placed(f"r{i}", "a", 10.0, float(i), expires_at=float(i) + 1000.0)
        b.ended(f"r{i}")
        b.expire(float(i))
    assert len(b._expiring) <= 2 * 4 + 1 and not b.ahead
    b.placed("x", "a", 10.0, 0.0, expires_at=1.0)
    b.placed("x", "b", 20.0, 0.5, expires_at=3.0)  # a retry elsewhere: the first assumed end is stale
    b.expire(2.0)
    assert b.ahead == {"b": 20.0}
    b.expire(3.0)
    assert b.ahead == {}


def test_scheduler_forwards_what_a_busy_local_replica_would_take_late():
    s, local = scheduler(), Rep("a")
    s.backlog.placed("old", "a", 8000, NOW)  # 4.6 s of prefill ahead on the only local replica
    peers, eu = peer_set()
    admit(s, "r1")
    (p,) = s.schedule(NOW, [local], peers)
    assert (p.kind, p.target, p.reason) == (Kind.PEER, "eu", "peer-faster")
    assert eu.status.forwarded_since_status == 1 and list(eu.status.unseen) == [(NOW, "m", 1000)]
    s.backlog.first_token("old", NOW + 4.6)  # the local replica caught up
    admit(s, "r2")
    (p,) = s.schedule(NOW + 4.6, [local], peers)
    assert p.kind is Kind.REPLICA and s.backlog.ahead == {"a": 1000}  # its push is ahead now


def test_scheduler_overflow_mode_and_an_unfitted_backlog_stay_local():
    s, local = scheduler(), Rep("a")
    s.backlog.placed("old", "a", 8000, NOW)
    peers, _ = peer_set("overflow")
    admit(s, "r1")
    assert s.schedule(NOW, [local], peers)[0].kind is Kind.REPLICA
    s = Scheduler(SchedulerConfig(), make_policy("least-load"), make_queue("fcfs"))  # nothing learned yet
    s.backlog.placed("old", "a", 8000, NOW)
    admit(s, "r1")
    assert s.schedule(NOW, [local], peer_set()[0])[0].kind is Kind.REPLICA


def test_advertise_offers_only_replicas_that_take_a_request_now():
    s = scheduler()
    free, full = Rep("a"), Rep("b")
    full.view.pending = 2  # SP-P: an engine with its own queue takes nothing more
    s.backlog.placed("x", "a", 700, NOW)
    ad = s.advertise([free, full], NOW)
    assert ad["m"]["ahead"] == [700] and ad["m"]["per_token_s"] == pytest.approx(PER_TOKEN, rel=1e-3)
    assert Scheduler(SchedulerConfig(), make_policy("least-load"), make_queue("fcfs")).advertise([free], NOW) == {}


def test_answering_counts_each_target_s_requests_from_their_first_token_to_their_end():
    b = Backlog(max_tracked=3)
    for rid, target in (("a", "r1"), ("b", "r1"), ("c", "r2")):
        b.placed(rid, target, 100, NOW)
    assert b.answering == {}  # pushed, no first token yet: they may still be on the wire
    b.first_token("a", NOW + 0.1)
    b.first_token("a", NOW + 0.2)  # later progress of the same stream counts once
    b.first_token("c", NOW + 0.1)
    assert b.answering == {"r1": 1, "r2": 1}
    b.ended("a")
    b.ended("b")  # ended without a first token: never answering
    assert b.answering == {"r2": 1}
    b.placed("c", "r1", 100, NOW + 1)  # a retry elsewhere starts over
    assert b.answering == {}
    for i in range(5):  # bounded: the oldest are dropped
        b.placed(f"x{i}", "r3", 10, NOW + 2)
        b.first_token(f"x{i}", NOW + 3)
    assert b.answering == {"r3": 3}
    b.forget("r3")
    assert b.answering == {}
    b.placed("n4", "r4", 100, NOW + 4, samples=4)  # parallel samples: the engine runs four
    b.first_token("n4", NOW + 5)
    assert b.answering == {"r4": 4}
    b.ended("n4")
    assert b.answering == {}
