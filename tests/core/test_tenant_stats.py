"""Bounded per-tenant figures: top K by recent service labelled, the rest in `other`, totals
consistent while tenants move in and out, memory bounded whatever the number of tenants."""
from __future__ import annotations

from lb.core.tenant_stats import NONE, OTHER, TenantStats


def total(snap) -> int:
    return sum(t.service_tokens for t in snap.values())


def test_top_k_by_recent_service_get_labels_and_the_rest_share_other():
    s = TenantStats(top_k=2, half_life_s=60.0)
    for tenant, tokens in (("a", 500), ("b", 300), ("c", 100), ("d", 50), (None, 10)):
        s.served(tenant, tokens, now=0.0)
    snap = s.snapshot(now=1.0)
    assert set(snap) == {"a", "b", OTHER}
    # before the first re-rank nobody had a label: everything so far is in `other`
    assert snap[OTHER].service_tokens == 960 and total(snap) == 960
    s.served("a", 5, now=2.0)
    s.served("c", 7, now=2.0)
    snap = s.snapshot(now=3.0)
    assert snap["a"].service_tokens == 5 and snap[OTHER].service_tokens == 967 and total(snap) == 972


def test_tenants_move_in_and_out_and_every_series_only_grows():
    s = TenantStats(top_k=1, half_life_s=10.0)
    s.served("old", 1000, now=0.0)
    s.snapshot(now=0.0)
    s.served("old", 100, now=1.0)
    s.waited("old", 0.3)
    s.throttled("old")
    before = s.snapshot(now=1.0)
    assert set(before) == {"old", OTHER} and before["old"].service_tokens == 100
    seen = {k: (v.service_tokens, v.throttled, sum(v.wait_counts)) for k, v in before.items()}
    # `old` goes quiet; `new` serves less in all but more recently: after a few half-lives it leads
    s.served("new", 400, now=60.0)
    after = s.snapshot(now=61.0)
    assert set(after) == {"new", OTHER}
    assert after["new"].service_tokens == 0  # its tokens so far were counted under `other`
    assert after[OTHER].service_tokens == seen[OTHER][0] + 100 + 400  # old's series folded in
    assert after[OTHER].throttled == 1 and sum(after[OTHER].wait_counts) == 1
    assert total(after) == 1000 + 100 + 400
    assert after[OTHER].service_tokens >= seen[OTHER][0]


def test_no_tenant_is_its_own_label_and_a_tenant_named_other_never_gets_one():
    s = TenantStats(top_k=5)
    s.served("", 50, now=0.0)
    s.served(OTHER, 900, now=0.0)
    snap = s.snapshot(now=0.0)
    assert set(snap) == {NONE, OTHER}
    s.served(OTHER, 1, now=1.0)
    assert s.snapshot(now=1.0)[OTHER].service_tokens == 951


def test_queue_wait_histogram_buckets_and_sum():
    s = TenantStats(top_k=1, wait_bounds=(0.1, 1.0))
    s.served("a", 1, now=0.0)
    s.snapshot(now=0.0)
    for w in (0.05, 0.1, 0.5, 3.0):
        s.waited("a", w)
    a = s.snapshot(now=0.0)["a"]
    assert a.wait_counts == [2, 1, 1] and a.cumulative() == [2, 3, 4] and abs(a.wait_sum - 3.65) < 1e-9


def test_memory_is_bounded_with_many_distinct_tenants_and_the_heavy_one_keeps_its_label():
    s = TenantStats(top_k=3, half_life_s=30.0)
    for i in range(20_000):
        s.served(f"t{i}", 1, now=i * 0.001)
        if i % 100 == 0:
            s.served("heavy", 50, now=i * 0.001)
    assert len(s._recent) <= s.max_tracked
    snap = s.snapshot(now=20.0)
    assert "heavy" in snap and len(snap) == 4
    assert total(snap) == 20_000 + 200 * 50
