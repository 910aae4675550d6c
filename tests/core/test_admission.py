"""Token-aware SLO admission: admit, degrade, redirect, reject — with the arithmetic checked."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lb.core.admission import AdmissionConfig, RegionLoad, judge, estimate
from lb.core.tiers import TierConfig, TierTarget
from lb.core.types import RequestFacts, Tier

CFG = AdmissionConfig(enabled=True, prefill_tps=1000.0, decode_tps=10.0, min_degraded_tokens=20)
TIERS = TierConfig(targets={Tier.IW_F: TierTarget(1.0, 10.0), Tier.IW_N: TierTarget(5.0, 30.0),
                            Tier.NIW: TierTarget(3600.0, 3600.0)})
IDLE = RegionLoad(tokens_ahead=0, service_tps=1000.0)


def req(tier=Tier.IW_F, prompt=500, max_tokens=50) -> RequestFacts:
    return RequestFacts(request_id="r", model="m", prompt_tokens=prompt, max_tokens=max_tokens, tier=tier)


def test_estimate_is_queue_over_rate_plus_prefill_plus_decode():
    est = estimate(req(prompt=500), RegionLoad(tokens_ahead=2000, service_tps=1000.0), 40, CFG)
    assert est.wait_s == pytest.approx(2.0)
    assert est.ttft_s == pytest.approx(2.5)
    assert est.e2e_s == pytest.approx(6.5)
    assert estimate(req(), RegionLoad(5, 0.0), 1, CFG).wait_s == float("inf")
    assert estimate(req(), RegionLoad(0, 0.0), 1, CFG).wait_s == 0.0


def test_feasible_request_is_admitted():
    d = judge(req(max_tokens=50), IDLE, CFG, TIERS)  # TTFT 0.5, E2E 5.5
    assert (d.action, d.reason, d.tier) == ("admit", "feasible", Tier.IW_F)


def test_ttft_ok_but_too_many_tokens_is_degraded_to_fit_e2e():
    d = judge(req(max_tokens=500), IDLE, CFG, TIERS)  # E2E 50.5 > 10
    assert d.action == "degrade" and d.reason == "e2e-needs-fewer-tokens"
    assert d.max_tokens == int((10.0 - 0.5) * 10)  # 95 tokens fit
    assert d.degraded == "max_tokens=95; reason=e2e-needs-fewer-tokens; tier=iw-f"


def test_learned_length_is_used_when_max_tokens_is_absent():
    assert judge(req(max_tokens=None), IDLE, CFG, TIERS, expected_output=50).action == "admit"
    assert judge(req(max_tokens=None), IDLE, CFG, TIERS, expected_output=500).action == "degrade"


def test_redirect_to_a_peer_that_meets_the_tier():
    busy = RegionLoad(tokens_ahead=3000, service_tps=1000.0)  # local TTFT 3.5 > 1
    d = judge(req(), busy, CFG, TIERS, peers={"eu": RegionLoad(0, 1000.0), "asia": RegionLoad(100, 1000.0)})
    assert d.action == "redirect" and d.target == "eu" and d.estimate.ttft_s == pytest.approx(0.5)


def test_infeasible_fast_tier_is_relaxed_to_a_looser_tier():
    busy = RegionLoad(tokens_ahead=3000, service_tps=1000.0)  # TTFT 3.5: not IW-F, fine for IW-N
    d = judge(req(), busy, CFG, TIERS)
    assert d.action == "degrade" and d.reason == "tier-relaxed" and d.tier is Tier.IW_N and d.max_tokens is None
    d = judge(req(max_tokens=400), busy, CFG, TIERS)  # E2E 43.5 > 30: also fewer tokens
    assert d.tier is Tier.IW_N and d.max_tokens == int((30 - 3.5) * 10)


def test_infeasible_in_every_tier_is_rejected_with_retry_after():
    swamped = RegionLoad(tokens_ahead=20_000, service_tps=1000.0)  # TTFT 20.5 > 5
    d = judge(req(), swamped, CFG, TIERS)
    assert d.action == "reject" and d.reason == "ttft-infeasible"
    assert d.retry_after_s == 16  # ceil(20.5 - 5)
    dead = judge(req(), RegionLoad(tokens_ahead=10, service_tps=0.0), CFG, TIERS)
    assert (dead.action, dead.reason) == ("reject", "no-capacity")


def test_disabled_or_niw_is_never_judged():
    swamped = RegionLoad(tokens_ahead=1e9, service_tps=1.0)
    assert judge(req(), swamped, AdmissionConfig(enabled=False), TIERS).action == "admit"
    assert judge(req(tier=Tier.NIW), swamped, CFG, TIERS).action == "admit"


def test_config_from_dict():
    assert AdmissionConfig.from_dict({"enabled": True, "decode_tps": 50}).decode_tps == 50.0
    for bad in ({"decode_tps": 0}, {"min_degraded_tokens": 1.5}, {"enabled": 1}, {"speed": 1}):
        with pytest.raises(ValueError, match="admission"):
            AdmissionConfig.from_dict(bad)


def test_service_rate_learns_only_from_busy_intervals_with_a_fake_clock():
    from lb.core.admission import ServiceRate

    rate = ServiceRate(seed_tps=100.0, alpha=0.5, interval_s=1.0)
    rate.tick(0.0, busy=False)
    rate.completed(5000)
    rate.tick(1.0, busy=False)  # idle: 5000 tok/s says nothing about capacity
    assert rate.rate == 100.0
    rate.completed(1000)
    rate.tick(1.5, busy=True)  # interval not over yet
    assert rate.rate == 100.0
    rate.tick(2.0, busy=True)  # busy second at 1000 tok/s: halfway there (alpha 0.5)
    assert rate.rate == pytest.approx(550.0)


def test_tokens_of_uses_max_tokens_else_the_expectation():
    from lb.core.admission import tokens_of

    assert tokens_of(RequestFacts("a", "m", prompt_tokens=10, max_tokens=5), 99) == 15
    assert tokens_of(RequestFacts("a", "m", prompt_tokens=10), 99) == 109


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 500), st.one_of(st.none(), st.integers(0, 300)),
                          st.sampled_from([None, "chat", "agent"]), st.integers(0, 3), st.integers(0, 10 ** 6)),
                max_size=60))
@settings(max_examples=150, deadline=None)
def test_queued_work_is_the_sum_of_tokens_of_over_what_waits(ops):
    """The scheduler's running total equals summing `tokens_of` over the waiting calls with
    the estimate read now, whatever comes and goes (and however the estimates moved)."""
    from lb.core.admission import QueuedWork, tokens_of

    work, waiting = QueuedWork(), []
    estimates = {("chat", 0): 40.0, ("chat", 1): 7.0, ("agent", 2): 120.0}

    def expected(app, stage):
        return estimates.get((app, stage), estimates.get((app, 0), 64.0))

    for i, (add, prompt, max_tokens, app, stage, pick) in enumerate(ops):
        if add or not waiting:
            f = RequestFacts(f"r{i}", "m", prompt_tokens=prompt, max_tokens=max_tokens, app=app,
                             interaction_stage=stage)
            work.add(f)
            waiting.append(f)
        else:
            work.add(waiting.pop(pick % len(waiting)), -1)
        estimates[("chat", 0)] += 1.5  # the learned estimate moves while calls wait
        want = sum(tokens_of(f, expected(f.app, f.interaction_stage or 0)) for f in waiting)
        assert work.tokens(expected) == pytest.approx(want)
    if not waiting:
        assert not work.estimated and work.known == 0  # nothing left behind
