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
