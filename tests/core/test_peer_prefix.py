"""Where a request's prefix is decides which queued request leaves for a peer region
(lb.core.affinity.AffinityScheduler.across_regions, lb.core.peering.holder_peer, the
scheduler's peer step). Time is passed in."""
from __future__ import annotations

from lb.core.affinity import AffinityConfig
from lb.core.peering import PeerConfig, PeerRouter, PeerStatus
from lb.core.policies import make_policy
from lb.core.queueing import make_queue
from lb.core.scheduler import Kind, PeerSet, PeerTarget, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, ReplicaView, RequestFacts

NOW = 1000.0
CONTEXT = "a question and its first thoughts " * 100  # ~3,400 characters: many prefix blocks


class Rep:
    def __init__(self, rid: str):
        self.view = ReplicaView(id=rid, url="", engine="sglang", models=frozenset({"m"}))
        self.breaker = None


def status(region: str, *, free: int, queue: int = 0, at: float = NOW) -> PeerStatus:
    st = PeerStatus(region)
    st.record_status({"healthy": True, "queue_len": queue, "free": {"m": free}, "models": ["m"]}, 0.15, at)
    return st


def peers(router: PeerRouter, at: float = NOW, **free: int) -> PeerSet:
    targets = [PeerTarget(PeerConfig(r, f"http://{r}"), status(r, free=n, at=at),
                          ReplicaView(id=f"peer:{r}", url="", engine="peer", region=r), handle=r)
               for r, n in free.items()]
    return PeerSet(targets, router, tau=2, stale_s=1.0, forward="overflow")


def router() -> PeerRouter:
    r = PeerRouter("prefix-trie")
    for region in ("eu", "asia"):
        r.register(region)
    return r


def router_with_root_in(region: str, prompt_tokens: int = 850) -> PeerRouter:
    """A peer router that remembers forwarding a tree's root (CONTEXT) to `region`."""
    r = router()
    r.observe(RequestFacts("root", "m", prompt=CONTEXT, prompt_tokens=prompt_tokens), region, NOW)
    return r


def child(rid: str) -> RequestFacts:
    """A tree's next call: a short thought (16 tokens: the hold is the 1 s floor)."""
    return RequestFacts(rid, "m", prompt=CONTEXT + f" thought {rid}", prompt_tokens=1000, max_tokens=16)


def other(rid: str) -> RequestFacts:
    return RequestFacts(rid, "m", prompt=f"an unrelated question {rid} " * 100, prompt_tokens=1000)


def setup() -> tuple[Scheduler, Rep]:
    s = Scheduler(SchedulerConfig(affinity=AffinityConfig(hold_s=1.0)), make_policy("predicted-ttft"),
                  make_queue("fcfs"))
    busy = Rep("a")
    busy.view.pending = 1  # SP-P: its engine has a queue, it takes nothing now
    return s, busy


def admit(s: Scheduler, f: RequestFacts, seq: int) -> QueueEntry:
    e = QueueEntry(f, enqueued_at=NOW, seq=seq)
    s.admit(e, NOW)
    return e


def test_a_request_cached_on_a_busy_local_replica_waits_and_one_behind_it_leaves():
    """The local replica holds a tree's context: its next call waits for it (up to the hold
    bound) instead of recomputing the context in a peer region, and a request behind it
    with nothing cached anywhere takes the peer's free replica in the same pass."""
    s, busy = setup()
    s.policy.observe(RequestFacts("root", "m", prompt=CONTEXT, prompt_tokens=850), "a", NOW)
    admit(s, child("c1"), 1)
    admit(s, other("o1"), 2)
    kept, left = s.schedule(NOW, [busy], peers(router(), eu=1))
    assert (kept.kind, kept.reason, kept.entry.facts.request_id) == (Kind.HOLD, "prefix-here", "c1")
    assert (left.kind, left.target, left.reason, left.entry.facts.request_id) == (Kind.PEER, "eu", "peer", "o1")
    (later,) = s.schedule(NOW + 0.5, [busy], peers(router(), eu=1))
    assert later.kind is Kind.HOLD  # still within its hold bound (1 s)
    (gone,) = s.schedule(NOW + 1.0, [busy], peers(router(), eu=1))
    assert (gone.kind, gone.target) == (Kind.PEER, "eu")  # waited its bound: it leaves after all


def test_a_request_whose_context_went_to_a_peer_follows_it_there_even_with_no_replica_free():
    """The tree's root was forwarded to eu: its next call queues in eu beside its cache,
    though only asia has a replica free; a request with no prefix anywhere takes asia's."""
    s, busy = setup()
    r = router_with_root_in("eu")
    admit(s, child("c1"), 1)
    admit(s, other("o1"), 2)
    followed, overflow = s.schedule(NOW, [busy], peers(r, eu=0, asia=1))
    assert (followed.kind, followed.target, followed.reason) == (Kind.PEER, "eu", "peer-prefix")
    assert (overflow.kind, overflow.target, overflow.reason) == (Kind.PEER, "asia", "peer")


def test_a_holder_region_is_followed_whatever_its_queue_but_not_on_a_stale_status():
    """τ keeps overflow off a busy peer, not a call from the context it holds: bounding the
    follow by τ sent trees' later calls home to recompute their context."""
    s, busy = setup()
    r = router_with_root_in("eu")
    admit(s, child("c1"), 1)
    ps = peers(r, eu=0, asia=1)
    ps.targets[0].status.queue_len = 30  # far over tau (2)
    (p,) = s.schedule(NOW, [busy], ps)
    assert (p.kind, p.target, p.reason) == (Kind.PEER, "eu", "peer-prefix")
    admit(s, child("c2"), 2)
    ps = peers(r, eu=0, asia=1)
    ps.targets[0].status = status("eu", free=0, at=NOW - 5.0)  # 5 s old, stale after 1 s
    (p,) = s.schedule(NOW, [busy], ps)
    assert (p.kind, p.target, p.reason) == (Kind.PEER, "asia", "peer")


def test_a_request_follows_its_context_even_when_a_local_replica_is_free():
    """Placed on the free local replica it would recompute the context eu holds and split its
    tree across two regions; a request with no prefix anywhere takes the local replica."""
    s, _ = setup()
    free = Rep("b")
    r = router_with_root_in("eu")
    admit(s, child("c1"), 1)
    admit(s, other("o1"), 2)
    followed, local = s.schedule(NOW, [free], peers(r, eu=0, asia=1))
    assert (followed.kind, followed.target, followed.reason) == (Kind.PEER, "eu", "peer-prefix")
    assert (local.kind, local.target_id, local.entry.facts.request_id) == (Kind.REPLICA, "b", "o1")
    s.policy.observe(RequestFacts("root2", "m", prompt=CONTEXT, prompt_tokens=850), "b", NOW)
    admit(s, child("c2"), 3)  # now b holds the context as well: it stays
    (p,) = s.schedule(NOW, [free], peers(r, eu=0, asia=1))
    assert (p.kind, p.target_id) == (Kind.REPLICA, "b")


def test_a_long_answer_waits_for_its_cache_no_longer_than_max_bypass_when_a_peer_could_serve_it():
    """The hold bound grows with max_tokens (60 s for 1,000 tokens); with a peer replica free
    now, a request waits for its busy local holder at most max_bypass_s (2 s)."""
    s, busy = setup()
    s.policy.observe(RequestFacts("root", "m", prompt=CONTEXT, prompt_tokens=850), "a", NOW)
    long = RequestFacts("c1", "m", prompt=CONTEXT + " thought c1", prompt_tokens=1000, max_tokens=1000)
    assert s.affinity.cfg.hold_bound(long) == 60.0 and s.affinity.cfg.max_bypass_s == 2.0
    admit(s, long, 1)
    assert s.schedule(NOW + 1.9, [busy], peers(router(), at=NOW + 1.9, eu=1))[0].kind is Kind.HOLD
    (p,) = s.schedule(NOW + 2.0, [busy], peers(router(), at=NOW + 2.0, eu=1))
    assert (p.kind, p.target) == (Kind.PEER, "eu")


def test_a_peer_holding_less_than_min_gain_but_more_than_half_of_it_is_followed():
    """The tries hold prompts, not answers, and a split tree pays on every later call: the
    cross-region threshold is half `min_gain` (0.175 of the prompt by default)."""
    s, busy = setup()
    r = router_with_root_in("eu", prompt_tokens=400)
    gain = s.affinity.cfg.min_gain
    step = " a long new step of reasoning "
    longer = RequestFacts("c1", "m", prompt=CONTEXT + step * round(len(CONTEXT) * (1 / (0.75 * gain) - 1) / len(step)),
                          prompt_tokens=1000)
    share = len(CONTEXT) / len(longer.prompt)
    assert gain / 2 + 0.05 < share < gain  # eu holds ~3/4 of min_gain of it, nothing local does
    admit(s, longer, 1)
    (p,) = s.schedule(NOW, [busy], peers(r, eu=0, asia=1))
    assert (p.kind, p.target, p.reason) == (Kind.PEER, "eu", "peer-prefix")
