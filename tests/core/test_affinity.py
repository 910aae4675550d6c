"""Cache-affine scheduling of the LB queue (lb.core.affinity) with the prefix-trie's memory."""
from __future__ import annotations

import pytest

from lb.core.affinity import AffinityConfig, AffinityScheduler
from lb.core.length_model import LengthModel
from lb.core.policies import make_policy
from lb.core.types import QueueEntry, RequestFacts

BASE = "You are a careful math tutor. " * 20  # 600 chars: ~9 blocks


def facts(rid: str, prompt: str) -> RequestFacts:
    return RequestFacts(request_id=rid, model="m", prompt=prompt)


def entry(rid: str, prompt: str, at: float, seq: int = 0) -> QueueEntry:
    return QueueEntry(facts=facts(rid, prompt), enqueued_at=at, seq=seq)


@pytest.fixture
def policy():
    p = make_policy("prefix-trie", seed=1)
    p.observe(facts("seed-a", BASE + "tree A " * 40), "a", 0.0)
    p.observe(facts("seed-b", "Another conversation entirely. " * 20), "b", 0.0)
    return p


def sched(policy, **cfg) -> AffinityScheduler:
    return AffinityScheduler(AffinityConfig(**cfg), policy.prefix_memory)


def test_freed_replica_gets_the_entry_with_the_longest_match_first(policy):
    cold = entry("cold", "Unrelated question " * 30, 0.0, 0)
    warm = entry("warm", BASE + "tree A " * 40 + "child", 0.1, 1)
    assert list(sched(policy).order([cold, warm], 0.2, {"a"})) == [warm, cold]


def test_strict_order_without_prefix_memory_or_window(policy):
    cold = entry("cold", "Unrelated question " * 30, 0.0, 0)
    warm = entry("warm", BASE + "tree A " * 40 + "child", 0.1, 1)
    assert list(AffinityScheduler(AffinityConfig(), None).order([cold, warm], 0.2, {"a"})) == [cold, warm]
    assert list(sched(policy, window=0).order([cold, warm], 0.2, {"a"})) == [cold, warm]
    assert make_policy("round-robin").__dict__.get("prefix_memory") is None


def test_window_bounds_how_far_back_it_looks(policy):
    cold = [entry(f"c{i}", f"Unrelated question {i} " * 30, 0.0, i) for i in range(3)]
    warm = entry("warm", BASE + "tree A " * 40 + "child", 0.1, 9)
    assert list(sched(policy, window=3).order([*cold, warm], 0.2, {"a"})) == [*cold, warm]
    assert list(sched(policy, window=4).order([*cold, warm], 0.2, {"a"}))[0] is warm


def test_nothing_jumps_over_an_entry_overdue_at_the_front(policy):
    """The bound counts from when an entry reached the front, not from its arrival: in a
    backlog both arrived seconds before either could be placed, and counted from arrival
    every entry was overdue at once, which turned the reordering off under load."""
    old = entry("old", "Unrelated question " * 30, 0.0, 0)
    warm = entry("warm", BASE + "tree A " * 40 + "child", 0.5, 1)
    s = sched(policy, max_bypass_s=1.0)
    assert list(s.order([old, warm], 3.0, {"a"}))[0] is warm  # 3 s since arrival, 0 at the front
    assert list(s.order([old, warm], 3.9, {"a"}))[0] is warm  # 0.9 s at the front < 1 s
    assert list(s.order([old, warm], 4.0, {"a"})) == [old, warm]  # now it has waited its bound there


def test_a_hold_counts_from_the_front_too(policy):
    child = entry("child", BASE + "tree A " * 40 + "next step", 10.0)
    ahead = entry("ahead", "Unrelated question " * 30, 9.0)
    s = sched(policy, hold_s=0.25)
    assert not s.hold(child, 20.1, free={"b"}, live={"a", "b"})  # 10 s since arrival, never at the front
    s.order([ahead, child], 20.0, {"b"})  # now it is
    assert s.hold(child, 20.1, free={"b"}, live={"a", "b"})
    assert not s.hold(child, 20.3, free={"b"}, live={"a", "b"})  # past hold_s at the front


def test_holds_for_a_busy_holder_only_while_young_and_only_for_a_long_match(policy):
    child = entry("child", BASE + "tree A " * 40 + "next step", 10.0)
    s = sched(policy, hold_s=0.25)
    # a holds most of the prompt, a is busy, b is free
    assert s.hold(child, 10.1, free={"b"}, live={"a", "b"})
    assert not s.hold(child, 10.3, free={"b"}, live={"a", "b"})  # waited past hold_s: go anywhere
    assert not s.hold(child, 10.1, free={"a", "b"}, live={"a", "b"})  # the holder is free
    assert not s.hold(child, 10.1, free={"b"}, live={"b"})  # the holder is gone
    stranger = entry("stranger", "Unrelated question " * 30, 10.0)
    assert not s.hold(stranger, 10.1, free={"b"}, live={"a", "b"})  # nothing to wait for


def test_no_hold_for_a_holder_that_preempts_beside_a_free_replica_that_does_not(policy):
    """A replica that preempts frees no slot for a held request (it readmits what it preempted
    first): the hold ends while a free replica has not preempted within the hold's bound. Where
    the free ones preempt too (a fleet past its capacity) the cache is worth the wait."""
    child = entry("child", BASE + "tree A " * 40 + "next step", 10.0)
    s = sched(policy, hold_s=5.0, hold_per_token_s=0.0)  # the bound: 5 s
    held = dict(free={"b"}, live={"a", "b"})
    assert s.hold(child, 10.1, **held, preempted_at={})
    assert not s.hold(child, 10.1, **held, preempted_at={"a": 9.0})  # the holder preempted 1.1 s ago
    assert s.hold(child, 10.1, **held, preempted_at={"a": 5.0})  # 5.1 s ago: past the bound
    assert s.hold(child, 10.1, **held, preempted_at={"a": 9.0, "b": 8.0})  # the free one preempts too
    assert not s.hold(child, 10.1, **held, preempted_at={"a": 9.0, "b": 4.0})  # ...but not lately
    assert not s.hold(child, 10.1, free={"c"}, live={"a", "b", "c"}, preempted_at={"a": 9.0})
    policy.observe(facts("seed-b2", BASE + "tree A " * 40), "b", 1.0)  # b holds it too, busy, and has not preempted
    assert s.hold(child, 10.1, free={"c"}, live={"a", "b", "c"}, preempted_at={"a": 9.0})


def test_no_hold_when_a_free_replica_holds_almost_as_much(policy):
    policy.observe(facts("seed-b2", BASE + "tree A " * 30), "b", 1.0)  # b holds most of A too
    child = entry("child", BASE + "tree A " * 40 + "next step", 10.0)
    assert not sched(policy, min_gain=0.5).hold(child, 10.1, free={"b"}, live={"a", "b"})


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        AffinityConfig(min_gain=0)
    with pytest.raises(ValueError):
        AffinityConfig(window=-1)


def test_hold_grows_with_max_tokens_and_an_entry_that_may_be_held_is_not_overdue(policy):
    prompt = BASE + "tree A " * 40 + "child"
    short = QueueEntry(facts=RequestFacts(request_id="s", model="m", prompt=prompt, max_tokens=8), enqueued_at=0.0, seq=0)
    long = QueueEntry(facts=RequestFacts(request_id="l", model="m", prompt=prompt, max_tokens=256), enqueued_at=0.0, seq=1)
    s = sched(policy, hold_s=1.0, hold_per_token_s=0.05, max_bypass_s=2.0)
    assert not s.hold(short, 1.5, free={"b"}, live={"a", "b"})  # 8 tokens: the hold_s floor
    assert s.hold(long, 12.0, free={"b"}, live={"a", "b"})  # 256 tokens decode in ~12.8 s: still worth it
    assert not s.hold(long, 13.0, free={"b"}, live={"a", "b"})
    warm = entry("warm", prompt, 4.0, 9)
    old_long, old_short = (QueueEntry(facts=RequestFacts(request_id=f"o{n}", model="m", prompt="Unrelated " * 60,
                                                          max_tokens=n), enqueued_at=0.0, seq=n) for n in (256, 8))
    s.order([old_long, old_short], 0.0, {"a"})  # both at the front since 0.0
    assert list(s.order([old_long, warm], 5.0, {"a"})) == [warm, old_long]  # may still be held: not overdue
    assert list(s.order([old_short, warm], 5.0, {"a"})) == [old_short, warm]  # overdue: nothing jumps over it


def test_the_hold_follows_the_inter_token_time_the_fleet_shows_not_a_profiles_constant():
    """The holder frees a slot about when an answer of this length has decoded there: at the
    step the replicas' answers show (0.2 s here, a big batch on slow hardware), not the
    configured 0.05 s, which only stands in until the first answer."""
    policy = make_policy("predicted-ttft", seed=1)
    prompt = BASE + "tree A " * 40
    policy.observe(facts("seed-a", prompt), "a", 0.0)
    child = QueueEntry(facts=RequestFacts(request_id="c", model="m", prompt=prompt + "child", max_tokens=100),
                       enqueued_at=0.0, seq=0)
    s = sched(policy, hold_s=1.0, hold_per_token_s=0.05)
    s.order([child, entry("other", "Unrelated question " * 30, 0.0, 1)], 0.0, {"b"})  # at the front from 0
    assert s.hold(child, 4.9, free={"b"}, live={"a", "b"})
    assert not s.hold(child, 5.1, free={"b"}, live={"a", "b"})  # 100 x 0.05 s: nothing learned yet
    policy.served(facts("seed-a", prompt), "a", ttft_s=0.3, e2e_s=0.3 + 0.2 * 99, output_tokens=100, now=20.0)
    assert policy.prefix_memory.decode_step_s() == pytest.approx(0.2)
    assert s.hold(child, 19.9, free={"b"}, live={"a", "b"})
    assert not s.hold(child, 20.1, free={"b"}, live={"a", "b"})


def test_a_request_declaring_no_max_tokens_holds_as_long_as_the_answers_like_it_take():
    """Chat clients and most SDK calls send no max_tokens: the hold then assumes the length the
    replicas' answers have shown (the scheduler's length model), not the bare `hold_s` floor,
    which let such a tree's children leave their busy holder after 1 s and recompute."""
    policy = make_policy("predicted-ttft", seed=1)
    prompt = BASE + "tree A " * 40
    policy.observe(facts("seed-a", prompt), "a", 0.0)
    child = QueueEntry(facts=RequestFacts(request_id="c", model="m", prompt=prompt + "child"), enqueued_at=0.0, seq=0)
    lengths = LengthModel(prior_tokens=256.0)
    s = AffinityScheduler(AffinityConfig(hold_s=1.0, hold_per_token_s=0.05), policy.prefix_memory, lengths)
    s.order([child, entry("other", "Unrelated question " * 30, 0.0, 1)], 0.0, {"b"})  # at the front from 0
    assert s.hold(child, 12.7, free={"b"}, live={"a", "b"})  # nothing learned: the prior's 256 x 0.05 s
    assert not s.hold(child, 12.9, free={"b"}, live={"a", "b"})
    for i in range(32):  # answers like it are 60 tokens long
        lengths.observe(RequestFacts(request_id=f"r{i}", model="m", prompt_tokens=child.facts.prompt_tokens), 60)
    assert s.expected_output(child.facts) == pytest.approx(60, rel=0.05)
    assert s.hold(child, 2.9, free={"b"}, live={"a", "b"})
    assert not s.hold(child, 3.2, free={"b"}, live={"a", "b"})  # 60 x 0.05 s
    declared = QueueEntry(facts=RequestFacts(request_id="d", model="m", prompt=prompt + "child", max_tokens=8),
                          enqueued_at=0.0, seq=2)
    assert s.expected_output(declared.facts) is None  # a declared max_tokens is the client's word
    assert AffinityScheduler(AffinityConfig(), policy.prefix_memory).expected_output(child.facts) is None
