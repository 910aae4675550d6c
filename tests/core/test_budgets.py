"""Tenant token budgets: the sliding window over shared buckets, the verdict and Retry-After."""
from __future__ import annotations

import pytest

from lb.core.budgets import BudgetConfig, limit_for, verdict, window_buckets

CFG = BudgetConfig(tokens_per_minute=1000, overrides={"big": 5000, "free": 0}, window_s=60.0, bucket_s=5.0)


def test_limits_per_tenant_with_overrides():
    assert limit_for(CFG, "a") == 1000 and limit_for(CFG, "big") == 5000
    assert limit_for(CFG, "free") is None and limit_for(CFG, None) is None
    assert not BudgetConfig().enabled and CFG.enabled


def test_window_covers_twelve_buckets_and_the_part_of_the_oldest_still_inside():
    now = 1000.0 + 2.5  # half way into bucket 200
    buckets = window_buckets(CFG, now)
    assert buckets[0] == (188, pytest.approx(0.5)) and buckets[-1] == (200, 1.0) and len(buckets) == 13


def test_below_the_limit_admits_at_it_refuses_with_the_wait_for_old_buckets_to_leave():
    now = 1002.5
    assert verdict(CFG, 1000, {200: 999}, now).allowed
    v = verdict(CFG, 1000, {190: 600, 200: 500}, now)
    assert not v.allowed and v.used == pytest.approx(1100) and v.remaining == 0
    # bucket 190 ([950, 955)) leaves the window at 955 + 60 = 1015: 12.5 s from now, then 500 < 1000
    assert v.retry_after_s == pytest.approx(12.5)
    # spent all in the current bucket: nothing frees it before the bucket leaves, a whole window on
    assert verdict(CFG, 1000, {200: 5000}, now).retry_after_s == pytest.approx(62.5)
    # the oldest bucket counts by the fraction of it still inside the window
    assert verdict(CFG, 1000, {188: 1800}, now).used == pytest.approx(900)


@pytest.mark.parametrize("data, key", [({"tokens_per_minute": -1}, "tokens_per_minute"),
                                       ({"bucket_s": 7.0}, "bucket_s"),
                                       ({"overrides": {"a": "lots"}}, "overrides.a")])
def test_bad_budget_config_names_the_key(data, key):
    with pytest.raises(ValueError, match=key):
        BudgetConfig.from_dict(data)
