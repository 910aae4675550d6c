"""Another instance's pushes count against a replica's headroom until a probe includes them."""
from __future__ import annotations

from collections import deque

from lb.core.instances import MAX_REMOTE_LOG, note_remote_push, remote_unseen
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
    assert remote_unseen(log, 100.05) == (1, 50)
    assert remote_unseen(log, 200.0) == (0, 0) and not log  # old entries dropped


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
