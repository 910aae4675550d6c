"""Property tests of the routing core (hypothesis): trie, ring, queue orders."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lb.core.policies import make_policy
from lb.core.prefix import DEFAULT_BLOCK_CHARS, PrefixTrie, block_hashes
from lb.core.queueing import QUEUE_ORDERS, make_queue
from lb.core.ring import HashRing
from lb.core.types import QueueEntry, ReplicaView, RequestFacts, Tier

TARGETS = [f"r{i}" for i in range(6)]
BLOCKS = ["A", "B", "C", "D"]  # a tiny alphabet of blocks, so prompts share prefixes often


def text_of(letters: list[str]) -> str:
    return "".join(letter * DEFAULT_BLOCK_CHARS for letter in letters)


prompts = st.lists(st.sampled_from(BLOCKS), min_size=0, max_size=8)
trie_ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), prompts, st.sampled_from(TARGETS)),
        st.tuples(st.just("forget"), st.sampled_from(TARGETS)),
        st.tuples(st.just("match"), prompts, st.sets(st.sampled_from(TARGETS))),
        st.tuples(st.just("bound"), st.sampled_from(TARGETS), st.integers(1, 6)),
    ),
    max_size=60,
)


def check_trie_invariants(trie: PrefixTrie, chains: list[tuple[bytes, ...]]) -> None:
    nodes = trie._nodes
    assert len(nodes) <= trie.max_nodes
    assert Counter(t for holders in nodes.values() for t in holders) == trie._held
    assert all(nodes.values())
    for chain in chains:  # prefix-closed, and a target held below is held above
        for parent, child in zip(chain, chain[1:]):
            if child in nodes:
                assert parent in nodes and set(nodes[child]) <= set(nodes[parent])
    for target, cap in trie._cap.items():  # a bounded target holds at most its bound, and its
        assert trie.size_of(target) <= cap  # use order lists exactly the nodes it holds
        assert set(trie._lru[target]) == {h for h, holders in nodes.items() if target in holders}


@settings(max_examples=150, deadline=None)
@given(ops=trie_ops, max_nodes=st.integers(1, 12))
def test_trie_returns_only_wanted_live_targets_at_a_maximal_depth_within_bound(ops, max_nodes):
    trie = PrefixTrie(max_nodes=max_nodes)
    live: set[str] = set()
    chains = []
    for now, op in enumerate(ops):
        if op[0] == "insert":
            chain = block_hashes(text_of(op[1]))
            trie.insert(chain, op[2], float(now))
            chains.append(chain)
            live.add(op[2])
        elif op[0] == "forget":
            trie.forget(op[1])
            live.discard(op[1])
        elif op[0] == "bound":
            trie.bound(op[1], op[2])
            if not trie.size_of(op[1]):
                live.discard(op[1])
        else:
            chain, wanted = block_hashes(text_of(op[1])), op[2]
            depth, holders = trie.match(chain, wanted)
            assert set(holders) <= wanted & live
            assert (depth == 0) == (not holders)
            # maximal: no wanted target matches deeper, and every one that matches as deep is returned
            depths = {t: trie.match(chain, {t})[0] for t in wanted}
            assert all(d <= depth for d in depths.values())
            assert set(holders) == {t for t, d in depths.items() if d == depth and d > 0}
        check_trie_invariants(trie, chains)
        assert trie.targets() <= live


@settings(max_examples=60, deadline=None)
@given(
    history=st.lists(st.tuples(prompts, st.sampled_from(TARGETS)), max_size=30),
    query=prompts,
    available=st.sets(st.sampled_from(TARGETS + ["new-replica"])),
    policy_name=st.sampled_from(["prefix-trie", "cache-aware", "consistent-hash"]),
)
def test_routing_policies_never_return_an_unavailable_or_unknown_target(history, query, available, policy_name):
    policy = make_policy(policy_name, seed=0, **({"max_nodes": 8} if policy_name != "consistent-hash" else {}))
    for now, (letters, target) in enumerate(history):
        policy.observe(RequestFacts(request_id=str(now), model="m", prompt=text_of(letters)), target, float(now))
    candidates = [ReplicaView(id=t, url="") for t in sorted(available)]
    chosen = policy.choose(RequestFacts(request_id="q", model="m", prompt=text_of(query), session="s"), candidates, 99.0)
    assert chosen in available if available else chosen is None


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 24), vnodes=st.sampled_from([50, 100, 200]))
def test_adding_a_node_moves_about_one_in_n_keys_and_only_to_it(n, vnodes):
    ring = HashRing(vnodes)
    for i in range(n):
        ring.add(f"replica-{i}")
    keys = [f"session-{k}" for k in range(4000)]
    before = {k: ring.owner(k) for k in keys}
    ring.add("replica-new")
    moved = [k for k in keys if ring.owner(k) != before[k]]
    assert all(ring.owner(k) == "replica-new" for k in moved)
    fair = len(keys) / (n + 1)
    assert 0.5 * fair < len(moved) < 1.6 * fair, (len(moved), fair)


queue_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.sampled_from(["u1", "u2", "u3"]), st.sampled_from(list(Tier)), st.floats(0, 100)),
        st.tuples(st.just("pop"), st.floats(0, 200)),
        st.tuples(st.just("remove"), st.integers(0, 200)),
        st.tuples(st.just("place"), st.floats(0, 200), st.integers(0, 3)),
    ),
    max_size=80,
)


@pytest.mark.parametrize("order", sorted(QUEUE_ORDERS))
@settings(max_examples=120, deadline=None)
@given(ops=queue_ops)
def test_queue_orders_never_lose_or_duplicate_an_entry(order, ops):
    """Every registered order: what goes in comes out exactly once (pop, remove, or left)."""
    q = make_queue(order)
    queued: list[QueueEntry] = []  # push order: FCFS must match it
    out: list[QueueEntry] = []
    for i, op in enumerate(ops):
        if op[0] == "push":
            facts = RequestFacts(request_id=f"q{i}", model="m", user=op[1], tier=op[2], arrival=op[3])
            e = QueueEntry(facts, enqueued_at=op[3], seq=i)
            q.push(e)
            queued.append(e)
        elif op[0] == "pop":
            e = q.pop(op[1])
            assert (e is None) == (not queued)
            if e is not None:
                if order == "fcfs":
                    assert e is queued[0]
                queued.remove(e)
                out.append(e)
        elif op[0] == "remove" and queued:
            e = queued[op[1] % len(queued)]
            assert q.remove(e) and not q.remove(e)
            queued.remove(e)
            out.append(e)
        elif op[0] == "place":  # the dispatcher's pass: take every k-th entry, skipping others
            for j, e in enumerate(list(q.iter_in_order(op[1]))):
                if op[2] and j % op[2] == 0:
                    assert q.remove(e)
                    queued.remove(e)
                    out.append(e)
        seen = list(q.iter_in_order(200.0))
        assert len(q) == len(queued) == len(seen) == len(set(map(id, seen)))
        assert set(map(id, seen)) == set(map(id, queued))
        if order == "fcfs":
            assert seen == queued
    assert len(set(map(id, out))) == len(out)
