from __future__ import annotations

from collections import Counter

import pytest

from lb.core.policies import POLICIES, load, make_policy, policy_options
from lb.core.prefix import DEFAULT_BLOCK_CHARS
from lb.core.types import ReplicaView, RequestFacts

BLOCK = DEFAULT_BLOCK_CHARS


def views(n: int, **kw) -> list[ReplicaView]:
    return [ReplicaView(id=f"r{i}", url=f"http://127.0.0.1:{9000 + i}", **kw) for i in range(n)]


def prompt(*parts: tuple[str, int]) -> str:
    """Text of whole blocks: ("sys", 4) is four blocks unique to the tag "sys"."""
    return "".join(f"{tag}-{i}".ljust(BLOCK, ".") for tag, n in parts for i in range(n))


def req(text: str = "", rid: str = "q", **kw) -> RequestFacts:
    return RequestFacts(request_id=rid, model="m", prompt=text, **kw)


def by_id(vs: list[ReplicaView]) -> dict[str, ReplicaView]:
    return {v.id: v for v in vs}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_picks_only_candidates_and_none_from_nothing(name):
    policy = make_policy(name, seed=3)
    assert policy.name == name
    vs = views(5)
    for k in range(30):
        r = req(prompt(("doc", k % 4), ("q", 3)), rid=str(k), session=f"s{k % 7}")
        cands = vs[k % 3 :]
        target = policy.choose(r, cands, now=float(k))
        assert target in {v.id for v in cands}
        policy.observe(r, target, float(k))
    assert policy.choose(req(prompt(("doc", 2))), [], now=99.0) is None


def test_make_policy_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="no option 'vnodes'.*min_match_ratio"):
        make_policy("prefix-trie", vnodes=5)
    assert policy_options("consistent-hash") == {"vnodes": 100}


def test_load_takes_the_larger_of_engine_and_lb_counts():
    assert load(ReplicaView(id="a", url="", pending=2, running=3, pushed_since_probe=1, outstanding=4)) == 6
    assert load(ReplicaView(id="a", url="", pending=0, running=1, outstanding=4)) == 4
    assert load(ReplicaView(id="a", url="", reports_pending=False, running=9, outstanding=2)) == 2


# ---- prefix-trie ------------------------------------------------------------------------


def test_prefix_trie_routes_to_longest_available_match():
    policy = make_policy("prefix-trie", seed=1)
    vs = by_id(views(3))
    conversation = prompt(("chat", 6))
    policy.observe(req(conversation[: 3 * BLOCK]), "r0", 1.0)
    policy.observe(req(conversation), "r1", 2.0)
    follow_up = req(conversation + prompt(("turn2", 2)))
    assert policy.choose(follow_up, list(vs.values()), 3.0) == "r1"
    assert policy.last.reason == "prefix" and policy.last.matched_blocks == 6 and policy.last.total_blocks == 8
    # r1 is full: the best *available* match is r0's shorter one, not a cold replica
    assert policy.choose(follow_up, [vs["r0"], vs["r2"]], 3.0) == "r0"
    assert policy.last.matched_blocks == 3


def test_prefix_trie_below_threshold_takes_least_load():
    policy = make_policy("prefix-trie", seed=1, min_match_ratio=0.5)
    vs = views(3)
    vs[0].outstanding, vs[1].outstanding, vs[2].outstanding = 5, 9, 1
    policy.observe(req(prompt(("sys", 2))), "r1", 1.0)
    weak = req(prompt(("sys", 2), ("user-question", 6)))  # 2/8 = 0.25 < 0.5
    assert policy.choose(weak, vs, 2.0) == "r2"
    # r1 holds 2 of the 8 blocks; the explanation is about r2, the replica chosen, which holds none
    assert policy.last.reason == "load" and policy.last.matched_blocks == 0 and policy.last.total_blocks == 8
    strong = req(prompt(("sys", 2), ("user-question", 1)))  # 2/3 >= 0.5
    assert policy.choose(strong, vs, 2.0) == "r1"


def test_prefix_trie_equal_matches_break_by_load_then_randomly():
    policy = make_policy("prefix-trie", seed=7)
    vs = views(4)
    shared = prompt(("doc", 4))
    for v in vs:
        policy.observe(req(shared), v.id, 1.0)
    vs[3].outstanding = 3
    picks = Counter(policy.choose(req(shared, rid=str(k)), vs, 2.0) for k in range(300))
    assert set(picks) == {"r0", "r1", "r2"}  # r3 loses on load; the rest share the tie
    assert min(picks.values()) > 60


def answered(policy, target: str, step_s: float, tokens: int = 11, rid: str = "a") -> None:
    """`target` answered a request of `tokens` output tokens at `step_s` per token."""
    policy.served(req(rid=rid), target, 0.1, 0.1 + step_s * (tokens - 1), tokens, 0.0)


def test_prefix_trie_ties_go_to_the_replica_it_learned_is_faster():
    policy = make_policy("prefix-trie", seed=3)
    vs = views(3)
    answered(policy, "r0", 0.02)
    answered(policy, "r1", 0.02)
    answered(policy, "r1", 0.04, rid="b")  # one slow answer (a big batch) leaves r1's floor where it was
    answered(policy, "r2", 0.05)  # r2 is 2.5x slower than the typical replica
    picks = Counter(policy.choose(req(rid=str(k)), vs, 1.0) for k in range(200))
    assert set(picks) == {"r0", "r1"}  # equal load: never the slow one
    vs[0].outstanding, vs[1].outstanding = 2, 2  # (2 + 1) x 1 = 3 > (0 + 1) x 2.5
    assert policy.choose(req(rid="x"), vs, 1.0) == "r2"
    assert policy.last.reason == "load"


def test_prefix_trie_treats_speeds_within_the_band_as_equal_and_learns_nothing_from_one_token():
    policy = make_policy("prefix-trie", seed=5)
    vs = views(2)
    answered(policy, "r0", 0.020)
    answered(policy, "r1", 0.028)  # 1.4x: noise between identical replicas, not hardware
    answered(policy, "r0", 0.001, tokens=1)  # no inter-token time in a one-token answer
    vs[0].outstanding = 1
    assert all(policy.choose(req(rid=str(k)), vs, 1.0) == "r1" for k in range(20))  # plain least load


def test_prefix_trie_forget_and_bound():
    policy = make_policy("prefix-trie", seed=1, max_nodes=5)
    vs = views(2)
    policy.observe(req(prompt(("a", 4))), "r0", 1.0)
    policy.observe(req(prompt(("b", 4))), "r1", 2.0)
    trie = policy.scorers[0].trie
    assert len(trie) == 5
    policy.forget("r1")
    assert trie.targets() == {"r0"}
    vs[0].outstanding = 10
    assert policy.choose(req(prompt(("b", 4))), vs, 3.0) == "r1"  # no memory of b: least load


def test_prefix_trie_tenant_isolation_hides_other_tenants_prefixes():
    shared = prompt(("secret-doc", 6))
    for isolate, expected in ((False, "r0"), (True, "r1")):
        policy = make_policy("prefix-trie", seed=1, isolate_tenants=isolate)
        vs = views(2)
        vs[0].outstanding = 5  # without the prefix hint, load decides: r1
        policy.observe(req(shared, user="alice"), "r0", 1.0)
        assert policy.choose(req(shared, user="mallory"), vs, 2.0) == expected
        assert policy.choose(req(shared, user="alice"), vs, 2.0) == "r0"


# ---- consistent-hash ----------------------------------------------------------------------


def test_consistent_hash_is_sticky_per_session_and_walks_past_unavailable():
    policy = make_policy("consistent-hash", seed=1)
    vs = views(4)
    for v in vs:
        policy.register(v.id)
    owner = policy.choose(req(session="s1"), vs, 0.0)
    assert all(policy.choose(req(session="s1", rid=str(k)), vs, 0.0) == owner for k in range(10))
    walk = list(policy.ring.walk("s1"))
    others = [v for v in vs if v.id != owner]
    assert policy.choose(req(session="s1"), others, 0.0) == walk[1]
    assert policy.choose(req(session="s1"), vs, 1.0) == owner  # back once available again


def test_consistent_hash_keys_on_user_when_no_session():
    policy = make_policy("consistent-hash", seed=1)
    vs = views(8)
    targets = {policy.choose(req(user="bob", rid=str(k)), vs, 0.0) for k in range(20)}
    assert len(targets) == 1


# ---- simple ones --------------------------------------------------------------------------


def test_round_robin_cycles_in_id_order_across_changing_candidates():
    policy = make_policy("round-robin")
    vs = views(3)
    assert [policy.choose(req(), vs, 0.0) for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    assert policy.choose(req(), [vs[0], vs[2]], 0.0) == "r2"


def test_least_load_ties_spread_randomly_and_reproducibly():
    vs = views(4)
    vs[0].running = 2
    picks = [make_policy("least-load", seed=5).choose(req(), vs, 0.0) for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same choice
    policy = make_policy("least-load", seed=5)
    spread = Counter(policy.choose(req(), vs, 0.0) for _ in range(300))
    assert set(spread) == {"r1", "r2", "r3"} and min(spread.values()) > 60


def test_power_of_two_never_picks_the_busier_of_its_pair():
    policy = make_policy("power-of-two", seed=2)
    vs = views(4)
    for i, v in enumerate(vs):
        v.outstanding = i * 10
    picks = Counter(policy.choose(req(), vs, 0.0) for _ in range(600))
    assert "r3" not in picks  # the busiest loses every pair it is drawn in
    assert picks["r0"] > picks["r1"] > picks["r2"] > 0  # 1/2, 1/3, 1/6 of pairs


# ---- cache-aware (SGLang Router) --------------------------------------------------------


def test_cache_aware_follows_cache_when_balanced():
    policy = make_policy("cache-aware", seed=1)
    vs = views(3)
    policy.observe(req(prompt(("doc", 4))), "r2", 1.0)
    assert policy.choose(req(prompt(("doc", 4), ("q", 2))), vs, 2.0) == "r2"  # 4/6 > 0.3
    assert policy.last.reason == "cache"


def test_cache_aware_miss_goes_to_smallest_tree():
    policy = make_policy("cache-aware", seed=1)
    vs = views(3)
    policy.observe(req(prompt(("a", 5))), "r0", 1.0)
    policy.observe(req(prompt(("b", 2))), "r1", 1.0)
    assert policy.choose(req(prompt(("new", 4))), vs, 2.0) == "r2"
    assert policy.last.reason == "smallest-tree"
    assert policy.choose(req(prompt(("new", 4))), vs[:2], 2.0) == "r1"


def test_cache_aware_imbalance_overrides_cache():
    policy = make_policy("cache-aware", seed=1)
    vs = views(3)
    policy.observe(req(prompt(("doc", 4))), "r0", 1.0)
    vs[0].outstanding, vs[1].outstanding, vs[2].outstanding = 100, 30, 20
    assert policy.choose(req(prompt(("doc", 4))), vs, 2.0) == "r2"  # 100-20 > 64 and 100 > 1.5*20
    assert policy.last.reason == "imbalance"
    vs[2].outstanding = 70  # 100-30 > 64 but 100 < 1.5*70... min is 30: still imbalanced
    assert policy.choose(req(prompt(("doc", 4))), vs, 2.0) == "r1"
    vs[1].outstanding = 40  # 100-40 = 60 <= 64: balanced, cache wins again
    assert policy.choose(req(prompt(("doc", 4))), vs, 2.0) == "r0"


def test_cache_aware_does_not_seek_the_best_available_match():
    """The baseline's difference from prefix-trie: best match unavailable → smallest tree."""
    vs = by_id(views(3))
    text = prompt(("conv", 6))
    outcomes = {}
    for name in ("cache-aware", "prefix-trie"):
        policy = make_policy(name, seed=1)
        policy.observe(req(text[: 4 * BLOCK]), "r0", 1.0)
        policy.observe(req(text), "r1", 2.0)
        outcomes[name] = policy.choose(req(text), [vs["r0"], vs["r2"]], 3.0)
    assert outcomes == {"cache-aware": "r2", "prefix-trie": "r0"}
