"""KV leases (lb.core.leases): the context of an interaction under way, between its calls, is not
room SP-P pushes other work into; the lease ends when the next call arrives, at the
interaction's last call, or after `ttl_s`. Time is passed in."""
from __future__ import annotations

import pytest

from lb.core.continuations import interaction_of
from lb.core.leases import MAX_LEASES_PER_TARGET, KvLeases
from lb.core.policies import make_policy
from lb.core.pushing import has_headroom
from lb.core.queueing import make_queue
from lb.core.scheduler import Kind, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, ReplicaView, RequestFacts

NOW = 1000.0


def step(rid: str, interaction: str | None = "agent-1", *, final: bool = False, session: str | None = None,
         tokens: int = 3000) -> RequestFacts:
    return RequestFacts(rid, "m", prompt=f"system prompt and task of {interaction or session} " * 40 + f"step {rid}",
                        prompt_tokens=tokens, interaction_id=interaction, final_call=final, session=session)


def test_an_answered_call_leases_its_context_until_the_next_call_arrives():
    leases = KvLeases(ttl_s=5.0)
    leases.answered(step("s0"), "a", 3000, 200, NOW)
    assert leases.leased("a", NOW + 1) == 3200 and leases.leased("b", NOW + 1) == 0
    leases.arrived(step("s1"))  # the tool returned: the next step is here
    assert leases.leased("a", NOW + 1) == 0 and len(leases) == 0


def test_the_last_call_leases_nothing_and_a_call_without_an_interaction_neither():
    leases = KvLeases(ttl_s=5.0)
    leases.answered(step("s0"), "a", 3000, 200, NOW)
    leases.answered(step("s9", final=True), "a", 4000, 100, NOW + 2)  # its last call ends the lease too
    leases.answered(step("x", interaction=None), "a", 3000, 200, NOW + 2)
    assert leases.leased("a", NOW + 3) == 0


def test_a_session_header_stands_for_the_interaction():
    leases = KvLeases(ttl_s=5.0)
    leases.answered(step("t0", interaction=None, session="chat-7"), "a", 1000, 50, NOW)
    assert leases.leased("a", NOW) == 1050
    leases.arrived(step("t1", interaction=None, session="chat-7"))
    assert leases.leased("a", NOW) == 0


def test_a_lease_ends_after_its_ttl_and_a_newer_answer_replaces_the_older():
    leases = KvLeases(ttl_s=5.0)
    leases.answered(step("s0", "one"), "a", 1000, 0, NOW)
    leases.answered(step("s0", "two"), "a", 2000, 0, NOW + 3)
    assert leases.leased("a", NOW + 4) == 3000
    assert leases.leased("a", NOW + 6) == 2000  # "one" never came back within 5 s
    leases.answered(step("s1", "two"), "b", 2500, 0, NOW + 7)  # its next step went to b
    assert leases.leased("a", NOW + 7) == 0 and leases.leased("b", NOW + 7) == 2500
    assert KvLeases(ttl_s=0).leased("a", NOW) == 0


def test_leases_are_bounded_per_replica_and_go_with_a_replica_that_leaves():
    leases = KvLeases(ttl_s=60.0)
    for i in range(MAX_LEASES_PER_TARGET + 10):
        leases.answered(step(f"s{i}", f"i{i}"), "a", 10, 0, NOW)
    assert len(leases) == MAX_LEASES_PER_TARGET
    assert leases.leased("a", NOW) == 10 * MAX_LEASES_PER_TARGET
    leases.forget("a")
    assert len(leases) == 0 and leases.leased("a", NOW) == 0


def test_headroom_leaves_out_the_leased_tokens():
    view = ReplicaView(id="a", url="", engine="sglang", models=frozenset({"m"}), kv_free_tokens=8000)
    assert has_headroom(view)
    view.leased_tokens = 8000  # the free room is the cache of sessions in their tool calls
    assert not has_headroom(view)
    view.leased_tokens = 5000
    assert has_headroom(view)
    view.pushed_since_probe, view.pushed_tokens_since_probe = 1, 3000
    assert not has_headroom(view)  # 3,000 pushed unseen fill the 3,000 not leased


class Rep:
    def __init__(self, rid: str):
        self.view = ReplicaView(id=rid, url="", engine="sglang", models=frozenset({"m"}), kv_free_tokens=6000)
        self.breaker = None


def test_past_capacity_new_work_waits_in_the_lb_while_a_session_is_in_its_tool_call():
    """Replica `a` answered an agent's step; its KV's free room is about that step's context.
    A new session's first call waits in the LB instead of evicting it; the agent's next step,
    when it comes, ends the lease and goes first: its context is there (the LPM window)."""
    s = Scheduler(SchedulerConfig(lease_s=5.0), make_policy("predicted-ttft"), make_queue("fcfs"))
    a = Rep("a")
    s.admit(QueueEntry(step("s0"), enqueued_at=NOW, seq=0), NOW)
    assert [p.target_id for p in s.schedule(NOW, [a])] == ["a"]
    s.served(step("s0"), "a", 0.5, 4.0, 200, NOW + 4)
    a.view.outstanding = a.view.pushed_since_probe = a.view.pushed_tokens_since_probe = 0  # a probe after it ended
    a.view.kv_free_tokens = 3000  # other sessions run there too: what is free is less than s0's context

    s.admit(QueueEntry(step("n0", "agent-2"), enqueued_at=NOW + 4.2, seq=1), NOW + 4.2)
    assert s.schedule(NOW + 4.2, [a]) == []  # it would evict agent-1's context
    assert a.view.leased_tokens == 3200

    s.admit(QueueEntry(step("s1"), enqueued_at=NOW + 5, seq=2), NOW + 5)  # agent-1's next step
    out = s.schedule(NOW + 5, [a])
    assert [(p.kind, p.entry.facts.request_id, p.target_id) for p in out] == [(Kind.REPLICA, "s1", "a")]
    assert out[0].matched_blocks > 0 and a.view.leased_tokens == 0


def test_without_leases_or_below_capacity_nothing_waits():
    for lease_s, free in ((0.0, 4000), (5.0, 60000)):
        s = Scheduler(SchedulerConfig(lease_s=lease_s), make_policy("predicted-ttft"), make_queue("fcfs"))
        a = Rep("a")
        s.served(step("s0"), "a", 0.5, 4.0, 200, NOW)
        a.view.kv_free_tokens = free
        s.admit(QueueEntry(step("n0", "agent-2"), enqueued_at=NOW, seq=1), NOW)
        assert [p.target_id for p in s.schedule(NOW + 0.2, [a])] == ["a"]


def test_a_call_answered_while_others_of_its_interaction_run_leases_nothing():
    """A tree's thoughts run side by side: their shared context is in use, not evictable, so
    the first to end leases nothing; the last one to end leases its context."""
    leases = KvLeases(ttl_s=5.0)
    a, b = step("t1", "tree-1"), step("t2", "tree-1")
    leases.placed(a)
    leases.placed(b)
    leases.placed(a)  # placed again (a retry) counts once
    leases.answered(a, "x", 3000, 100, NOW)
    leases.ended("t1")
    assert leases.leased("x", NOW) == 0
    leases.ended("t2")  # ended before its answer was counted (the daemon's order)
    leases.answered(b, "x", 3000, 150, NOW + 1)
    assert leases.leased("x", NOW + 1) == 3150
    leases.ended("unknown")  # a call of no interaction: nothing to do
    assert leases.leased("x", NOW + 1) == 3150


def test_a_pass_with_nothing_queued_still_ends_the_expired_leases():
    """`available` is read between passes too (the gate, the peer advert, /metrics): once a
    lease has expired the replica is available again there, not only when work is queued."""
    s = Scheduler(SchedulerConfig(lease_s=5.0), make_policy("predicted-ttft"), make_queue("fcfs"))
    a = Rep("a")
    s.served(step("s0"), "a", 0.5, 4.0, 200, NOW)
    a.view.kv_free_tokens = 3000
    assert s.schedule(NOW + 1, [a]) == [] and a.view.leased_tokens == 3200
    assert not s.available(a.view)  # its room is leased
    assert s.schedule(NOW + 6, [a]) == [] and a.view.leased_tokens == 0  # expired, nothing queued
    assert s.available(a.view)
    s.served(step("s1"), "a", 0.5, 4.0, 200, NOW + 7)  # the next step answered: leased again
    assert s.available(a.view)  # (the view learns of it at the next pass or advert)
    s.advertise([a], NOW + 8)
    assert a.view.leased_tokens == 3200 and not s.available(a.view)
    s.advertise([a], NOW + 13)  # the peer advert between passes: the lease has expired
    assert a.view.leased_tokens == 0 and s.available(a.view)


def undeclared(rid: str, prompt: str, tokens: int = 3000, user: str = "bot") -> RequestFacts:
    """A call from a client that sends no interaction or session header."""
    return RequestFacts(rid, "m", prompt=prompt, prompt_tokens=tokens, user=user)


SYSTEM = "You are a coding agent. Tools: read, edit, run. " * 30  # ~1,500 chars, shared by every session


def agent_steps(leases: KvLeases, n: int, *, target: str = "a", at: float = NOW) -> RequestFacts:
    """An undeclared agent's first `n` steps, each answered on `target`: its last step."""
    from lb.core.prefix import request_chain

    call = undeclared("s0", SYSTEM + "Task: fix the failing test in parser.py. " * 8)
    for i in range(n):
        if i:
            call = undeclared(f"s{i}", call.prompt + f"read('parser{i}.py')" + "def parse(text): ... " * 40)
        leases.continuations.recognize(call, request_chain(call), at + i)
        leases.arrived(call)
        leases.placed(call)
        leases.ended(call.request_id)
        leases.answered(call, target, 3000, 200, at + i, request_chain(call))
    return call


def test_a_call_without_headers_is_known_by_its_prompt_extending_an_answered_one():
    """Each step's prompt is the last one's, its answer and the tool's output: it continues
    the first step's interaction and ends its lease; a session on the same system prompt is
    its own interaction. The lease is the context times the share of the user's calls
    continued (here 3 of 4)."""
    from lb.core.continuations import IMPLICIT
    from lb.core.prefix import request_chain

    leases = KvLeases(ttl_s=5.0)
    first = agent_steps(leases, 1)
    assert first.extra[IMPLICIT] == "s0" and leases.leased("a", NOW) == 0  # nothing continued yet: no lease
    leases = KvLeases(ttl_s=5.0)
    last = agent_steps(leases, 4)
    assert last.extra[IMPLICIT] == "s0"
    share = leases.continuations.share("bot")
    assert 0.7 < share < 0.8 and leases.leased("a", NOW + 3) == round(3200 * share)

    other = undeclared("o0", SYSTEM + "Task: add a --verbose flag to cli.py. " * 8)
    leases.continuations.recognize(other, request_chain(other), NOW + 3)
    leases.arrived(other)
    assert other.extra[IMPLICIT] == "o0" and leases.leased("a", NOW + 3) > 0  # not the agent's next step

    nxt = undeclared("s4", last.prompt + "edit(...)" * 20)
    leases.continuations.recognize(nxt, request_chain(nxt), NOW + 3)
    leases.arrived(nxt)
    assert nxt.extra[IMPLICIT] == "s0" and leases.leased("a", NOW + 3) == 0


def test_a_user_asking_single_questions_leases_nothing_an_agent_beside_it_does():
    from lb.core.prefix import request_chain

    leases = KvLeases(ttl_s=5.0)
    for i in range(20):
        q = undeclared(f"q{i}", SYSTEM + f"Question {i}: what does this code do? " * 6, user="qa")
        leases.continuations.recognize(q, request_chain(q), NOW)
        leases.answered(q, "b", 2000, 100, NOW, request_chain(q))
    assert leases.continuations.share("qa") == 0 and leases.leased("b", NOW) == 0
    agent_steps(leases, 8)
    assert leases.continuations.share("bot") > 0.8 and leases.leased("a", NOW + 7) > 2500


def test_a_prompt_end_two_interactions_share_recognizes_neither():
    """Two single questions whose prompts end inside the same system-prompt block (the
    questions shorter than a block): a third call on that prompt continues neither."""
    from lb.core.continuations import IMPLICIT
    from lb.core.prefix import request_chain

    leases = KvLeases(ttl_s=5.0)
    for rid, question in (("q1", "Why?"), ("q2", "How?")):
        call = undeclared(rid, SYSTEM + question)
        leases.continuations.recognize(call, request_chain(call), NOW)
        assert call.extra[IMPLICIT] == rid  # the same prompt again is a new question
        leases.answered(call, "a", 400, 50, NOW, request_chain(call))
    later = undeclared("q3", SYSTEM + "What? " + "and more " * 30)
    leases.continuations.recognize(later, request_chain(later), NOW)
    assert later.extra[IMPLICIT] == "q3"


def test_another_users_prompt_ending_at_the_same_block_leaves_a_users_next_call_recognized():
    """Two users ask the same question (a shared system prompt and question, as trees of
    thought or many chat users do): each one's next call continues its own first call, and
    the same user asking it twice is still ambiguous."""
    from lb.core.continuations import IMPLICIT
    from lb.core.prefix import request_chain

    leases = KvLeases(ttl_s=5.0)
    question = SYSTEM + "Solve: a train leaves at 3 pm... " * 4
    for rid, user in (("r1", "tree-1"), ("r2", "tree-2")):
        call = undeclared(rid, question, user=user)
        leases.continuations.recognize(call, request_chain(call), NOW)
        leases.answered(call, "a", 400, 50, NOW, request_chain(call))
    for rid, user, first in (("c1", "tree-1", "r1"), ("c2", "tree-2", "r2")):
        child = undeclared(rid, question + "First thought: ... " * 20 + "Next step?", user=user)
        leases.continuations.recognize(child, request_chain(child), NOW + 1)
        assert child.extra[IMPLICIT] == first
    again = undeclared("r3", question, user="tree-1")  # the same user's second tree on that question
    leases.continuations.recognize(again, request_chain(again), NOW + 2)
    leases.answered(again, "a", 400, 50, NOW + 2, request_chain(again))
    child = undeclared("c3", question + "Another thought: ... " * 20, user="tree-1")
    leases.continuations.recognize(child, request_chain(child), NOW + 3)
    assert child.extra[IMPLICIT] == "c3"


def test_past_capacity_an_undeclared_agents_next_step_finds_its_context_held():
    """The scheduler recognizes the undeclared agent's steps: once it has seen the agent's
    calls continued, a new session waits in the LB while the agent's context is leased, and
    the agent's next step, when it comes, goes first."""
    s = Scheduler(SchedulerConfig(lease_s=5.0), make_policy("predicted-ttft"), make_queue("fcfs"))
    a = Rep("a")
    call = undeclared("s0", SYSTEM + "Task: fix the failing test in parser.py. " * 8)
    for i in range(4):
        if i:
            call = undeclared(f"s{i}", call.prompt + f"read('parser{i}.py')" + "def parse(text): ... " * 40)
        t = NOW + 5 * i
        s.admit(QueueEntry(call, enqueued_at=t, seq=i), t)
        assert [p.target_id for p in s.schedule(t, [a])] == ["a"]
        s.ended(call.request_id)
        s.served(call, "a", 0.5, 4.0, 200, t + 4)
        a.view.outstanding = a.view.pushed_since_probe = a.view.pushed_tokens_since_probe = 0
    a.view.kv_free_tokens = 1000  # other sessions run there too

    t = NOW + 19.2
    s.admit(QueueEntry(undeclared("n0", SYSTEM + "Task: add a --verbose flag. " * 8, user="other"), enqueued_at=t,
                       seq=10), t)
    assert s.schedule(t, [a]) == [] and a.view.leased_tokens > 2000  # it would evict the agent's context
    nxt = undeclared("s4", call.prompt + "edit(...)" * 20)
    s.admit(QueueEntry(nxt, enqueued_at=t + 0.5, seq=11), t + 0.5)
    out = s.schedule(t + 0.5, [a])
    assert [(p.entry.facts.request_id, p.target_id) for p in out] == [("s4", "a")] and a.view.leased_tokens == 0
    off = Scheduler(SchedulerConfig(lease_s=0.0), make_policy("predicted-ttft"), make_queue("fcfs"))
    a = Rep("a")
    first = SYSTEM + "Task: fix the failing test in parser.py. " * 8
    steps = (undeclared("s0", first), undeclared("s1", first + "read('parser1.py')" + "def parse(text): ... " * 40))
    for i, fresh in enumerate(steps):  # leases off: the steps are still known (the fair queue's), none leases
        off.admit(QueueEntry(fresh, enqueued_at=NOW + i, seq=i), NOW + i)
        assert [p.target_id for p in off.schedule(NOW + i, [a])] == ["a"]
        off.ended(fresh.request_id)
        off.served(fresh, "a", 0.5, 1.0, 200, NOW + i + 0.5)
        assert interaction_of(fresh) == (None if i == 0 else "s0") and off.leases.leased("a", NOW + i + 0.5) == 0


def test_a_user_whose_calls_are_continued_at_once_holds_an_uncontinued_lease_only_that_long():
    """A tree's next calls come the moment its answers do: once the gaps are known, a leaf's
    lease (no call continues it) ends after `GAP_MARGIN` times the longest gap, not `ttl_s`;
    an agent whose tools run a second keeps its lease 1.5 s, and never past `ttl_s`."""
    from lb.core.continuations import GAP_MARGIN
    from lb.core.prefix import request_chain

    fast = KvLeases(ttl_s=5.0)
    call = undeclared("t0", SYSTEM + "Think about the problem step by step. " * 8)
    for i in range(8):
        if i:
            call = undeclared(f"t{i}", call.prompt + f"thought {i}: " + "consider the next case " * 8)
        fast.continuations.recognize(call, request_chain(call), NOW + 0.01 * i)
        fast.arrived(call)
        fast.answered(call, "a", 3000, 100, NOW + 0.01 * i, request_chain(call))
    assert fast.continuations.lease_s("bot", 5.0) == pytest.approx(GAP_MARGIN * 0.01)
    leaf = NOW + 0.07  # the last answer: no call continues it
    assert fast.leased("a", leaf) > 0 and fast.leased("a", leaf + 0.02) == 0  # not 5 s later

    slow = KvLeases(ttl_s=5.0)
    agent_steps(slow, 8)  # each step 1 s after the last
    assert slow.continuations.lease_s("bot", 5.0) == pytest.approx(GAP_MARGIN * 1.0)
    assert slow.leased("a", NOW + 8) > 0 and slow.leased("a", NOW + 8.6) == 0
    assert slow.continuations.lease_s("bot", 1.0) == 1.0


def test_a_prompt_shorter_than_a_block_is_known_when_a_longer_one_starts_with_it():
    """A chat's first turn ("hi") has no whole block: it is kept by a hash of the whole prompt,
    and the next turn (the first, its answer, a new question: a block or more) continues it.
    The same short prompt again is a new question; two chats of one user both opening with it
    leave the next turn unknown (it could continue either)."""
    from lb.core.continuations import IMPLICIT
    from lb.core.prefix import request_chain

    def arrive(c: KvLeases, call: RequestFacts) -> str:
        c.continuations.recognize(call, request_chain(call), NOW)
        return call.extra[IMPLICIT]

    leases = KvLeases(ttl_s=5.0)
    hi = undeclared("t0", "user: hi\n", tokens=4, user="ann")
    assert request_chain(hi) == () and arrive(leases, hi) == "t0"
    leases.answered(hi, "a", 4, 20, NOW, request_chain(hi))
    assert arrive(leases, undeclared("again", "user: hi\n", tokens=4, user="ann")) == "again"
    turn = "user: hi\nassistant: Hello! How can I help?\nuser: " + "Explain the prefix trie to me. " * 6
    assert arrive(leases, undeclared("t1", turn, user="ann")) == "t0"
    assert arrive(leases, undeclared("b1", turn, user="bob")) == "b1"  # another user's: not ann's

    two = KvLeases(ttl_s=5.0)
    for rid in ("c0", "d0"):
        call = undeclared(rid, "user: hi\n", tokens=4, user="ann")
        arrive(two, call)
        two.answered(call, "a", 4, 20, NOW, request_chain(call))
    assert arrive(two, undeclared("c1", turn, user="ann")) == "c1"
