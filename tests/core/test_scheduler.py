"""The scheduler (lb.core.scheduler): the filter chain, queue order and charging, holds,
local-then-peer dispatch, rejects and the explanation each placement carries."""
from __future__ import annotations

from dataclasses import dataclass

from lb.core.breaker import Breaker, BreakerConfig
from lb.core.fairness import WeightedService
from lb.core.peering import PeerConfig, PeerRouter, PeerStatus
from lb.core.policies import make_policy
from lb.core.queueing import make_queue
from lb.core.scheduler import QUEUE_FULL, SHUTTING_DOWN, Kind, PeerSet, PeerTarget, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, ReplicaView, RequestFacts

NOW = 100.0


@dataclass(eq=False)
class T:
    view: ReplicaView
    breaker: Breaker | None = None


def rep(rid: str, **kw) -> T:
    return T(ReplicaView(id=rid, url="", engine=kw.pop("engine", "sglang"), models=frozenset(kw.pop("models", {"m"})),
                         **kw))


seq = iter(range(10**6))


def entry(rid: str = "r", model: str = "m", **kw) -> QueueEntry:
    accepts, exclude = kw.pop("accepts", None), kw.pop("exclude", frozenset())
    return QueueEntry(RequestFacts(rid, model, prompt_tokens=100, max_tokens=16, **kw), enqueued_at=NOW,
                      seq=next(seq), accepts=accepts, exclude=exclude)


def sched(policy: str = "least-load", queue=None, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), make_policy(policy), make_queue("fcfs") if queue is None else queue)


def placed(s: Scheduler, targets, peers=None) -> dict[str, str | None]:
    return {p.entry.facts.request_id: p.target_id for p in s.schedule(NOW, targets, peers) if p.kind is not Kind.HOLD}


def test_filter_chain_health_draining_breaker_model_and_pushing():
    open_breaker = Breaker(BreakerConfig(failures=1))
    open_breaker.record(False, NOW)
    targets = [rep("sick", healthy=False), rep("drain", draining=True), rep("broken"),
               rep("other", models={"x"}), rep("busy", pending=3), rep("ok")]
    targets[2].breaker = open_breaker
    s = sched()
    for i in range(3):
        s.admit(entry(f"r{i}"), NOW)
    got = placed(s, targets)
    # only "ok" qualifies; SP-P's credit (4 unseen pushes, no KV room reported) takes all three
    assert got == {"r0": "ok", "r1": "ok", "r2": "ok"}
    assert targets[-1].view.outstanding == 3 and targets[-1].view.pushed_since_probe == 3
    assert len(s) == 0 and s.waiting("m") == 0
    assert s.queued_work.tokens(lambda app, stage: 64.0) == 0  # the work admission counts left with them


def test_the_work_admission_counts_follows_what_waits():
    s = sched()
    for i in range(3):
        s.admit(entry(f"r{i}"), NOW)  # 100 prompt + 16 max tokens each
    s.admit(QueueEntry(RequestFacts("open", "m", prompt_tokens=100), enqueued_at=NOW, seq=next(seq)), NOW)  # output: the estimate
    assert s.queued_work.tokens(lambda app, stage: 50.0) == 3 * 116 + 100 + 50
    withdrawn = next(e for e in s.queue if e.facts.request_id == "open")
    s.withdraw(withdrawn)
    assert placed(s, [rep("one", pending=0)]) and s.queued_work.tokens(lambda app, stage: 50.0) == 0


def test_push_counts_make_a_replica_unavailable_within_the_pass():
    s = sched(push_credit=2)
    for i in range(3):
        s.admit(entry(f"r{i}"), NOW)
    assert placed(s, [rep("a")]) == {"r0": "a", "r1": "a"}  # the third waits for a probe
    assert s.waiting("m") == 1 and s.waiting_tokens("m") == 100


def test_accepts_and_retry_exclusion():
    s = sched()
    s.admit(entry("gen", accepts=lambda v: v.engine == "sglang"), NOW)
    s.admit(entry("retry", exclude=frozenset({"a"})), NOW)
    got = placed(s, [rep("a"), rep("v", engine="vllm")])
    assert got == {"gen": "a", "retry": "v"}
    # every healthy replica already failed it: it may go back to one
    s.admit(entry("again", exclude=frozenset({"a"})), NOW)
    assert placed(s, [rep("a")]) == {"again": "a"}


def test_head_for_a_busy_model_does_not_block_the_rest():
    s = sched()
    s.admit(entry("x1", model="x"), NOW)
    s.admit(entry("m1"), NOW)
    assert placed(s, [rep("a"), rep("bx", models={"x"}, pending=1)]) == {"m1": "a"}
    assert s.waiting("x") == 1


def test_wsc_is_charged_when_the_scheduler_takes_an_entry_out():
    service = WeightedService()
    s = sched(queue=make_queue("wsc", service=service))
    s.admit(entry("a1", user="alice"), NOW)
    s.admit(entry("b1", user="bob"), NOW)
    s.withdraw(next(iter(s.queue)))  # leaving without running charges nobody
    assert service.get("alice") == 0
    assert placed(s, [rep("a")]) == {"b1": "a"}
    assert service.get("bob") > 0 and service.inflight == {"bob": 1}
    s.completed(RequestFacts("b1", "m", user="bob"), 100, 10)
    assert service.inflight == {}


def test_placement_explains_itself():
    s = sched("prefix-trie")
    s.admit(entry("r"), NOW)
    (p,) = s.schedule(NOW, [rep("a"), rep("b")])
    assert p.kind is Kind.REPLICA and p.reason in ("load", "prefix") and p.waited == 0.0


def test_rejects_are_reasons_not_statuses():
    s = sched(max_queue=1)
    assert s.admit(entry("a"), NOW) is None
    r = s.admit(entry("b"), NOW)
    assert r.kind is Kind.REJECT and r.reason == QUEUE_FULL
    out = s.close()
    assert [(p.entry.facts.request_id, p.reason) for p in out] == [("a", SHUTTING_DOWN)]
    assert s.admit(entry("c"), NOW).reason == SHUTTING_DOWN and len(s) == 0


def peer(region: str, *, free: int = 1, queue: int = 0, allowed=()) -> PeerTarget:
    st = PeerStatus(region)
    st.record_status({"healthy": True, "queue_len": queue, "free": {"m": free}, "models": ["m"]}, 0.05, NOW)
    view = ReplicaView(id=f"peer:{region}", url="", engine="peer", region=region, healthy=True)
    return PeerTarget(PeerConfig(region, f"http://{region}", tuple(allowed)), st, view, handle=region)


def test_local_first_then_an_available_peer_then_wait():
    eu = peer("eu")
    peers = PeerSet([eu], PeerRouter("nearest"), tau=2, stale_s=1.0)
    s = sched()
    s.admit(entry("r0"), NOW)
    s.admit(entry("r1"), NOW)
    s.admit(entry("hop", hops=1), NOW)  # already crossed one LB: local only
    out = s.schedule(NOW, [rep("a", pending=1)], peers)  # the local replica has a queue of its own
    assert [(p.entry.facts.request_id, p.kind, p.target) for p in out] == [("r0", Kind.PEER, "eu")]
    assert eu.status.forwarded_since_status == 1 and eu.view.outstanding == 1
    assert s.waiting("m") == 2  # its one free replica is used up: r1 waits, and so does hop


def test_residency_tag_keeps_a_request_home_and_says_so():
    peers = PeerSet([peer("eu")], PeerRouter("nearest"), tau=2, stale_s=1.0)
    s = sched()
    s.admit(entry("tagged", residency="us-only"), NOW)
    (p,) = s.schedule(NOW, [], peers)
    assert p.kind is Kind.HOLD and p.reason == "residency" and p.residency_blocked == ("eu",)
