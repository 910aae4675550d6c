"""Scaling strategies on small fixed series with a fake clock."""
from __future__ import annotations

import pytest

from lb.core.scaling import (ScalingSignals, desired_replicas, make_strategy, overflow_fraction)


def sig(replicas: int, kv: float, **kw) -> ScalingSignals:
    return ScalingSignals(region="us", model="m", replicas=replicas, kv_usage=kv, **kw)


def run(strategy, series, start_replicas: int, step_s: float = 5.0, **kw) -> list[int]:
    """Feed (kv) series one decision every `step_s`; apply each decision; return counts."""
    n, counts = start_replicas, []
    for i, kv in enumerate(series):
        d = strategy.decide(sig(n, kv, **kw), now=i * step_s)
        assert d.current == n and d.strategy == strategy.name
        n = d.desired
        counts.append(n)
    return counts


def test_reactive_thresholds_and_cooldown():
    r = make_strategy("reactive", min_replicas=1, max_replicas=5)
    # every 5 s: a change, then 15 s of cooldown (two holds), then the next change
    assert run(r, [0.8] * 8, 2) == [3, 3, 3, 4, 4, 4, 5, 5]
    r = make_strategy("reactive")
    assert run(r, [0.5, 0.71, 0.69, 0.69, 0.69, 0.2, 0.2, 0.2, 0.2], 2) == [2, 3, 3, 3, 3, 2, 2, 2, 1]


def test_reactive_respects_bounds_and_explains_holds():
    r = make_strategy("reactive", min_replicas=2, max_replicas=3)
    d = r.decide(sig(2, 0.1), 0.0)
    assert d.desired == 2 and "at bound" in d.reason
    d = r.decide(sig(3, 0.9), 100.0)
    assert d.desired == 3 and d.delta == 0
    assert r.decide(sig(3, 0.5), 200.0).reason == "hold: within band"


def test_cooldown_is_per_pool():
    r = make_strategy("reactive")
    assert r.decide(sig(2, 0.9), 0.0).desired == 3
    other = ScalingSignals(region="eu", model="m", replicas=2, kv_usage=0.9)
    assert r.decide(other, 1.0).desired == 3  # another region is not cooling down


def test_lt_i_jumps_to_the_plan_and_is_reactive_without_one():
    s = make_strategy("lt-i", max_replicas=20)
    assert s.decide(sig(2, 0.1, planned=7), 0.0).desired == 7
    assert s.decide(sig(7, 0.99, planned=7), 1.0).desired == 7  # trusts the plan
    assert s.decide(sig(7, 0.1, planned=3), 2.0).desired == 3
    assert s.decide(sig(3, 0.9), 100.0).desired == 4


def test_lt_u_moves_toward_the_plan_only_when_utilisation_agrees():
    s = make_strategy("lt-u")
    # plan 4: scale out only while kv > 0.7, one step per cooldown, never past the plan
    assert run(s, [0.5, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8], 2, planned=4) == \
        [2, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4]
    s = make_strategy("lt-u")
    # plan 2 from 4: scale in only while kv < 0.3
    assert run(s, [0.5, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2], 4, planned=2) == [4, 3, 3, 3, 2, 2, 2, 2]
    s = make_strategy("lt-u")
    assert s.decide(sig(4, 0.1, planned=6), 0.0).desired == 4  # plan says more, load says no


def test_lt_ua_corrects_the_plan_by_the_forecast_error():
    s = make_strategy("lt-ua")
    assert s.target(sig(4, 0.5, planned=4, forecast_tps=1000, observed_tps=1050)) == 4  # within 10 %
    assert s.target(sig(4, 0.5, planned=4, forecast_tps=1000, observed_tps=1500)) == 6
    assert s.target(sig(4, 0.5, planned=4, forecast_tps=1000, observed_tps=500)) == 2
    # observed 50 % over forecast: LT-U would stop at 4, LT-UA goes on to 6
    lt_u, lt_ua = make_strategy("lt-u"), make_strategy("lt-ua")
    kw = dict(planned=4, forecast_tps=1000, observed_tps=1500)
    assert run(lt_u, [0.8] * 12, 4, **kw)[-1] == 4
    assert run(lt_ua, [0.8] * 12, 4, **kw)[-1] == 6


def test_lt_ua_scales_past_the_plan_when_kv_is_nearly_full():
    s = make_strategy("lt-ua")
    assert s.decide(sig(4, 0.95, planned=4), 0.0).desired == 5
    assert s.decide(sig(5, 0.95, planned=4), 5.0).desired == 5  # cooldown


def test_overflow_fraction():
    assert overflow_fraction([(0.5, 0.96), (0.99, 0.1)]) == 0.5
    assert overflow_fraction([]) == 0.0


def test_preserve_scales_out_on_anticipated_overflow():
    p = make_strategy("preserve")
    hot = ((0.9,) * 8 + (0.97,) * 2, (0.5,) * 10)  # 2 of 20 cells over 95 % = 10 %: not more
    assert p.decide(sig(2, 0.6, anticipated_kv=hot), 0.0).desired == 2
    hotter = ((0.9,) * 7 + (0.97,) * 3, (0.5,) * 10)  # 15 %
    assert p.decide(sig(2, 0.6, anticipated_kv=hotter), 1.0).desired == 3
    # one is already starting: wait for it instead of piling on
    assert p.decide(sig(3, 0.6, starting=1, anticipated_kv=hotter), 2.0).desired == 3


def test_preserve_scales_in_once_per_window():
    p = make_strategy("preserve", window_s=600.0)
    cold = ((0.1,) * 10,) * 4
    counts = run(p, [0.1] * 6, 4, step_s=100.0, anticipated_kv=cold)  # t = 0..500: one window
    assert counts == [3, 3, 3, 3, 3, 3]
    assert p.decide(sig(3, 0.1, anticipated_kv=cold), 600.0).desired == 2  # next window
    # anticipated load above 30 % blocks the scale-in even when KV is low now
    p = make_strategy("preserve")
    assert p.decide(sig(3, 0.1, anticipated_kv=((0.1, 0.4),)), 0.0).desired == 3


def test_preserve_sets_the_forecast_floor_once_per_window():
    p = make_strategy("preserve")
    assert p.decide(sig(2, 0.5, planned=5), 0.0).desired == 5
    # later in the same window the anticipator may take it lower; the plan does not bounce back
    assert p.decide(sig(4, 0.5, planned=5), 10.0).desired == 4
    assert p.decide(sig(4, 0.5, planned=5), 600.0).desired == 5


def test_desired_replicas_is_stateless_hpa_style():
    assert desired_replicas(sig(4, 0.7)) == 4
    assert desired_replicas(sig(4, 0.9)) == 6  # ceil(4·0.9/0.7)
    assert desired_replicas(sig(4, 0.1)) == 1
    assert desired_replicas(sig(4, 0.1, planned=3)) == 3
    assert desired_replicas(sig(5, 0.84, starting=1)) == 6  # 4.2 replicas of work, spread over 5 (one starting)
    assert desired_replicas(sig(0, 0.0, tokens_in_flight=10), min_replicas=0) == 1
    assert desired_replicas(sig(50, 1.0), max_replicas=64) == 64


def test_unknown_strategy_is_named():
    with pytest.raises(ValueError, match="lt-ua"):
        make_strategy("magic")
    d = make_strategy("reactive").decide(sig(2, 0.9), 3.0)
    assert d.to_json() == {"region": "us", "model": "m", "current": 2, "desired": 3,
                           "reason": "kv 0.90 > 0.7", "strategy": "reactive", "at": 3.0, "delta": 1}


def test_pool_signals_count_waiting_work_and_a_pool_that_cannot_take_it_as_full():
    from lb.core.anticipator import LoadAwarePolicy
    from lb.core.scaling import pool_signals
    from lb.core.types import QueueEntry, ReplicaView, RequestFacts

    ready = [ReplicaView(id="a", url="", kv_usage=0.2), ReplicaView(id="b", url="", kv_usage=0.4)]
    queued = [QueueEntry(RequestFacts(f"q{i}", "m", prompt_tokens=100, max_tokens=10), enqueued_at=90.0)
              for i in range(3)]
    kw = dict(replicas=3, ready=ready, starting=1, recent_waits=[0.1] * 20, tracker=LoadAwarePolicy(),
              observed_tps=50.0, forecast_tps=None, planned=None, now=100.0)
    idle = pool_signals("r", "m", queued=[], available=lambda v: True, **kw)
    assert abs(idle.kv_usage - 0.2) < 1e-9  # (0.2 + 0.4) over 2 ready + 1 starting
    assert idle.queue_p95_s == 0.1 and idle.tokens_in_flight == 0
    stuck = pool_signals("r", "m", queued=queued, available=lambda v: False, **kw)
    assert stuck.kv_usage == 1.0  # work waits and nothing can take it: no spare capacity
    assert stuck.queue_p95_s == 10.0  # the waiting entries' ages count
    assert stuck.tokens_in_flight >= 3 * 100 and (stuck.replicas, stuck.starting) == (3, 1)


def test_pool_kv_usage_counts_waiting_prompts_by_the_replicas_kv_size():
    from lb.core.scaling import pool_kv_usage
    from lb.core.types import ReplicaView

    # SGLang's /v1/loads: 20 % used, 8,000 tokens free -> 10,000 tokens of KV per replica
    ready = [ReplicaView(id="a", url="", kv_usage=0.2, kv_free_tokens=8000),
             ReplicaView(id="b", url="", kv_usage=0.4, kv_free_tokens=6000)]
    assert pool_kv_usage(ready, starting=0, queued_tokens=0) == pytest.approx(0.3)
    assert pool_kv_usage(ready, starting=0, queued_tokens=5000) == pytest.approx(0.55)
    assert pool_kv_usage(ready, starting=2, queued_tokens=5000) == pytest.approx(0.275)
    # a replica with a queue of its own takes nothing more: full
    ready[1].pending = 3
    assert pool_kv_usage(ready, starting=0, queued_tokens=0) == pytest.approx(0.6)
    assert pool_kv_usage([], starting=0, queued_tokens=10) == 1.0
    assert pool_kv_usage([], starting=2, queued_tokens=0) == 0.0
    # a replica reporting nonsense free tokens gives no KV size: waiting work is not subtracted
    odd = [ReplicaView(id="c", url="", kv_usage=0.5, kv_free_tokens=-4000)]
    assert pool_kv_usage(odd, starting=0, queued_tokens=5000) == pytest.approx(0.5)


def test_reactive_rule_on_the_daemons_signals_waits_for_a_cold_start():
    """The daemon's signals spread the load over starting replicas: a pool at 80 % KV gets
    one more replica and then waits for it through a 5-minute cold start, instead of asking
    for one more every 15 s cooldown."""
    from lb.core.anticipator import LoadAwarePolicy
    from lb.core.scaling import pool_signals
    from lb.core.types import ReplicaView

    strategy = make_strategy("reactive", min_replicas=1, max_replicas=20)
    ready = [ReplicaView(id=f"r{i}", url="", kv_usage=0.8) for i in range(2)]
    starting, decisions = 0, []
    for step in range(60):  # every 5 s for 5 minutes; nothing becomes ready
        s = pool_signals("us", "m", replicas=len(ready) + starting, ready=ready, starting=starting, queued=[],
                         available=lambda v: True, recent_waits=[], tracker=LoadAwarePolicy(),
                         observed_tps=0.0, forecast_tps=None, planned=None, now=step * 5.0)
        d = strategy.decide(s, now=step * 5.0)
        starting += d.delta
        decisions.append(d.desired)
    assert decisions[0] == 3 and starting == 1  # 1.6 replicas of work over 3: 0.53, below 70 %
    assert max(decisions) == 3
