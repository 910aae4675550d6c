"""OIT, its RPM baseline, overload detection and tokens-wasted accounting, on a fake clock."""
from __future__ import annotations

from collections import deque

import pytest

from lb.core.fairness import (FairnessConfig, HitResult, InteractionLedger, OverloadDetector, RateLimit,
                              rate_limits, throttle_decision)
from lb.core.continuations import IMPLICIT
from lb.core.policies import make_policy
from lb.core.prefix import request_chain
from lb.core.queueing import make_queue
from lb.core.scheduler import Scheduler, SchedulerConfig
from lb.core.types import RequestFacts


def facts(rid="r", user="u", app="a", ix=None, stage=None, final=False) -> RequestFacts:
    return RequestFacts(request_id=rid, model="m", user=user, app=app, interaction_id=ix,
                        interaction_stage=stage, final_call=final)


class Window:
    """A sliding log with the stores' semantics, so decisions can be driven over time."""

    def __init__(self):
        self.hits: dict[str, deque] = {}

    def hit(self, rule: RateLimit, now: float) -> HitResult:
        q = self.hits.setdefault(rule.key, deque())
        while q and q[0] <= now - rule.window_s:
            q.popleft()
        ok = len(q) < rule.limit
        if ok:
            q.append(now)
        return HitResult(ok, len(q), q[0] + rule.window_s - now)


def test_rate_limits_per_user_and_app_with_overrides():
    cfg = FairnessConfig(user_rpm=10, app_rpm=100, user_rpm_overrides={"vip": 0, "abuser": 2}, window_s=30)
    assert rate_limits(facts(user="x", app="chat"), cfg) == [
        RateLimit("user", "rpm:user:x", 10, 30.0), RateLimit("app", "rpm:app:chat", 100, 30.0)]
    assert [r.scope for r in rate_limits(facts(user="vip"), cfg)] == ["app"]  # 0 = unlimited
    assert rate_limits(facts(user="abuser", app=None), cfg) == [RateLimit("user", "rpm:user:abuser", 2, 30.0)]
    assert rate_limits(facts(user=None, app=None), cfg) == []


OVER = [(RateLimit("user", "rpm:user:u", 5, 60.0), HitResult(False, 5, 12.3))]
UNDER = [(RateLimit("user", "rpm:user:u", 5, 60.0), HitResult(True, 3, 40.0))]


def test_oit_throttles_only_when_overloaded_and_never_mid_interaction():
    cfg = FairnessConfig(throttle="oit")
    assert throttle_decision(cfg, OVER, overloaded=False, mid_interaction=False) is None
    assert throttle_decision(cfg, OVER, overloaded=True, mid_interaction=True) is None
    assert throttle_decision(cfg, UNDER, overloaded=True, mid_interaction=False) is None
    t = throttle_decision(cfg, OVER, overloaded=True, mid_interaction=False)
    assert t is not None and t.scope == "user" and t.retry_after_s == 13
    assert (t.limit, t.remaining, t.reset_s) == (5, 0, 12.3) and "overloaded" in t.message


def test_rpm_baseline_throttles_regardless_of_load_and_interaction():
    cfg = FairnessConfig(throttle="rpm")
    assert throttle_decision(cfg, OVER, overloaded=False, mid_interaction=True) is not None
    assert throttle_decision(FairnessConfig(throttle="none"), OVER, overloaded=True, mid_interaction=False) is None


def test_overload_by_queue_length_or_unavailability_duration():
    d = OverloadDetector(queue_len=10, no_replica_s=2.0)
    d.observe(0.0, queue_len=10, any_available=True)
    assert not d.overloaded(0.0)
    d.observe(0.1, queue_len=11, any_available=True)
    assert d.reason(0.1) == "queue 11 > 10"
    d.observe(1.0, queue_len=0, any_available=False)
    d.observe(2.5, queue_len=0, any_available=False)
    assert not d.overloaded(3.0)  # unavailable for exactly 2 s: not yet *longer* than 2 s
    assert d.overloaded(3.01) and "no replica available" in d.reason(3.01)
    d.observe(3.1, queue_len=0, any_available=True)
    assert not d.overloaded(10.0)
    off = OverloadDetector(queue_len=0, no_replica_s=0)
    off.observe(0.0, queue_len=10_000, any_available=False)
    assert not off.overloaded(1e6)


def test_ledger_tracks_interactions_and_counts_wasted_tokens():
    led = InteractionLedger(ttl_s=100.0)
    first = facts("c0", ix="i1", stage=0)
    assert not led.in_progress(first, 0.0)
    led.dispatched(first, 0.0)
    assert led.in_progress(facts("c1", ix="i1", stage=1), 1.0)
    led.completed(first, 2.0, tokens=700)
    assert led.throttled(facts("c1", ix="i1", stage=1), 3.0) == 700
    assert (led.tokens_wasted, led.interactions_aborted) == (700, 1)
    assert led.throttled(facts("x", ix=None), 3.0) == 0  # not an interaction: nothing wasted
    # a final call ends the interaction; idle interactions expire
    led.dispatched(facts("d0", ix="i2"), 10.0)
    led.completed(facts("d0", ix="i2", final=True), 11.0, tokens=5)
    assert not led.in_progress(facts("d1", ix="i2"), 12.0)
    led.dispatched(facts("e0", ix="i3"), 20.0)
    assert not led.in_progress(facts("e1", ix="i3"), 200.0)


def run_agentic_load(mode: str, declared: bool = True) -> tuple[InteractionLedger, int, int]:
    """Users run 3-call interactions faster than a 4-per-minute user limit allows, while the
    region is overloaded: RPM aborts interactions mid-way, OIT only refuses first calls.
    Undeclared (`declared=False`, as the openai SDK sends them: no interaction header), each
    call's prompt is the last one's with its answer and more, and the scheduler recognizes
    the interaction before the throttle, as the daemon asks it to. Returns the ledger, the
    throttles, and how many of them cut an interaction after its first call (the truth the
    ledger's own counts are checked against)."""
    cfg = FairnessConfig(throttle=mode, user_rpm=4, window_s=60.0)
    led, window = InteractionLedger(), Window()
    scheduler = Scheduler(SchedulerConfig(), make_policy("predicted-ttft"), make_queue("fcfs"))
    now, throttles, cut = 0.0, 0, 0
    for n in range(12):
        prompt = f"You are a planner. Task {n}: plan the trip to city {n}. " * 8
        for stage in range(3):
            now += 1.0
            if declared:
                f = facts(f"r{n}.{stage}", user="u", app=None, ix=f"ix{n}", stage=stage, final=stage == 2)
            else:
                prompt += f" answer {stage}: " + "go by train, then walk " * 8
                f = RequestFacts(request_id=f"r{n}.{stage}", model="m", user="u", prompt=prompt, prompt_tokens=200)
                scheduler.recognize(f, now)
            hits = [(r, window.hit(r, now)) for r in rate_limits(f, cfg)]
            mid = led.in_progress(f, now)
            if throttle_decision(cfg, hits, overloaded=True, mid_interaction=mid) is not None:
                led.throttled(f, now)
                throttles += 1
                cut += stage > 0
                break  # the agent gives up on this interaction
            led.dispatched(f, now)
            led.completed(f, now + 0.5, tokens=100)
            if not declared:  # its answer: the next call extending this prompt continues it
                scheduler.leases.answered(f, "a", 200, 100, now + 0.5, request_chain(f))
    return led, throttles, cut


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "known-by-prompt"])
def test_oit_wastes_no_tokens_where_rpm_aborts_interactions(declared):
    (rpm, _, rpm_cut), (oit, oit_throttles, oit_cut) = (run_agentic_load("rpm", declared),
                                                        run_agentic_load("oit", declared))
    assert oit_throttles > 0 and oit_cut == 0  # OIT does throttle: only whole new interactions
    assert rpm_cut > 0 and rpm.interactions_aborted == rpm_cut  # the ledger knows what RPM cut
    assert rpm.tokens_wasted >= 100 * rpm.interactions_aborted
    assert oit.tokens_wasted == 0 and oit.interactions_aborted == 0


def test_an_undeclared_call_the_scheduler_did_not_recognize_is_no_interaction_under_way():
    """Without the scheduler's recognition (as before the daemon asked for it ahead of its
    throttle) an undeclared next step looks like a new interaction: OIT would cut it."""
    led = InteractionLedger()
    step = RequestFacts(request_id="s1", model="m", user="u", prompt="plan " * 100, prompt_tokens=100)
    assert not led.in_progress(step, 0.0)
    step.extra[IMPLICIT] = "s0"  # recognized: it continues s0's interaction
    assert led.in_progress(step, 0.0)


def test_the_ledger_keeps_a_bounded_number_of_interactions():
    """Interaction ids come from clients and every undeclared call starts one: the oldest go."""
    led = InteractionLedger(ttl_s=1e9, max_kept=100)
    for i in range(250):
        led.completed(facts(f"c{i}", ix=f"i{i}"), float(i), tokens=10)
    assert len(led._spent) == 100
    assert led.in_progress(facts("n", ix="i249"), 300.0) and not led.in_progress(facts("n", ix="i0"), 300.0)


def test_config_from_dict():
    cfg = FairnessConfig.from_dict({"throttle": "oit", "user_rpm": 60, "overload_queue_len": 8,
                                    "wsc": {"stage_weights": {"chat": {"0": 900, "1": 400}},
                                            "user_priority": {"gold": 0.5}}})
    assert cfg.throttle == "oit" and cfg.user_rpm == 60 and cfg.overload_queue_len == 8
    assert cfg.wsc.stage_weights == {"chat": {0: 900.0, 1: 400.0}} and cfg.wsc.user_priority == {"gold": 0.5}
    for bad, where in (({"throttle": "sometimes"}, "fairness.throttle"), ({"user_rpm": -1}, "fairness.user_rpm"),
                       ({"wsc": {"beta": "2"}}, "fairness.wsc.beta"), ({"wsc": {"delta": 1}}, "fairness.wsc"),
                       ({"windw_s": 1}, "unknown keys")):
        with pytest.raises(ValueError, match=where):
            FairnessConfig.from_dict(bad)
