"""Another instance's pushes count against a replica's headroom until a probe includes them."""
from __future__ import annotations

from collections import deque

from lb.core.instances import MAX_REMOTE_LOG, note_remote_end, note_remote_push, remote_unseen
from lb.core.pushing import has_headroom
from lb.core.types import ReplicaView


def test_remote_pushes_after_our_probe_spend_headroom_and_a_later_probe_recounts_them():
    view = ReplicaView(id="r", url="", healthy=True, max_running=2, running=0, kv_free_tokens=10_000)
    log: deque = deque()
    assert has_headroom(view)
    note_remote_push(view, log, 100.0, 50, probe_started_at=99.0)  # after our probe: unseen by it
    note_remote_push(view, log, 100.1, 50, probe_started_at=99.0)
    assert view.pushed_since_probe == 2 and not has_headroom(view)  # the other instance used the room
    note_remote_push(view, log, 98.0, 50, probe_started_at=99.0)  # before it: the engine's count has it
    assert view.pushed_since_probe == 2
    # a probe that started at 100.05 answers: it saw the first, not the second
    assert remote_unseen(log, 100.05) == (1, 50, 0.0)
    assert remote_unseen(log, 200.0) == (0, 0, 0.0) and not log  # old entries dropped


def test_an_answered_remote_push_stops_counting_before_the_next_probe():
    view = ReplicaView(id="r", url="", healthy=True, max_running=1, running=0, kv_free_tokens=10_000)
    log: deque = deque()
    note_remote_push(view, log, 100.0, 50, 99.0, key="a", prefill=40.0)
    note_remote_push(view, log, 100.1, 70, 99.0, key="b", prefill=60.0)
    assert (view.pushed_since_probe, view.remote_since_probe, view.remote_prefill_since_probe) == (2, 2, 100.0)
    assert note_remote_end(view, log, "a", 99.0)  # the other instance's answer came back
    assert (view.pushed_since_probe, view.pushed_tokens_since_probe, view.remote_prefill_since_probe) == (1, 70, 60.0)
    assert not note_remote_end(view, log, "a", 99.0)  # twice, or never heard: nothing to take back
    assert note_remote_end(view, log, "b", 100.5)  # counted by a probe already: the probe's count stays
    assert view.pushed_since_probe == 1 and not log
    assert remote_unseen(log, 101.0) == (0, 0, 0.0)


def test_the_remote_log_is_bounded():
    view, log = ReplicaView(id="r", url=""), deque()
    for i in range(MAX_REMOTE_LOG + 10):
        note_remote_push(view, log, float(i), 1, probe_started_at=None)
    assert len(log) == MAX_REMOTE_LOG


def test_a_prefix_chain_travels_between_instances_bounded():
    from lb.core.instances import MAX_SHARED_BLOCKS, decode_chain, encode_chain
    from lb.core.prefix import block_hashes
    chain = block_hashes("x" * 100_000, 64)
    assert len(chain) > MAX_SHARED_BLOCKS
    assert decode_chain(encode_chain(chain)) == chain[:MAX_SHARED_BLOCKS]
    assert decode_chain("") == ()
    import pytest
    with pytest.raises(ValueError):
        decode_chain("abcd")  # not whole hashes


def test_messages_round_trip_and_anything_malformed_is_ignored():
    from lb.core.instances import (HeardEnd, HeardPush, encode_chain, end_message, parse_message, push_message)
    from lb.core.prefix import block_hashes
    chain = block_hashes("p" * 1000, 128)
    push = parse_message(push_message("a", "r1", 100.5, 900, encode_chain(chain), "req-1", 800))
    assert push == HeardPush("a", "r1", 100.5, 900, chain, "req-1", 800)
    assert parse_message(end_message("a", "r1", "req-1")) == HeardEnd("a", "r1", "req-1")
    assert parse_message(end_message("a", "r1", "req-1", chain[-1], 300)) == HeardEnd("a", "r1", "req-1", chain[-1], 300)
    assert parse_message(["end", "a", "r1", "req-1"]) == HeardEnd("a", "r1", "req-1")  # an earlier release
    old = parse_message(["a", "r1", 100.5, 900, ""])  # an instance of an earlier release
    assert old == HeardPush("a", "r1", 100.5, 900, (), "", 0)
    lora = parse_message(push_message("a", "r1", 100.5, 900, "", "req-2", 800, adapter="sql-lora"))
    assert lora.adapter == "sql-lora" and lora.key == "req-2"
    assert parse_message(push_message("a", "r1", 1.0, 9, "", "k", 8, adapter="x" * 300)).adapter == ""  # too long: not sent
    assert parse_message(["a", "r1", 1.0, 9, "", "k", 8, "", "", 7]).adapter == ""  # not a name
    for bad in (None, {}, [], ["end"], ["end", "a", "r1"], ["a", "r1", "x", 900, ""], ["a", "r1", float("nan"), 9, ""],
                ["a", "r1", 1.0, -5, ""], ["a", "r1", 1.0, 9, "abcd"], ["a", "r1", 1.0, 9, "", "k", "many"],
                ["a", "r1", 1e400, 9, ""], "text", ["end", "a", "r1", "k", "abcd", 5], ["end", "a", "r1", "k", "zz", 5],
                ["end", "a", "r1", "k", chain[0].hex(), -1], ["end", "a", "r1", "k", chain[0].hex()],
                ["end", "a", "r1", "k", chain[0].hex(), 5, "more"]):
        assert parse_message(bad) is None, bad


def test_a_heard_push_prefills_what_its_replica_lacks_and_teaches_our_trie():
    from lb.core.instances import HeardPush, heard_prefill
    from lb.core.prefix import PrefixTrie, block_hashes
    trie = PrefixTrie()
    chain = block_hashes("q" * 1024, 128)  # 8 blocks
    trie.insert(chain[:6], "r1", 0.0)  # r1 holds 6 of its 8 blocks
    push = HeardPush("a", "r1", 1.0, 1100, chain, "k", 1000)
    assert heard_prefill(trie, push, 1.0) == 250.0
    assert heard_prefill(trie, push, 2.0) == 0.0  # now our trie says r1 holds all of it
    assert heard_prefill(trie, HeardPush("a", "r2", 1.0, 10, (), "k", 7), 2.0) == 7.0


def test_an_answer_heard_from_another_instance_is_where_the_next_turn_finds_its_history():
    from lb.core.instances import HeardEnd, heard_answer
    from lb.core.prefix import PrefixTrie, block_hashes
    trie = PrefixTrie()
    chain = block_hashes("q" * 1024, 128)
    trie.insert(chain, "r1", 0.0)  # the push, heard before
    heard_answer(trie, HeardEnd("a", "r1", "k", chain[-1], 300))
    assert trie.answer_after("r2", chain[-1], "turn-2") == 0  # only the replica that answered holds it
    assert trie.answer_after("r1", chain[-1], "turn-2") == 300
    heard_answer(trie, HeardEnd("a", "r1", "k2", chain[3], 0))  # answered nothing: nothing recorded
    heard_answer(trie, HeardEnd("a", "r1", "k3"))  # an earlier release: nothing recorded
    assert trie.answer_after("r1", chain[3], "turn-2") == 0


def test_two_instances_hold_one_leases_and_know_one_agents_steps_without_headers():
    """An undeclared agent's steps alternate between instances `a` and `b` (an L4 balancer in
    front): each answered step's lease and prompt end travel as a "lease" message, each placed
    step's interaction and the end it continued with its push. Both instances then hold the same
    lease, recognize every step as the first's interaction and learn the same continued share."""
    from lb.core.continuations import CONTINUED, IMPLICIT
    from lb.core.instances import (HeardLease, HeardPush, heard_interaction, heard_lease, lease_message, parse_message,
                                   push_message)
    from lb.core.leases import ANSWERED, KvLeases, lease_key
    from lb.core.prefix import request_chain
    from lb.core.queueing import make_queue
    from lb.core.types import RequestFacts

    inst = {"a": KvLeases(ttl_s=30.0), "b": KvLeases(ttl_s=30.0)}
    system = "You are a coding agent. Tools: read, edit, run. " * 30
    prompt = system + "Task: fix the failing test in parser.py. " * 8
    for i in range(8):
        here, there = ("a", "b") if i % 2 == 0 else ("b", "a")
        now = 100.0 + i
        call = RequestFacts(f"s{i}", "m", prompt=prompt, prompt_tokens=len(prompt) // 4, user="bot")
        leases = inst[here]
        leases.continuations.recognize(call, request_chain(call), now)
        assert call.extra[IMPLICIT] == "s0"  # every step, at either instance: the first step's interaction
        leases.arrived(call)
        leases.placed(call)
        pushed = parse_message(push_message(here, "r1", now, 900, "", call.request_id, 800, lease_key(call),
                                            call.extra.get(CONTINUED, b"")))
        assert isinstance(pushed, HeardPush) and pushed.interaction == "s0"
        heard_interaction(inst[there], pushed, now)
        assert inst[there].leased("r1", now) == 0  # the step is here: the lease it was held by ends there too
        leases.ended(call.request_id)
        leases.answered(call, "r1", len(prompt) // 4, 200, now + 0.5, request_chain(call))
        heard = parse_message(lease_message(here, "r1", call.extra[ANSWERED]))
        assert isinstance(heard, HeardLease)
        heard_lease(inst[there], make_queue("fcfs"), heard, now + 0.5)
        assert inst[there].leased("r1", now + 0.6) == inst[here].leased("r1", now + 0.6)
        prompt += f" read('parser{i}.py') " + "def parse(text): ... " * 40
    share_a, share_b = (inst[x].continuations.share("bot") for x in "ab")
    assert share_a == share_b > 0.8  # each learned every continuation, not only the half it received
    assert inst["a"].leased("r1", 108.0) > 0 and inst["a"].leased("r1", 140.0) == 0  # and it ends by time


def test_lease_messages_are_bounded_and_malformed_ones_ignored():
    from lb.core.instances import LEASE, MAX_KEY_CHARS, lease_message, parse_message, push_message
    from lb.core.leases import Answered
    assert lease_message("a", "r", Answered("k" * (MAX_KEY_CHARS + 1), 10, 5.0, b"", 0, "u")) is None
    assert parse_message(push_message("a", "r", 1.0, 9, "", "q", 8, "i" * (MAX_KEY_CHARS + 1))).interaction == ""
    good = lease_message("a", "r", Answered("k", 10, 5.0, b"\x01" * 16, 0, "u"))
    assert parse_message(good).answered == Answered("k", 10, 5.0, b"\x01" * 16, 0, "u")
    for bad in ([LEASE, "a", "r", "k", -1, 5.0, "", 0, "u"], [LEASE, "a", "r", "k", 1, float("inf"), "", 0, "u"],
                [LEASE, "a", "r", "k", 1, 5.0, "abcd", 0, "u"], [LEASE, "a", "r", "k", 1, 5.0, "", -3, "u"],
                [LEASE, "a", "r", 7, 1, 5.0, "", 0, "u"], [LEASE, "a", "r", "k", 1, 5.0, ""],
                ["a", "r", 1.0, 9, "", "q", 8, "i", "abcd"]):
        assert parse_message(bad) is None, bad


def test_an_interaction_keeps_the_rank_it_was_let_in_at_whichever_instance_queues_its_next_call():
    """Instance `a` dispatched the interaction's call at its user's counter then (its anchor,
    lb.core.queueing.WSCQueue); the lease message carries it, and `b`'s fair queue ranks the
    interaction's next call by it, as `a`'s would. An anchor `b` has of its own stays."""
    from lb.core.fairness import WeightedService
    from lb.core.instances import heard_lease, lease_message, parse_message
    from lb.core.leases import Answered, KvLeases
    from lb.core.queueing import make_queue
    from lb.core.types import QueueEntry, RequestFacts

    a, b = (make_queue("wsc", service=WeightedService()) for _ in range(2))
    call = RequestFacts("s1", "m", user="u", interaction_id="task-7", interaction_stage=1, prompt_tokens=100)
    entry = QueueEntry(call, enqueued_at=1.0, seq=1)
    a.push(entry)
    a.dispatch(entry)
    assert a.anchor("task-7") == 0.0 and b.anchor("task-7") is None
    message = lease_message("a", "r1", Answered("task-7", 500, 5.0, b"", 0, "u"), a.anchor("task-7"))
    heard_lease(KvLeases(), b, parse_message(message), 2.0)
    assert b.anchor("task-7") == 0.0
    heard_lease(KvLeases(), b, parse_message(lease_message("a", "r1", Answered("task-7", 5, 5.0, b"", 0, "u"), 99.0)),
                3.0)
    assert b.anchor("task-7") == 0.0
    assert parse_message(lease_message("a", "r1", Answered("k", 5, 5.0, b"", 0, "u"))).anchor is None
    assert parse_message(["lease", "a", "r", "k", 1, 5.0, "", 0, "u", float("nan")]) is None


def test_a_probe_counts_our_pushes_on_the_wire_though_the_engine_also_runs_another_instances():
    """The engine's running and waiting counts hold the other instances' requests beside ours.
    Taken all for ours, they hid our pushes still on their way there: the headroom was spent
    again. The other instance's pushes not answered yet, as heard, are not ours."""
    from lb.core.pushing import record_push, settle_probe

    view = ReplicaView(id="r", url="", healthy=True, kv_free_tokens=10**6)
    log = view.remote_log
    for i in range(4):  # the other instance's four, long running there
        note_remote_push(view, log, 90.0 + i, 100, probe_started_at=None, key=f"b{i}")
    assert len(view.remote_log) == 4
    for i in range(3):  # ours: one the engine runs, two still on their way
        record_push(view, 200, 1.0 + i * 0.1)
    # the engine holds five: the other instance's four and one of ours
    settle_probe(view, 3.0, view.outstanding, load_pending=0, load_running=5, early_reprobe_s=0.002,
                 others_at_start=len(view.remote_log))
    assert view.pushed_since_probe == 2 and view.pushed_tokens_since_probe == 400
    # one LB alone (no other instance heard): the same counts say the same as before
    alone = ReplicaView(id="s", url="", healthy=True, kv_free_tokens=10**6)
    for i in range(3):
        record_push(alone, 200, 1.0 + i * 0.1)
    settle_probe(alone, 3.0, alone.outstanding, load_pending=0, load_running=1, early_reprobe_s=0.002)
    assert alone.pushed_since_probe == 2
    # the other instance's answers end: it no longer counts them there
    for i in range(4):
        assert note_remote_end(view, log, f"b{i}", 99.0)
    assert not view.remote_log
