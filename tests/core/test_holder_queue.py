"""An engine that preempts, or one that orders its waiting queue by cached prefix (SGLang
`--schedule-policy lpm`), keeps its own queue for the prefixes it holds
(lb.core.pushing.holder_queue_open, the scheduler's `_holder_queue`): a request that would wait in
the LB for its prefix's replica joins that replica's engine queue instead, bounded by what the
engine runs; a request with nothing cached there still waits in the LB. Time is passed in."""
from __future__ import annotations

from lb.core.affinity import AffinityConfig
from lb.core.policies import make_policy
from lb.core.pushing import LPM_MAX_WAITING, OVERCOMMIT_QUEUE, holder_queue_open
from lb.core.queueing import make_queue
from lb.core.scheduler import HOLDER_QUEUE_GLANCES, HOLDER_QUEUE_TRIES, Kind, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, ReplicaView, RequestFacts

NOW = 1000.0
CONTEXT = "a question and its first thoughts " * 100  # ~3,400 characters: many prefix blocks


class Rep:
    def __init__(self, rid: str, **kw):
        self.view = ReplicaView(id=rid, url="", engine="vllm", models=frozenset({"m"}), **kw)
        self.breaker = None


def child(rid: str) -> RequestFacts:
    return RequestFacts(rid, "m", prompt=CONTEXT + f" thought {rid}", prompt_tokens=1000)


def other(rid: str) -> RequestFacts:
    return RequestFacts(rid, "m", prompt=f"an unrelated question {rid} " * 100, prompt_tokens=1000)


def three_replicas() -> tuple[Scheduler, Rep, Rep, Rep]:
    """A scheduler holding a request at most 1 s for its prefix's replica, and replicas a, b, c."""
    s = Scheduler(SchedulerConfig(affinity=AffinityConfig(hold_s=1.0)), make_policy("predicted-ttft"),
                  make_queue("fcfs"))
    return s, Rep("a"), Rep("b"), Rep("c")


def took(s: Scheduler, rid: str, rep: Rep, at: float, seq: int) -> None:
    """Tree call `rid` arrives at `at` with only `rep` free, and goes there: `rep` holds its context."""
    s.admit(QueueEntry(child(rid), enqueued_at=at, seq=seq), at)
    assert [p.target_id for p in s.schedule(at, [rep])] == [rep.view.id]


def run(requeues: bool, pushing: str = "sp-pending", orders_by_prefix: bool = False) -> tuple[Rep, Rep, list]:
    """Replica `a` took a tree's root, then its engine filled (requests waiting there: SP-P's gate
    shuts); `b` is free. Three of the tree's calls and one unrelated request arrive."""
    s = Scheduler(SchedulerConfig(pushing=pushing, affinity=AffinityConfig(hold_s=1.0)), make_policy("predicted-ttft"),
                  make_queue("fcfs"))
    a, b = Rep("a"), Rep("b")
    s.admit(QueueEntry(child("root"), enqueued_at=NOW - 1, seq=0), NOW - 1)
    assert [p.target_id for p in s.schedule(NOW - 1, [a])] == ["a"]
    a.view.pending, a.view.running, a.view.pushed_since_probe = 3, 6, 0  # its probe: full, 3 waiting
    a.view.requeues, a.view.orders_by_prefix = requeues, orders_by_prefix
    for i, f in enumerate([child("c1"), child("c2"), other("x"), child("c3")]):
        s.admit(QueueEntry(f, enqueued_at=NOW, seq=i + 1), NOW)
    b.view.pending = 1  # the other replica's engine is full too: nothing is free
    return a, b, s.schedule(NOW, [a, b])


def test_a_held_request_joins_its_prefix_holders_own_queue_when_that_engine_preempts():
    a, _, out = run(requeues=True)
    got = {p.entry.facts.request_id: (p.kind, p.target_id) for p in out}
    # what waits there plus the unseen pushes stay under max(OVERCOMMIT_QUEUE, running): 3 + 5 < 8
    assert got["c1"] == (Kind.REPLICA, "a") and got["c2"] == (Kind.REPLICA, "a") and got["c3"] == (Kind.REPLICA, "a")
    assert "x" not in got  # nothing of it cached anywhere: it waits in the LB for a free replica
    assert a.view.pushed_since_probe == 3 and a.view.outstanding == 4  # the root and the three calls
    # the placement carries the policy's decision for that replica (its prefix match)
    assert all(p.matched_blocks > 0 for p in out if p.kind is Kind.REPLICA)


def test_an_engine_that_does_not_preempt_keeps_sp_ps_gate_and_blind_pushing_is_unchanged():
    _, _, out = run(requeues=False)
    assert out == []  # no replica free, none keeping a queue: everything waits in the LB
    a, b, out = run(requeues=True, pushing="blind")
    assert len([p for p in out if p.kind is Kind.REPLICA]) == 4  # blind pushing takes everything anyway


def test_an_engine_that_orders_its_queue_by_prefix_keeps_a_holders_queue_without_preempting():
    """It admits a request whose prefix it holds ahead of those waiting without one, so its
    waiting count is no queue for that request; one with nothing cached there would wait behind
    them, and waits in the LB."""
    a, _, out = run(requeues=False, orders_by_prefix=True)
    got = {p.entry.facts.request_id: (p.kind, p.target_id) for p in out}
    assert got == {c: (Kind.REPLICA, "a") for c in ("c1", "c2", "c3")}
    v = ReplicaView(id="a", url="", engine="sglang", orders_by_prefix=True, pending=3, running=6)
    assert holder_queue_open(v)
    v.pushed_since_probe = OVERCOMMIT_QUEUE - 3  # bounded as for an engine that preempts
    assert not holder_queue_open(v)
    # ...and where SGLang stops sorting: past 128 waiting its lpm admits in arrival order
    v.running, v.pending, v.pushed_since_probe = 300, LPM_MAX_WAITING - 1, 0
    assert holder_queue_open(v)
    v.pushed_since_probe = 1
    assert not holder_queue_open(v)
    v.requeues = True  # one that preempts keeps its queue for that reason: what it runs bounds it
    assert holder_queue_open(v)


def test_of_the_replicas_holding_a_prefix_the_least_queued_takes_the_request():
    """A system prompt that many requests share is held by several replicas: the one with the
    fewest waiting there (or pushed since its probe) takes the next request, whichever the trie
    names first, so the prompt's requests spread over its holders instead of queueing on one."""

    def placed(busier: str) -> list:
        s, a, b, c = three_replicas()
        took(s, "r1", a, NOW - 2, seq=0)
        took(s, "r2", b, NOW - 1, seq=1)  # both hold the context now
        for rep in (a, b):
            rep.view.pending, rep.view.running, rep.view.pushed_since_probe = 2, 20, 0
            rep.view.orders_by_prefix = True
        (a if busier == "a" else b).view.pending = 6
        c.view.pending, c.view.running = 4, 20  # no replica is free
        for i in range(2):
            s.admit(QueueEntry(child(f"c{i}"), enqueued_at=NOW, seq=2 + i), NOW)
        return [p.target_id for p in s.schedule(NOW, [a, b, c]) if p.kind is Kind.REPLICA]

    assert placed(busier="a") == ["b", "b"]
    assert placed(busier="b") == ["a", "a"]


def test_of_holders_with_equal_queues_the_one_with_less_prefill_ahead_takes_the_request():
    """`lb` knows the prompts it pushed that have no first token yet: a long document's chunked
    prefill there holds back what the engine admits after it."""

    def placed(answered: str) -> list:
        s, a, b, c = three_replicas()
        took(s, "r1", a, NOW - 2, seq=0)
        took(s, "r2", b, NOW - 1, seq=1)
        s.first_token(answered, NOW - 0.5)  # that one's prefill is done; the other's is still ahead
        for rep in (a, b, c):
            rep.view.pending, rep.view.running, rep.view.pushed_since_probe = 2, 20, 0
            rep.view.orders_by_prefix = True
        s.admit(QueueEntry(child("c0"), enqueued_at=NOW, seq=2), NOW)
        return [p.target_id for p in s.schedule(NOW, [a, b, c]) if p.kind is Kind.REPLICA]

    assert placed(answered="r1") == ["a"]
    assert placed(answered="r2") == ["b"]


def test_the_holders_queue_is_bounded_by_what_its_engine_runs():
    v = ReplicaView(id="a", url="", engine="vllm", requeues=True, pending=3, running=6)
    assert holder_queue_open(v)
    v.pushed_since_probe = OVERCOMMIT_QUEUE - 3  # 8 waiting or unseen: the floor reached
    assert not holder_queue_open(v)
    v.running = 20  # a bigger batch takes a longer queue
    assert holder_queue_open(v)
    v.pushed_since_probe = 17
    assert not holder_queue_open(v)
    v.pushed_since_probe, v.requeues = 0, False
    assert not holder_queue_open(v)  # an engine not seen to preempt: SP-P's gate alone
    v.requeues, v.draining = True, True
    assert not holder_queue_open(v)


def test_a_holders_queue_far_longer_than_the_other_replicas_takes_no_more():
    """What an engine runs bounds its queue, but one replica holding a prefix many requests
    share (a chat service's system prompt) would then queue up to what it runs, ~90 on an L4,
    while the others ran a fifth as much: its queue may be at most OVERCOMMIT_QUEUE past twice
    the others' mean queue, beyond which the request waits in the LB for any free replica."""

    def placed(others_waiting: int) -> list:
        s, a, b, c = three_replicas()
        took(s, "root", a, NOW - 1, seq=0)
        a.view.pending, a.view.running, a.view.requeues = 20, 40, True  # it runs 40: room for 20 more
        b.view.pending = c.view.pending = others_waiting  # both full too: nothing is free
        b.view.running = c.view.running = 10
        for i in range(3):
            s.admit(QueueEntry(child(f"c{i}"), enqueued_at=NOW, seq=i + 1), NOW)
        return [p.entry.facts.request_id for p in s.schedule(NOW, [a, b, c]) if p.kind is Kind.REPLICA]

    assert placed(others_waiting=1) == []  # 20 waiting there against 1: they wait in the LB
    assert placed(others_waiting=8) == ["c0", "c1", "c2"]  # 20 against 8: within 8 past twice 8
    # against 7 the bound is 22, and 21 are there (the root's push not yet probed): the pass's own
    # push there reaches it, and the rest wait in the LB
    assert placed(others_waiting=7) == ["c0"]


def test_a_call_far_back_in_the_queue_finds_its_holders_room_and_a_pass_stays_bounded():
    """Past capacity most queued requests have no engine queue that could take them (none holds
    their prefix, or its holders queue too much already). A pass passes over such requests without a
    prefix lookup (HOLDER_QUEUE_GLANCES of them) before spending its lookups (HOLDER_QUEUE_TRIES), so a
    tree's call far back whose holder has room joins it there; a longer queue costs a pass no more."""

    def placed(ahead: int) -> list:
        s, a, b, _ = three_replicas()
        took(s, "root", a, NOW - 1, seq=0)
        a.view.pending, a.view.running, a.view.requeues = 3, 6, True  # full, room for 4 more in its queue
        b.view.pending, b.view.running, b.view.requeues = 3, 6, True
        for i in range(ahead):  # unrelated requests before it: nothing of theirs is cached anywhere
            s.admit(QueueEntry(other(f"x{i}"), enqueued_at=NOW, seq=i + 1), NOW)
        s.admit(QueueEntry(child("c1"), enqueued_at=NOW, seq=ahead + 1), NOW)
        return [(p.entry.facts.request_id, p.target_id) for p in s.schedule(NOW, [a, b]) if p.kind is Kind.REPLICA]

    assert placed(ahead=HOLDER_QUEUE_TRIES + 10) == [("c1", "a")]
    # the glances spent, each request ahead takes a lookup: the last one still reaches it
    assert placed(ahead=HOLDER_QUEUE_GLANCES + HOLDER_QUEUE_TRIES - 1) == [("c1", "a")]
    assert placed(ahead=HOLDER_QUEUE_GLANCES + HOLDER_QUEUE_TRIES) == []


def held(preempted_at: dict[str, float], behind: int = 0) -> list:
    """Replica `a` holds a tree's context and is busy (its engine preempts, requests wait there);
    `b` is free. A call of the tree arrives, and `behind` unrelated requests after it: the call is
    held for `a` (into its engine's own queue), unless `a` preempted lately, `b` did not, and
    nothing else waits for `b` (lb.core.affinity.AffinityScheduler.hold)."""
    s = Scheduler(SchedulerConfig(affinity=AffinityConfig(hold_s=30.0)), make_policy("predicted-ttft"),
                  make_queue("fcfs"))
    a, b = Rep("a"), Rep("b")
    s.admit(QueueEntry(child("root"), enqueued_at=NOW - 1, seq=0), NOW - 1)
    assert [p.target_id for p in s.schedule(NOW - 1, [a])] == ["a"]
    a.view.pending, a.view.running, a.view.pushed_since_probe = 3, 6, 0
    a.view.requeues = b.view.requeues = True
    a.view.preempted_at, b.view.preempted_at = preempted_at.get("a"), preempted_at.get("b")
    s.admit(QueueEntry(child("c1"), enqueued_at=NOW, seq=1), NOW)
    for i in range(behind):
        s.admit(QueueEntry(other(f"x{i}"), enqueued_at=NOW, seq=2 + i), NOW)
    return [(p.entry.facts.request_id, p.kind, p.target_id) for p in s.schedule(NOW, [a, b])]


def test_a_call_is_not_held_for_a_holder_that_preempts_beside_a_free_replica_that_does_not():
    assert held({}) == [("c1", Kind.REPLICA, "a")]  # held for its context: into a's own queue
    assert held({"a": NOW - 1}) == [("c1", Kind.REPLICA, "b")]  # a preempted a second ago: b takes it
    assert held({"a": NOW - 60}) == [("c1", Kind.REPLICA, "a")]  # a minute ago: past the 30 s hold bound
    assert held({"a": NOW - 1, "b": NOW - 2}) == [("c1", Kind.REPLICA, "a")]  # both preempt: the cache counts
    # a request behind it has nowhere better to go: it takes b (placed first: a held call is settled
    # once the others have taken what they can), and the call keeps its hold
    assert held({"a": NOW - 1}, behind=1) == [("x0", Kind.REPLICA, "b"), ("c1", Kind.REPLICA, "a")]


def _learned(s: Scheduler) -> None:
    """The fleet's prefill rate learned from first tokens: 0.05 s + 0.5 ms a token."""
    for i, tokens in enumerate(range(100, 3000, 100)):
        s.backlog.placed(f"w{i}", "z", tokens, NOW - 100 + i)
        s.backlog.first_token(f"w{i}", NOW - 100 + i + 0.05 + 0.0005 * tokens)
    assert s.backlog.fit() is not None


def _whole_answers(s: Scheduler) -> None:
    """Clients that do not stream: no first token comes back, so the backlog fits nothing; the
    policy learns a replica's step from whole answers (128 tokens in 7.7 s: 0.06 s a token)."""
    z = Rep("z")
    for i in range(3):
        facts = RequestFacts(f"w{i}", "m", prompt=f"warm-up {i} " * 50, prompt_tokens=150, max_tokens=128)
        s.admit(QueueEntry(facts, enqueued_at=NOW - 100 + i, seq=100 + i), NOW - 100 + i)
        assert [p.target_id for p in s.schedule(NOW - 100 + i, [z])] == ["z"]
        s.served(facts, "z", None, 7.7, 128, NOW - 90 + i)
    assert s.backlog.fit() is None


def hot(b_running: int, declared: bool = False, streamed: bool = True) -> list:
    """Replica `a` holds a prompt many calls share (an app's system prompt) and is busy: it runs
    40, one push it has not reported, its KV spent; `b` is free and runs `b_running`. Six calls
    of that prompt arrive: single calls, or each of a declared interaction. `streamed`: the rates
    learned from first tokens, else from whole answers only."""
    s = Scheduler(SchedulerConfig(affinity=AffinityConfig(hold_s=30.0)), make_policy("predicted-ttft"),
                  make_queue("fcfs"))
    _learned(s) if streamed else _whole_answers(s)
    a, b = Rep("a", kv_free_tokens=20_000), Rep("b", kv_free_tokens=20_000)
    took(s, "root", a, NOW - 1, seq=0)
    a.view.running, a.view.pending, a.view.pushed_since_probe, a.view.kv_free_tokens = 40, 0, 1, 0
    b.view.running, b.view.max_running = b_running, 256
    for i in range(6):
        facts = RequestFacts(f"c{i}", "m", prompt=child(f"c{i}").prompt, prompt_tokens=1000, max_tokens=128,
                             interaction_id=f"tree-{i}" if declared else None)
        s.admit(QueueEntry(facts, enqueued_at=NOW, seq=i + 1), NOW)
    return [(p.entry.facts.request_id, p.kind, p.target_id) for p in s.schedule(NOW, [a, b])]


def test_a_call_held_for_a_busy_holder_takes_a_free_replica_once_its_line_there_outlasts_the_prefill():
    # a frees ~5 slots a second (40 running, answers of 128 tokens at 0.06 s); the prompt's
    # prefill on b is ~0.5 s: the first call (one push ahead of it) waits for a, in a's own queue
    # (a reports its KV room and c0 continues no interaction); the line behind it is longer
    # than the prefill, so the others take b
    got = hot(b_running=2)
    assert got == [("c0", Kind.REPLICA, "a")] + [(f"c{i}", Kind.REPLICA, "b") for i in range(1, 6)]
    # b as busy as a: not the holder overloaded but the fleet, so every call stays with its prefix
    assert all(t == "a" for _, kind, t in hot(b_running=40))


def test_with_clients_that_do_not_stream_a_held_call_is_priced_by_the_policys_own_prefill_estimate():
    # no first token ever comes back, so no prefill rate is fitted: the policy's estimate (its
    # learned step times its prefill ratio) prices the redo instead. Without one every call
    # stayed on a, in its engine queue (hot-shift at 0.9x, not streamed: TTFT p90 11x llm-d's)
    got = hot(b_running=2, streamed=False)
    assert [t for _, kind, t in got if kind is Kind.REPLICA].count("b") >= 5
    assert all(t == "a" for _, kind, t in hot(b_running=40, streamed=False))


def test_a_declared_interaction_and_a_leased_engine_keep_their_calls_in_the_lb():
    # a tree's calls wait here, where their rank in the fair queue counts, not in a's engine queue
    got = hot(b_running=40, declared=True)
    assert got and all(kind is Kind.HOLD for _, kind, _ in got)
    # a plain engine: its queue opens to a single call once it reports its KV room, and not while
    # the interactions under way lease that room (tests/core/test_leases.py: past capacity an
    # undeclared agent's next step finds its context held)
    view = ReplicaView(id="p", url="", engine="openai", running=4, pending=1)
    assert not holder_queue_open(view, single_prompt=400)
    view.kv_free_tokens = 0
    assert holder_queue_open(view, single_prompt=400) and not holder_queue_open(view)
    view.leased_tokens = 5_000
    assert not holder_queue_open(view, single_prompt=400)
    # nor while this LB's pushes there still prefill longer prompts than the call's, on average:
    # an engine that admits in arrival order would keep the call behind them (a chat behind a
    # document)
    view.leased_tokens = 0
    view.prefill_ahead, view.prefill_ahead_count = 6_100.0, 2
    assert not holder_queue_open(view, single_prompt=400)
    view.prefill_ahead = 800.0
    assert holder_queue_open(view, single_prompt=400)


def busy_holders(third: bool = False, document_ahead: bool = False) -> list:
    """Replicas `a` and `b` both hold a prompt many calls share and are busy (40 running, their
    KV spent); with `third`, `c` is as busy and holds none of it. With `document_ahead`, a
    6,000-token document of no prefix went to `a` and `b` before they filled and is still in
    their prefill (no first token). Six single calls of that prompt arrive."""
    s = Scheduler(SchedulerConfig(affinity=AffinityConfig(hold_s=30.0)), make_policy("predicted-ttft"),
                  make_queue("fcfs"))
    _learned(s)
    reps = [Rep(r, kv_free_tokens=20_000) for r in ("a", "b", "c")[:3 if third else 2]]
    took(s, "root-a", reps[0], NOW - 2, seq=0)
    took(s, "root-b", reps[1], NOW - 2, seq=1)
    for rid, rep in (("root-a", reps[0]), ("root-b", reps[1])):
        s.backlog.first_token(rid, NOW - 1.5)
    if document_ahead:
        for i, rep in enumerate(reps[:2]):
            s.admit(QueueEntry(RequestFacts(f"doc{i}", "m", prompt=f"a document {i} " * 2000, prompt_tokens=6000),
                               enqueued_at=NOW - 1, seq=2 + i), NOW - 1)
            assert [p.target_id for p in s.schedule(NOW - 1, [rep])] == [rep.view.id]
    for rep in reps:
        rep.view.running, rep.view.pending, rep.view.pushed_since_probe, rep.view.kv_free_tokens = 40, 0, 0, 0
    for i in range(6):
        facts = RequestFacts(f"c{i}", "m", prompt=child(f"c{i}").prompt, prompt_tokens=1000, max_tokens=128)
        s.admit(QueueEntry(facts, enqueued_at=NOW, seq=10 + i), NOW)
    got = [(p.entry.facts.request_id, p.kind, p.target_id) for p in s.schedule(NOW, reps)]
    return [g for g in got if g[1] is Kind.REPLICA], len(s)


def test_a_single_call_waits_here_for_any_replica_when_every_one_holds_its_prefix_or_a_longer_prompt_is_ahead():
    # c holds none of the prompt: the calls join their holders' engine queues, spread over a and b
    placed, waiting = busy_holders(third=True)
    assert waiting == 0 and {t for _, _, t in placed} == {"a", "b"}
    # every replica holds it: whichever frees a slot first serves a call as well, so the calls
    # wait here, one line for all of them, not one line per engine
    assert busy_holders() == ([], 6)
    # c holds none, but a document is still in a's and b's prefill: in an engine that admits in
    # arrival order the calls would wait behind it, so they wait here
    assert busy_holders(third=True, document_ahead=True) == ([], 6)
