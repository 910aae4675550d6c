"""A conversation's next turn waits for the replica that holds its history, answer included
(lb.core.prefix `answered` / `answer_after`, lb.core.affinity `hold`): the trie holds prompts, so
it matched only the last prompt of a turn that mostly carries the last answer; the scheduler now
records where each answer ended and counts it for the replica that gave it. Time is passed in."""
from __future__ import annotations

from lb.core.affinity import AffinityConfig
from lb.core.facts import prompt_text
from lb.core.policies import make_policy
from lb.core.queueing import make_queue
from lb.core.scheduler import Kind, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, ReplicaView, RequestFacts

NOW = 1000.0
QUESTION = "Compose an engaging travel blog post about a recent trip to Hawaii, its culture and its sights. " * 3
ANSWER = "Aloha! The islands greeted me with warm trade winds and the scent of plumeria. " * 12


class Rep:
    def __init__(self, rid: str):
        self.view = ReplicaView(id=rid, url="", engine="sglang", models=frozenset({"m"}))
        self.breaker = None


def turn(rid: str, messages: list[dict]) -> RequestFacts:
    text = prompt_text("chat", {"messages": messages})  # as the daemon reads a chat request
    return RequestFacts(rid, "m", prompt=text, prompt_tokens=len(text) // 4, max_tokens=128)


FIRST = [{"role": "user", "content": QUESTION}]
SECOND = FIRST + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Rewrite it in limericks."}]


def setup(answered: bool):
    """Replica `a` served the first turn and is now busy (a request waits in its engine); `b`
    is free, running as much as `a` (a fleet busy everywhere: a held request is not released
    to it, lb.core.affinity `release`). The second turn arrives: the last answer is most of its
    prompt."""
    s = Scheduler(SchedulerConfig(affinity=AffinityConfig(hold_s=5.0)), make_policy("predicted-ttft"),
                  make_queue("fcfs"))
    a, b = Rep("a"), Rep("b")
    first = turn("t0", FIRST)
    s.admit(QueueEntry(first, enqueued_at=NOW - 10, seq=0), NOW - 10)
    assert [p.target_id for p in s.schedule(NOW - 10, [a])] == ["a"]
    if answered:
        s.served(first, "a", 0.2, 5.0, len(ANSWER) // 4, NOW - 5)
    a.view.pending, a.view.pushed_since_probe = 1, 0  # its probe: busy
    a.view.running = b.view.running = 8
    return s, a, b


def test_the_next_turn_waits_for_the_replica_that_holds_its_last_answer():
    s, a, b = setup(answered=True)
    s.admit(QueueEntry(turn("t1", SECOND), enqueued_at=NOW, seq=1), NOW)
    assert [(p.kind, p.reason) for p in s.schedule(NOW, [a, b])] == [(Kind.HOLD, "prefix-holder-busy")]
    a.view.pending = 0  # the holder frees: the turn goes there, and spends the answer's record
    assert [p.target_id for p in s.schedule(NOW + 0.5, [a, b])] == ["a"]
    second = turn("t1", SECOND)
    depth, _, _ = s.affinity.memory.affinity(second, {"a"})
    assert s.affinity.memory.answer_after(second, "a", depth, claim=False) == 0


def test_only_the_request_held_for_an_answer_has_it_counted_when_it_is_placed():
    """The predicted TTFT counts an answer as cached only for the request whose hold claimed it:
    counted for every request continuing one, a tree's children stayed on busy holders."""
    s, a, b = setup(answered=True)
    memory = s.affinity.memory
    second = turn("t1", SECOND)
    depth, _, _ = memory.affinity(second, {"a"})
    assert memory.answer_after(second, "a", depth, claim=False) == 0  # not held: not claimed
    s.admit(QueueEntry(second, enqueued_at=NOW, seq=1), NOW)
    assert [p.kind for p in s.schedule(NOW, [a, b])] == [Kind.HOLD]
    assert memory.answer_after(second, "a", depth, claim=False) == len(ANSWER) // 4


def test_without_the_answer_the_trie_matches_too_little_to_wait():
    """What the trie alone sees (the behaviour before answers were recorded): the first turn's
    prompt is under `min_gain` of the second's, so the turn goes to the free replica."""
    s, a, b = setup(answered=False)
    s.admit(QueueEntry(turn("t1", SECOND), enqueued_at=NOW, seq=1), NOW)
    assert [p.target_id for p in s.schedule(NOW, [a, b])] == ["b"]


def test_an_answer_is_continued_once_so_a_fan_out_still_spreads():
    """A tree's children all continue their parent's answer: the first to ask claims it (it is
    held for the busy holder), the others weigh the holder by its prompts alone, as before, and
    go to the free replica. The first, settled after them, finds that replica holding the
    prompt too (its siblings' prefix) and follows them (lb.core.affinity `release`)."""
    s, a, b = setup(answered=True)
    memory = s.affinity.memory
    children = [turn(f"c{i}", FIRST + [{"role": "assistant", "content": ANSWER},
                                       {"role": "user", "content": f"Branch {i}: go on."}]) for i in range(3)]
    for i, c in enumerate(children):
        s.admit(QueueEntry(c, enqueued_at=NOW, seq=i + 1), NOW)
    depth, _, _ = memory.affinity(children[1], {"a"})
    got = {p.entry.facts.request_id: (p.kind, p.target_id) for p in s.schedule(NOW, [a, b])}
    assert got["c1"] == got["c2"] == (Kind.REPLICA, "b")
    assert got["c0"] == (Kind.REPLICA, "b")
    # c0 claimed the answer: the others could not count it
    assert memory.answer_after(children[1], "a", depth, claim=False) == 0


def test_a_replica_that_leaves_takes_its_answers_with_it():
    s, a, b = setup(answered=True)
    memory = s.affinity.memory
    second = turn("t1", SECOND)
    depth, _, _ = memory.affinity(second, {"a"})
    assert memory.answer_after(second, "a", depth) > 0
    s.forget("a")
    assert memory.answer_after(second, "a", depth) == 0
