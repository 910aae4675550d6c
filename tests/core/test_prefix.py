from __future__ import annotations

import pytest

from lb.core.prefix import DEFAULT_BLOCK_CHARS, BytesPerToken, PrefixTrie, block_hashes, prompt_bytes, request_chain
from lb.core.types import RequestFacts

BLOCK = DEFAULT_BLOCK_CHARS


def text(n_blocks: int, seed: str = "a") -> str:
    return "".join(f"{seed}{i:03d}".ljust(BLOCK, ".") for i in range(n_blocks))


def test_chain_is_prefix_stable_and_chained():
    base = text(4)
    longer = base + text(3, "b")
    assert block_hashes(longer)[:4] == block_hashes(base)
    assert len(block_hashes(base + "tail shorter than a block")) == 4  # partial block dropped
    # the same block after a different history hashes differently: hashes are chained
    other = text(1, "z") + base[BLOCK:]
    assert block_hashes(other)[1:] != block_hashes(base)[1:]
    assert block_hashes("short") == ()


def test_non_ascii_text_hashes_deterministically():
    s = "日本語のテキスト" * 40
    assert block_hashes(s) == block_hashes(s)
    assert len(block_hashes(s)) == len(s.encode()) // BLOCK


def test_tenant_salt_separates_tenants():
    t = text(5)
    assert set(block_hashes(t, salt="alice")).isdisjoint(block_hashes(t, salt="bob"))
    assert block_hashes(t, salt="alice") == block_hashes(t, salt="alice")
    assert set(block_hashes(t, salt="alice")).isdisjoint(block_hashes(t))


def test_request_chain_hashes_once_per_request_and_setting():
    req = RequestFacts(request_id="r", model="m", prompt=text(3), user="alice")
    first = request_chain(req)
    assert request_chain(req) is first
    isolated = request_chain(req, isolate_tenants=True)
    assert isolated == block_hashes(req.prompt, salt="alice") != first


def test_match_takes_longest_prefix_among_wanted_and_stops_early():
    trie = PrefixTrie()
    chain = block_hashes(text(8))
    trie.insert(chain[:3], "short", now=1.0)
    trie.insert(chain[:6], "long", now=2.0)
    assert trie.match(chain) == (6, ["long"])
    assert trie.match(chain, {"short"}) == (3, ["short"])
    depth, holders = trie.match(chain, {"short", "long"})
    assert (depth, holders) == (6, ["long"])
    assert trie.match(chain, {"other"}) == (0, [])
    assert trie.match(block_hashes(text(4, "q"))) == (0, [])


def test_depths_gives_each_target_its_own_match():
    trie = PrefixTrie()
    chain = block_hashes(text(8))
    trie.insert(chain[:3], "short", now=1.0)
    trie.insert(chain[:6], "long", now=2.0)
    trie.insert(chain, "full", now=3.0)
    assert trie.depths(chain, ["short", "long", "full", "none"]) == {"short": 3, "long": 6, "full": 8, "none": 0}
    assert trie.depths((), ["short"]) == {"short": 0}


def test_match_stops_where_no_wanted_target_remains_below():
    trie = PrefixTrie()
    a = block_hashes(text(4) + text(4, "x"))
    b = block_hashes(text(4) + text(4, "y"))
    trie.insert(a, "ra", 1.0)
    trie.insert(b, "rb", 1.0)
    # shared 4 blocks held by both; below, only ra holds a's branch
    assert trie.match(a, {"rb"}) == (4, ["rb"])
    assert sorted(trie.match(a[:4])[1]) == ["ra", "rb"]


def test_size_bound_evicts_oldest_leaves_first():
    trie = PrefixTrie(max_nodes=10)
    old = block_hashes(text(6, "o"))
    new = block_hashes(text(6, "n"))
    trie.insert(old, "r1", now=1.0)
    trie.insert(new, "r2", now=2.0)
    assert len(trie) == 10 and trie.evictions == 2
    # the old path lost its two deepest nodes, never an inner one
    assert trie.match(old) == (4, ["r1"])
    assert trie.match(new) == (6, ["r2"])
    assert trie.size_of("r1") == 4 and trie.size_of("r2") == 6


def test_a_targets_cache_size_bounds_what_is_remembered_for_it_leaves_first():
    """An engine holds only what its KV fits: the trie forgets a replica's least recently used
    prefixes past its bound (another replica's copies stay) instead of believing it holds
    everything it was ever sent."""
    trie = PrefixTrie()
    a, b, c = (block_hashes(text(4, s)) for s in "abc")
    trie.insert(a, "r1", 1.0)
    trie.insert(a, "r2", 1.5)
    trie.insert(b, "r1", 2.0)
    trie.bound("r1", 6)  # 8 held: a's two deepest blocks go, not an inner one
    assert trie.size_of("r1") == 6
    assert trie.match(a, {"r1"}) == (2, ["r1"]) and trie.match(b, {"r1"}) == (4, ["r1"])
    assert trie.match(a, {"r2"}) == (4, ["r2"])  # r2 is unbounded and keeps its copy
    trie.insert(a, "r1", 3.0)  # used again: now b is the oldest
    trie.insert(c, "r1", 4.0)
    assert trie.size_of("r1") == 6
    assert trie.match(c, {"r1"})[0] == 4 and trie.match(b, {"r1"})[0] == 0
    assert trie.match(a, {"r1"})[0] == 2
    trie.forget("r1")
    trie.bound("r1", 1)  # a bound for a target that holds nothing: nothing to drop
    assert trie.size_of("r1") == 0 and trie.match(a) == (4, ["r2"])


def test_reuse_refreshes_a_path():
    trie = PrefixTrie(max_nodes=8)
    a, b, c = (block_hashes(text(4, s)) for s in "abc")
    trie.insert(a, "r", 1.0)
    trie.insert(b, "r", 2.0)
    trie.insert(a, "r", 3.0)  # a is now newer than b
    trie.insert(c, "r", 4.0)
    assert trie.match(a) == (4, ["r"])
    assert trie.match(b) == (0, [])


def test_forget_removes_a_target_everywhere():
    trie = PrefixTrie()
    chain = block_hashes(text(5))
    trie.insert(chain, "r1", 1.0)
    trie.insert(chain[:2], "r2", 2.0)
    trie.forget("r1")
    assert trie.match(chain) == (2, ["r2"])
    assert len(trie) == 2 and trie.targets() == {"r2"} and trie.size_of("r1") == 0
    trie.forget("never-seen")
    trie.forget("r2")
    assert len(trie) == 0


def test_rejects_empty_bound():
    with pytest.raises(ValueError):
        PrefixTrie(max_nodes=0)


def test_bytes_per_token_learns_the_traffics_own_ratio_weighting_long_prompts():
    """An engine's KV in tokens becomes trie blocks at the bytes a token takes in this traffic:
    4 (ASCII English) until an engine reports its count, then what the counts say; a ratio of
    sums, so a short prompt's template tokens barely move it."""
    per_token = BytesPerToken()
    assert per_token.value() == 4.0
    cjk = "提示缓存" * 500  # 2,000 characters, 6,000 bytes, ~2,000 tokens
    per_token.observe(len(cjk.encode()), 2000)
    assert per_token.value() == 3.0
    for _ in range(20):
        per_token.observe(len(cjk.encode()), 2000)
        per_token.observe(len("hi".encode()), 12)  # a greeting inside a chat template
    assert 2.5 < per_token.value() <= 3.0
    per_token.observe(0, 10)
    per_token.observe(10, 0)  # nothing to learn from
    assert 2.5 < per_token.value() <= 3.0


def test_prompt_bytes_comes_with_the_chain_and_counts_utf8():
    req = RequestFacts(request_id="r", model="m", prompt="提示" * 100)
    request_chain(req)  # hashing encodes the prompt once and keeps its size
    assert req.extra["lb.prefix.prompt_bytes"] == 600
    assert prompt_bytes(req) == 600
    assert prompt_bytes(RequestFacts(request_id="s", model="m", prompt="héllo")) == 6  # not hashed: encoded here
