"""Every fair/SLO order on hand-built queues with a fake clock, plus properties."""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lb.core.continuations import IMPLICIT, interaction_of
from lb.core.fairness import WeightedService, WscConfig
from lb.core.queueing import (QUEUE_ORDERS, RECENTLY_EXPIRED, RELAXED_F, RELAXED_N, SEVERELY_EXPIRED, URGENT_F,
                              URGENT_N, FCFSQueue, dpa_class, make_queue)
from lb.core.tiers import TierConfig, TierTarget
from lb.core.types import QueueEntry, RequestFacts, Tier

F, N, B = Tier.IW_F, Tier.IW_N, Tier.NIW
TIERS = TierConfig(targets={F: TierTarget(1.0, 10.0), N: TierTarget(5.0, 60.0), B: TierTarget(3600.0, 3600.0)},
                   tau_n_s=0.5, tau_p_s=3.0)


def entry(rid: str, t: float = 0.0, tier: Tier = N, user: str | None = None, **kw) -> QueueEntry:
    return QueueEntry(RequestFacts(request_id=rid, model="m", arrival=t, tier=tier, user=user, **kw), t,
                      seq=int(rid[1:]) if rid[1:].isdigit() else 0)


def drain(q, now: float) -> list[str]:
    out = []
    while (e := q.pop(now)) is not None:
        out.append(e.facts.request_id)
    return out


def test_one_factory_builds_every_order_by_its_config_name():
    assert set(QUEUE_ORDERS) == {"fcfs", "wsc", "vtc", "edf", "pf", "dpa", "srpt"}
    for name in QUEUE_ORDERS:
        assert make_queue(name).name == name
    assert isinstance(make_queue("fcfs", tiers=TIERS), FCFSQueue)
    with pytest.raises(ValueError, match="unknown queue order"):
        make_queue("lifo")


def test_edf_serves_earliest_ttft_deadline_first_and_expired_before_all():
    q = make_queue("edf", tiers=TIERS)
    q.push(entry("r1", t=0.0, tier=N))  # deadline 5
    q.push(entry("r2", t=3.0, tier=F))  # deadline 4
    q.push(entry("r3", t=-10.0, tier=N))  # deadline -5: long expired
    q.push(entry("r4", t=1.0, tier=F))  # deadline 2
    assert drain(q, now=1.0) == ["r3", "r4", "r2", "r1"]


def test_pf_puts_every_iw_f_strictly_before_iw_n_and_niw_last():
    q = make_queue("pf")
    q.push(entry("r1", t=0.0, tier=N))
    q.push(entry("r2", t=0.0, tier=B))
    q.push(entry("r3", t=9.0, tier=F))
    q.push(entry("r4", t=5.0, tier=F))
    q.push(entry("r5", t=1.0, tier=N))
    assert drain(q, now=10.0) == ["r4", "r3", "r1", "r5", "r2"]


@pytest.mark.parametrize("tier,slack,cls", [
    (F, -3.5, SEVERELY_EXPIRED), (N, -10.0, SEVERELY_EXPIRED),
    (F, 0.2, URGENT_F), (N, 0.49, URGENT_N), (B, 0.1, URGENT_N),
    # NIW reaches the LB queue only when the deferred queue releases it: due now, whatever its slack
    (B, 3000.0, URGENT_N), (B, -10.0, URGENT_N),
    (F, 0.5, RELAXED_F), (N, 4.0, RELAXED_N),
    (F, -0.1, RECENTLY_EXPIRED), (N, -3.0, RECENTLY_EXPIRED),
])
def test_dpa_classes(tier, slack, cls):
    assert dpa_class(tier, slack, tau_n_s=0.5, tau_p_s=3.0) == cls


def test_dpa_never_promotes_expired_work_by_default():
    """Above capacity promotion makes DPA FCFS over lost causes; `[queue] timeout_s` bounds the wait."""
    assert dpa_class(N, -1e6, tau_n_s=0.5, tau_p_s=TierConfig().tau_p_s) == RECENTLY_EXPIRED
    assert TierConfig.from_dict({}).tau_p_s == float("inf")


def test_dpa_serves_classes_in_sageserve_order_and_moves_with_the_clock():
    q = make_queue("dpa", tiers=TIERS)
    now = 100.0
    # TTFT deadlines: IW-F arrival + 1, IW-N arrival + 5
    q.push(e_recent := entry("r1", t=now - 1.5, tier=F))  # slack -0.5: recently expired
    q.push(entry("r2", t=now - 4.8, tier=N))  # slack 0.2: urgent IW-N
    q.push(entry("r3", t=now - 0.7, tier=F))  # slack 0.3: urgent IW-F
    q.push(entry("r4", t=now, tier=N))  # slack 5: relaxed IW-N
    q.push(entry("r5", t=now - 0.2, tier=F))  # slack 0.8: relaxed IW-F
    q.push(entry("r6", t=now - 9.0, tier=N))  # slack -4: severely expired
    assert [e.facts.request_id for e in q.iter_in_order(now)] == ["r6", "r3", "r2", "r5", "r4", "r1"]
    assert q.peek(now) is next(q.iter_in_order(now))
    assert q.pop(now).facts.request_id == "r6"
    assert [e.facts.request_id for e in q.iter_in_order(now)][-1] == "r1"
    # 3 s later the recently expired IW-F (slack -3.5) has become severely expired: first
    assert q.peek(now + 3.0) is e_recent


def test_srpt_serves_least_weighted_work_first_but_ages():
    q = make_queue("srpt")
    q.push(entry("r1", t=0.0, tier=N, max_tokens=1000))
    q.push(entry("r2", t=0.0, tier=N, max_tokens=10))
    q.push(entry("r3", t=0.0, tier=F, max_tokens=100))  # 100/4 < 10/2? no: 25 > 5
    assert drain(q, now=0.0) == ["r2", "r3", "r1"]
    # a long job that has waited long enough beats a fresh short one
    q.push(entry("r4", t=0.0, tier=N, max_tokens=1000))
    q.push(entry("r5", t=10.0, tier=N, max_tokens=10))
    assert drain(q, now=10.0) == ["r4", "r5"]


def service(**kw) -> WeightedService:
    return WeightedService(WscConfig(**kw))


def test_wsc_serves_the_least_served_user_first_and_charges_at_dispatch():
    svc = service(default_weight=100.0, default_output_tokens=100)
    q = make_queue("wsc", service=svc)
    for i in range(3):
        q.push(entry(f"a{i}", t=i, user="heavy", prompt_tokens=100))
    q.push(entry("b0", t=5, user="light", prompt_tokens=100))
    order = drain(q, now=10.0)
    # heavy's first call (oldest) → heavy has 2 units, light 0 → light, then heavy again
    assert order == ["a0", "b0", "a1", "a2"]
    assert svc.get("heavy") == pytest.approx(3 * 200 / 100)


def test_wsc_counts_system_tokens_double_and_divides_by_the_stage_weight():
    svc = service(stage_weights={"chat": {0: 50.0, 1: 500.0}}, default_output_tokens=10)
    e0 = entry("r1", user="u", app="chat", interaction_id="i", interaction_stage=0, prompt_tokens=30,
               extra={"system_tokens": 10})
    assert svc.charge(e0.facts) == pytest.approx((20 + 2 * 10 + 10) / 50.0)
    e1 = entry("r2", user="u", app="chat", interaction_id="i", interaction_stage=1, prompt_tokens=30,
               extra={"system_tokens": 10})
    assert svc.charge(e1.facts) == pytest.approx((20 + 2 * 10 + 10) / 500.0)


def test_wsc_priority_factor_lets_a_premium_user_take_more_service():
    svc = service(default_weight=10.0, default_output_tokens=10, user_priority={"gold": 0.25})
    q = make_queue("wsc", service=svc)
    for i in range(8):
        q.push(entry(f"g{i}", t=i, user="gold", prompt_tokens=0))
        q.push(entry(f"s{i}", t=i, user="std", prompt_tokens=0))
    first10 = drain(q, now=20.0)[:10]
    assert sum(r.startswith("g") for r in first10) == 8  # 4× cheaper: 4 golds per std


def test_wsc_lifts_a_newly_active_user_so_idle_time_is_not_banked():
    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=0)  # the papers' cumulative rule
    q = make_queue("wsc", service=svc)
    for i in range(5):
        q.push(entry(f"a{i}", t=i, user="busy", prompt_tokens=10))
    for _ in range(3):
        q.pop(10.0)
    assert svc.get("busy") == 30.0
    q.push(entry("n0", t=11, user="newcomer", prompt_tokens=10))
    assert svc.get("newcomer") == 30.0  # lifted to the least active counter, not 0
    # ... so it alternates with busy instead of taking every slot until it catches up
    q.push(entry("n1", t=12, user="newcomer", prompt_tokens=10))
    assert drain(q, now=13.0)[:2] in (["a3", "n0"], ["n0", "a3"])


def test_wsc_does_not_lift_a_user_between_stages_of_an_interaction_and_ties_go_to_the_idle_user():
    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=0)  # the papers' cumulative rule
    q = make_queue("wsc", service=svc)
    for i in range(8):
        q.push(entry(f"a{i}", t=i, user="flood", prompt_tokens=10))
    q.pop(8.0), q.pop(8.0)  # flood: 20 units, 2 calls running
    b0 = entry("b0", t=9, user="benign", prompt_tokens=10, interaction_id="conv", interaction_stage=0)
    q.push(b0)
    assert svc.get("benign") == 20.0  # a newcomer is lifted to the least active counter...
    assert q.pop(9.0) is b0  # ...and wins the tie against the user with calls running
    svc.complete(b0.facts, input_tokens=10, output_tokens=0)
    for _ in range(3):
        q.pop(10.0)  # flood: far above benign now
    assert svc.get("flood") > svc.get("benign")
    # stage 1 of the interaction in progress keeps its history (30), not lifted to flood's
    b1 = entry("b1", t=11, user="benign", prompt_tokens=10, interaction_id="conv", interaction_stage=1)
    q.push(b1)
    assert svc.get("benign") == 30.0 and q.pop(11.0) is b1
    svc.complete(b1.facts, input_tokens=10, output_tokens=0)
    # a new interaction after going idle is lifted again: idle time is not banked
    q.push(entry("c0", t=12, user="benign", prompt_tokens=10, interaction_id="other", interaction_stage=0))
    assert svc.get("benign") == svc.get("flood") and q.peek(12.0).facts.request_id == "c0"


def test_wsc_places_a_returning_bursty_tenant_below_a_flood_by_what_it_used_less_recently():
    """The default (half-life) rule: a tenant coming back is placed below the flood's counter
    by how much less it was served lately, not lifted to it, so that much of its burst goes
    first (the cumulative rule would split it 50/50 with the flood); its credit is bounded:
    once it has had that much it alternates with the flood."""
    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=10.0)
    q = make_queue("wsc", service=svc)
    for i in range(40):
        q.push(entry(f"f{i}", t=0, user="flood", prompt_tokens=1))
    for k in range(20):  # the flood alone for 20 s: 1 unit a second
        assert q.pop(float(k)).facts.user == "flood"
        svc.complete(entry(f"f{k}", user="flood").facts, input_tokens=1, output_tokens=0)
    flood_recent = svc.recent("flood", 20.0)  # 20 units decayed: about 10/ln 2 · (1 − 2^-2) ≈ 11
    assert 10 < flood_recent < 12
    for i in range(20):  # a burst of 20 calls from a tenant idle until now
        q.push(entry(f"b{i}", t=20, user="burst", prompt_tokens=1))
    assert svc.get("burst") == pytest.approx(svc.get("flood") - flood_recent)
    served = [q.pop(20.0 + 0.001 * k).facts.user for k in range(30)]
    leading = served.index("flood")
    assert leading == int(flood_recent) + 1  # ahead for what it used less than the flood lately
    assert served[leading:].count("flood") >= 8  # then they alternate: the credit was bounded


def test_wsc_places_a_newcomer_with_the_least_recently_served_active_user_not_at_zero():
    """Where new users keep arriving, a newcomer banks only what the least-served active user
    had lately: users active longer than that are not passed over by every newcomer (the
    rule before ranked by decayed service, which falls to 0 for everyone, so under overload
    each newcomer started ahead of every interaction under way)."""
    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=10.0)
    q = make_queue("wsc", service=svc)
    for i in range(30):  # a wide tree: its calls keep it active
        q.push(entry(f"w{i}", t=0, user="wide", prompt_tokens=1, interaction_id="tree", interaction_stage=i and 1))
    for k in range(10):
        assert q.pop(float(k)).facts.user == "wide"
    # 100 s later the wide tree still waits; a light tree started 3 s ago has had 3 calls
    for k in range(3):  # (served where nothing else waited, say another LB's replica)
        done = entry(f"l{k}", t=97 + k, user="light", prompt_tokens=1).facts
        svc.charge(done), svc.complete(done, input_tokens=1, output_tokens=0)
    q.push(entry("l3", t=100, user="light", prompt_tokens=1, interaction_id="t-l", interaction_stage=3))
    wide_recent, light_recent = svc.recent("wide", 100.0), svc.recent("light", 100.0)
    assert wide_recent < light_recent  # the wide tree's service was long ago (its last call counts from the last look)
    q.push(entry("n0", t=100, user="new", prompt_tokens=1, interaction_id="t-n", interaction_stage=0))
    least = min(svc.get("wide"), svc.get("light"))
    # placed below the least active counter by the least recent service among the active (the
    # wide tree's), not at 0 below everyone: it ranks with them, not ahead of them all
    assert svc.get("new") == pytest.approx(least - wide_recent)
    order = [q.pop(100.0 + 0.001 * k).facts.user for k in range(6)]
    assert order.index("wide") <= 2


def test_a_user_coming_back_after_heavy_use_long_ago_is_not_held_to_its_old_counter():
    """Placement lowers as well as raises: a tenant's heavy use of an hour ago is forgiven with
    the decay (VTC's lift only raises, so its old counter would keep it behind newer users)."""
    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=60.0)
    q = make_queue("wsc", service=svc)
    for i in range(100):
        q.push(entry(f"o{i}", t=0, user="old", prompt_tokens=1))
    while (e := q.pop(1.0)) is not None:
        svc.complete(e.facts, input_tokens=1, output_tokens=0)
    for i in range(5):
        q.push(entry(f"a{i}", t=3600, user="active", prompt_tokens=1))
    for k in range(3):
        q.pop(3600.0 + k)
    q.push(entry("o100", t=3603, user="old", prompt_tokens=1))
    assert svc.get("old") < svc.get("active")  # not 100 units behind
    assert q.pop(3603.0).facts.user == "old"


def test_vtc_keeps_the_papers_cumulative_counters_and_lift():
    q = make_queue("vtc")
    assert q.service.cfg.half_life_s == 0


def test_wsc_prefers_calls_of_interactions_in_progress_within_a_user():
    q = make_queue("wsc", service=service())
    q.push(entry("r1", t=0, user="u", interaction_id="new", interaction_stage=0))
    q.push(entry("r2", t=1, user="u", interaction_id="old", interaction_stage=3))
    assert q.peek(2.0).facts.request_id == "r2"
    seen = set()
    q2 = make_queue("wsc", service=service(), in_progress=lambda f, now: f.interaction_id in seen)
    q2.push(entry("r1", t=0, user="u", interaction_id="x"))
    q2.push(entry("r2", t=1, user="u", interaction_id="y"))
    seen.add("y")
    assert [e.facts.request_id for e in q2.iter_in_order(2.0)] == ["r2", "r1"]


def test_completion_corrects_the_estimate_and_learns_the_stage_weight():
    svc = service(default_weight=100.0, default_output_tokens=100, ewma_alpha=0.5)
    facts = entry("r1", user="u", app="a", prompt_tokens=100).facts
    charged = svc.charge(facts)
    assert charged == pytest.approx(2.0) and svc.inflight == {"u": 1}
    delta = svc.complete(facts, input_tokens=100, output_tokens=300)
    assert delta == pytest.approx(4.0 - 2.0)
    assert svc.get("u") == pytest.approx(4.0) and svc.inflight == {}
    assert svc.weights.get(("a", 0)) == pytest.approx(100 + 0.5 * (400 - 100))
    assert svc.outputs.get(("a", 0)) == pytest.approx(100 + 0.5 * (300 - 100))
    assert svc.drain_deltas() == pytest.approx({"u": 4.0}) and svc.drain_deltas() == {}


def test_vtc_is_equal_token_service_without_weights_or_interaction_preference():
    q = make_queue("vtc", service=WeightedService(WscConfig(weighted=False, default_output_tokens=0)))
    q.push(entry("a1", t=0, user="a", prompt_tokens=300, interaction_id="i", interaction_stage=0))
    q.push(entry("a2", t=1, user="a", prompt_tokens=10, interaction_id="j", interaction_stage=4))
    q.push(entry("b1", t=2, user="b", prompt_tokens=100))
    q.push(entry("b2", t=3, user="b", prompt_tokens=100))
    # a1 (FIFO within a, no stage preference) → a=300; b1, b2 → b=200; then a2
    assert drain(q, now=5.0) == ["a1", "b1", "b2", "a2"]


def test_dispatch_charges_like_pop_and_remove_does_not():
    svc = service(default_weight=1.0, default_output_tokens=0)
    q = make_queue("wsc", service=svc)
    e1, e2 = entry("r1", user="u", prompt_tokens=5), entry("r2", user="u", prompt_tokens=7)
    q.push(e1)
    q.push(e2)
    assert q.remove(e1) and svc.get("u") == 0
    assert q.dispatch(e2) and svc.get("u") == 7 and len(q) == 0
    f = FCFSQueue()
    f.push(e1)
    assert f.dispatch(e1) and len(f) == 0


ops = st.lists(st.one_of(
    st.tuples(st.just("push"), st.sampled_from(["u1", "u2", "u3", None]), st.sampled_from(list(Tier)),
              st.floats(0, 100), st.integers(0, 2), st.integers(0, 4000)),
    st.tuples(st.just("pop"), st.floats(0, 200)),
    st.tuples(st.just("dispatch"), st.integers(0, 50)),
    st.tuples(st.just("remove"), st.integers(0, 50)),
), max_size=60)


@pytest.mark.parametrize("name", sorted(set(QUEUE_ORDERS) - {"fcfs"}))
@settings(max_examples=100, deadline=None)
@given(ops=ops)
def test_orders_keep_every_entry_exactly_once_and_peek_is_the_head(name, ops):
    q = make_queue(name, tiers=TIERS, service=service(default_weight=50.0))
    queued, out = [], []
    for i, op in enumerate(ops):
        if op[0] == "push":
            e = QueueEntry(RequestFacts(request_id=f"q{i}", model="m", user=op[1], tier=op[2], arrival=op[3],
                                        interaction_id="ix" if op[4] else None, interaction_stage=op[4],
                                        prompt_tokens=op[5]), op[3], seq=i)
            q.push(e)
            queued.append(e)
            with pytest.raises(ValueError):
                q.push(e)
        elif op[0] == "pop":
            head = q.peek(op[1])
            assert head is next(q.iter_in_order(op[1]), None)
            e = q.pop(op[1])
            assert e is head
            if e is not None:
                queued.remove(e)
                out.append(e)
        elif queued:
            e = queued[op[1] % len(queued)]
            assert (q.dispatch(e) if op[0] == "dispatch" else q.remove(e))
            assert not q.remove(e) and e not in q
            queued.remove(e)
            out.append(e)
        assert len(q) == len(queued)
        assert {id(e) for e in q.iter_in_order(150.0)} == {id(e) for e in queued}
        if hasattr(q, "_interactive"):  # WSC/VTC: the calls naming an interaction are queued ones
            assert all(calls and set(calls) <= set(q._by_user[u]) for u, calls in q._interactive.items())
    assert len({id(e) for e in out}) == len(out)


def test_idle_tenants_are_forgotten_beyond_the_bound_and_come_back_placed_as_new():
    """OpenAI's `user` names end users: an LB that never forgot one would grow without bound.
    Beyond `idle_kept` the longest unseen idle tenants are forgotten; one coming back is
    placed as a newcomer, and its placement, not its old stored total, is what the store ends
    up with."""
    svc = WeightedService(WscConfig(default_weight=1.0, default_output_tokens=0, half_life_s=10.0), idle_kept=3)
    store: dict[str, float] = {}

    def sync() -> None:  # what the daemon's sync round does with its store
        for u, d in svc.drain_deltas().items():
            store[u] = store.get(u, 0.0) + d
        svc.set_counters({u: store[u] for u in svc.counters if u in store})

    q = make_queue("wsc", service=svc)
    q.push(entry("b0", t=0, user="busy", prompt_tokens=1))
    for i in range(1, 40):
        q.push(entry(f"b{i}", t=0, user="busy", prompt_tokens=1))  # busy stays active throughout
    for k in range(8):  # eight one-call tenants, one a second, each served and gone
        q.push(entry(f"u{k}", t=k, user=f"u{k}", prompt_tokens=1 + k))
        while (e := q.pop(float(k))).facts.user == "busy":
            svc.complete(e.facts, input_tokens=1, output_tokens=0)
        svc.complete(e.facts, input_tokens=1 + k, output_tokens=0)
        sync()
    assert len(svc.counters) <= 2 * 3 + 1  # never more than twice the bound (and the one placed)
    forgotten = [f"u{k}" for k in range(8) if f"u{k}" not in svc.counters]
    assert forgotten and "busy" in svc.counters
    kept = [f"u{k}" for k in range(8) if f"u{k}" in svc.counters]
    assert min(map(int, (u[1:] for u in kept))) > max(map(int, (u[1:] for u in forgotten)))  # the latest kept
    back = forgotten[0]
    q.push(entry("again", t=8, user=back, prompt_tokens=1))
    placed = svc.get(back)
    assert store[back] > 0  # its old total is still in the store
    sync(), sync()
    assert svc.get(back) == pytest.approx(placed) == pytest.approx(store[back])  # the placement stands
    assert placed == pytest.approx(svc.get("busy") - svc.recent("busy", 8.0))  # placed as a newcomer


def test_a_tenant_new_to_one_lb_keeps_its_placement_there_not_the_total_others_gave_it():
    """Several LBs share counters through a store. A tenant the other LB served for a long time
    first comes to this one: its placement here stands, and the store follows it; adopting the
    stored total would put everything it was ever served on top of the placement, and in
    virtual time nothing decays that, so it would wait behind every other tenant."""
    store: dict[str, float] = {}

    def sync(svc: WeightedService) -> None:
        for u, d in svc.drain_deltas().items():
            store[u] = store.get(u, 0.0) + d
        svc.set_counters({u: store[u] for u in svc.counters if u in store})

    cfg = WscConfig(default_weight=1.0, default_output_tokens=0, half_life_s=10.0)
    a, b = WeightedService(cfg), WeightedService(cfg)
    qa, qb = make_queue("wsc", service=a), make_queue("wsc", service=b)
    for i in range(50):  # LB a serves alice 50 units over the first 50 s
        qa.push(entry(f"a{i}", t=i, user="alice", prompt_tokens=1))
        a.complete(qa.pop(float(i)).facts, input_tokens=1, output_tokens=0)
    sync(a)
    assert store["alice"] == 50.0
    for i in range(3):  # meanwhile bob has work under way at LB b
        qb.push(entry(f"b{i}", t=1000, user="bob", prompt_tokens=1))
    qb.pop(1000.0)
    sync(b)
    qb.push(entry("a50", t=1001, user="alice", prompt_tokens=1))  # alice, idle 950 s, comes to b
    placed = b.get("alice")
    assert placed <= b.get("bob")  # her service was long ago: she ranks with bob, not 50 behind
    sync(b), sync(b)
    assert b.get("alice") == pytest.approx(placed) == pytest.approx(store["alice"])
    assert qb.pop(1001.0).facts.user == "alice"
    sync(a)
    assert a.get("alice") == pytest.approx(store["alice"])  # and the other LB follows the store
    # a tenant placed while b's sync round is under way (after the drain, before the read-back,
    # so the round reads no total for it) is still corrected by the next round
    store["carol"] = 500.0  # what a served her, long ago
    pushed = b.drain_deltas()
    qb.push(entry("c0", t=1002, user="carol", prompt_tokens=1))
    placed = b.get("carol")
    for u, d in pushed.items():
        store[u] = store.get(u, 0.0) + d
    b.set_counters({u: store[u] for u in ("alice", "bob") if u in store})
    sync(b), sync(b)
    assert b.get("carol") == pytest.approx(placed) == pytest.approx(store["carol"])


def test_a_placement_reads_a_bounded_number_of_active_tenants_newest_first():
    """Placing a tenant must not cost a pass over every active tenant (10 ms with 10,000):
    it reads the most recently active few, queued and running in turn."""
    from lb.core.fairness import PLACE_SCAN

    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=10.0)
    q = make_queue("wsc", service=svc)
    for i in range(3 * PLACE_SCAN):  # many tenants with work queued; the newest has the least
        q.push(entry(f"r{i}", t=0, user=f"u{i}", prompt_tokens=1))
    read = []

    def counted(users):
        for u in users:
            read.append(u)
            yield u

    svc.place("late", counted(q._active_newest_first()), 1.0)
    assert len(read) == PLACE_SCAN and read[0] == f"u{3 * PLACE_SCAN - 1}"
    vtc = WeightedService(WscConfig(default_weight=1.0, default_output_tokens=0, half_life_s=0))
    read.clear()
    vtc.place("late", counted(f"u{i}" for i in range(3 * PLACE_SCAN)), 1.0)
    assert len(read) == 3 * PLACE_SCAN  # VTC's lift stays the papers' rule: every counter


def test_a_sync_round_reads_back_a_bounded_set_and_every_total_in_rotation():
    """A sync round reads back every tenant while there are few; with many, those it changed,
    placed unknowing, runs calls for or holds calls of, and `limit` others in rotation: each
    total is adopted within a rotation, and nothing forgotten comes back through it."""
    svc = WeightedService(WscConfig(default_weight=1.0, default_output_tokens=0, half_life_s=10.0))
    for i in range(10):
        svc._add(f"u{i}", 1.0)
    assert svc.read_back([], limit=20) == [f"u{i}" for i in range(10)]  # few: all, as they are kept

    for i in range(10, 1000):
        svc._add(f"u{i}", 1.0)
    svc.drain_deltas()
    svc.charge(RequestFacts(request_id="r", model="m", user="running", prompt_tokens=5, max_tokens=1))
    changed = svc.drain_deltas()
    svc.inflight["u7"] = 1
    got = svc.read_back(changed, waiting=["u3", "gone-already"], limit=50)
    assert {"running", "u7", "u3"} <= set(got) and "gone-already" not in got
    assert len(got) == 3 + 50

    seen: set[str] = set()
    rounds = 0
    while not set(svc.counters) <= seen:
        seen.update(svc.read_back([], limit=50))
        rounds += 1
    assert rounds <= len(svc.counters) // 50 + 1  # every total within one rotation


def test_a_pass_re_ranks_only_the_users_whose_rank_changed():
    """With many users queued, a placement re-ranks the user it charged (and any the service
    or the queue changed), not every user queued; and the head is still the least-served."""
    svc = WeightedService(WscConfig(default_weight=1.0, default_output_tokens=0, half_life_s=10.0))
    q = make_queue("wsc", service=svc)
    for i in range(500):
        q.push(entry(f"e{i}", t=i * 0.001, user=f"u{i}", prompt_tokens=1 + i % 7))
    q.peek(1.0)
    ranked = []
    real = q._user_key
    q._user_key = lambda user, now: ranked.append(user) or real(user, now)
    head = q.peek(1.0)
    q.dispatch(head)
    nxt = q.peek(1.0)
    assert ranked == [svc.user_of(head.facts)] or ranked == []  # its last entry left: nobody re-ranked
    ahead = list(itertools.islice(q.walk(1.0), 4))  # a pass reads a few ahead (the affinity window)
    assert len(ranked) <= 1 and ahead[0] is nxt
    q._user_key = real
    assert ahead == list(itertools.islice(q.iter_in_order(1.0), 4))
    assert [e.facts.user for e in ahead] == sorted((e.facts.user for e in q.iter_in_order(1.0)),
                                                  key=lambda u: q._user_key(u, 1.0))[:4]


def test_a_user_with_calls_queued_is_never_forgotten():
    """Beyond `idle_kept` idle tenants are forgotten; one with a call still queued is not, even
    when more than PLACE_SCAN users became active after it (a placement reads only those)."""
    svc = WeightedService(WscConfig(default_weight=1.0, default_output_tokens=0, half_life_s=10.0), idle_kept=2)
    q = make_queue("wsc", service=svc)
    first, waits = entry("w0", t=0, user="waiting", prompt_tokens=5), entry("w1", t=0, user="waiting", prompt_tokens=1)
    q.push(first), q.push(waits)
    q.dispatch(first)  # served once (it has a counter), then nothing running, one call still queued
    svc.complete(first.facts, 5, 0)
    for k in range(70):  # more users than a placement reads, all with calls queued after it
        q.push(entry(f"q{k}", t=1, user=f"q{k}", prompt_tokens=1))
    for k in range(20):  # one-call tenants come and go past the bound
        e = entry(f"x{k}", t=2 + k, user=f"x{k}", prompt_tokens=1)
        q.push(e)
        q.peek(2.0 + k)
        q.dispatch(e)
        svc.complete(e.facts, 1, 0)
    assert svc.get("waiting") == 5.0 and waits in q  # not forgotten: its counter stands


class _DPARankAll(QUEUE_ORDERS["dpa"]):
    """DPA ranking every entry by (its class now, TTFT deadline, arrival), as peek and a pass
    did before: the reference."""

    def _key(self, entry, now):
        deadline = self.tiers.ttft_deadline(entry.facts)
        return (dpa_class(entry.facts.tier, deadline - now, self.tiers.tau_n_s, self.tiers.tau_p_s),
                deadline, self._seq[entry])

    def peek(self, now):
        return min(self._seq, key=lambda e: self._key(e, now), default=None)

    def iter_in_order(self, now):
        return self._walk(sorted(self._seq, key=lambda e: self._key(e, now)))


@given(st.lists(st.tuples(st.sampled_from(["push", "push", "remove", "pop", "walk"]),
                          st.sampled_from([Tier.IW_F, Tier.IW_N, Tier.NIW]),
                          st.floats(0, 20), st.integers(0, 10 ** 6)), max_size=60),
       st.sampled_from([(0.5, math.inf), (0.5, 2.0), (0.0, 0.0), (3.0, 1.0)]))
@settings(max_examples=200, deadline=None)
def test_dpa_by_sorted_tiers_orders_exactly_as_ranking_every_entry(ops, taus):
    """Each tier sorted by TTFT deadline, a class a slice of it: the head and the order of a
    pass are those of ranking every entry by (class now, deadline, arrival), whatever the
    pushes, removals, clock and the τn/τp bounds (classes empty or everywhere)."""
    tiers = TierConfig(targets={Tier.IW_F: TierTarget(1.0, 10.0), Tier.IW_N: TierTarget(4.0, 60.0),
                                Tier.NIW: TierTarget(30.0, 600.0)}, tau_n_s=taus[0], tau_p_s=taus[1])
    fast, ref = make_queue("dpa", tiers=tiers), _DPARankAll(tiers=tiers)
    now, pushed = 0.0, []
    for i, (op, tier, x, pick) in enumerate(ops):
        now += x / 4
        if op == "push":
            facts = RequestFacts(request_id=f"r{i}", model="m", tier=tier, arrival=now - x)
            a, b = QueueEntry(facts, now, seq=pick % 5), QueueEntry(facts, now, seq=pick % 5)
            fast.push(a), ref.push(b)
            pushed.append((a, b))
        elif op == "remove" and pushed:
            a, b = pushed[pick % len(pushed)]
            assert fast.remove(a) == ref.remove(b)
        elif op == "pop":
            a, b = fast.pop(now), ref.pop(now)
            assert (a and a.facts.request_id) == (b and b.facts.request_id)
        else:
            at = now + (pick % 7) - 3  # passes look at other instants too
            assert [e.facts.request_id for e in fast.iter_in_order(at)] == \
                   [e.facts.request_id for e in ref.iter_in_order(at)]
            head, want = fast.peek(at), ref.peek(at)
            assert (head and head.facts.request_id) == (want and want.facts.request_id)


def test_dpa_entries_exactly_on_a_class_bound_rank_as_ranking_every_entry_does():
    tiers = TierConfig(targets={Tier.IW_F: TierTarget(1.0, 10.0), Tier.IW_N: TierTarget(4.0, 60.0),
                                Tier.NIW: TierTarget(30.0, 600.0)}, tau_n_s=0.5, tau_p_s=2.0)
    fast, ref = make_queue("dpa", tiers=tiers), _DPARankAll(tiers=tiers)
    # TTFT deadlines (arrival + 1 s) at now - tau_p, now, now + tau_n and between, now = 10
    for i, arrival in enumerate([7.0, 7.5, 9.0, 9.25, 9.5, 10.0]):
        for q in (fast, ref):
            q.push(QueueEntry(RequestFacts(request_id=f"b{i}", model="m", tier=Tier.IW_F, arrival=arrival), arrival,
                              seq=i))
    for q in (fast, ref):  # an urgent normal call between urgent and relaxed fast ones
        q.push(QueueEntry(RequestFacts(request_id="n", model="m", tier=Tier.IW_N, arrival=6.2), 6.2, seq=9))
    assert [e.facts.request_id for e in fast.iter_in_order(10.0)] == \
           [e.facts.request_id for e in ref.iter_in_order(10.0)] == ["b2", "b3", "n", "b4", "b5", "b0", "b1"]


def _tree_then_newcomers(credit: float, declared: bool = True) -> tuple[WeightedService, list[str]]:
    """A wide tree dispatches its root and 20 calls (its user far above everyone), then a new
    one-call user arrives each second while the tree's last leaf waits: the order served.
    (The papers' placement, `half_life_s = 0`, so that a newcomer's counter is plainly the
    least active one; the anchor does not depend on how newcomers are placed.) Undeclared:
    no call names its interaction; the tree's calls after the root were recognized by their
    prompts as continuing it (lb.core.continuations), each newcomer's as its own: the root,
    continuing nothing, may start an interaction and is anchored as a declared first call is."""
    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=0.0, interaction_credit=credit)
    q = make_queue("wsc", service=svc)

    def call(rid: str, t: float, user: str, interaction: str, stage: int, tokens: int = 1) -> QueueEntry:
        if declared:
            return entry(rid, t=t, user=user, prompt_tokens=tokens, interaction_id=interaction, interaction_stage=stage)
        e = entry(rid, t=t, user=user, prompt_tokens=tokens)
        e.facts.extra[IMPLICIT] = rid if stage == 0 else interaction
        assert interaction_of(e.facts) == (None if stage == 0 else interaction)
        return e

    q.push(call("w0", 0, "wide", "w0", 0))
    q.push(call("s0", 0, "small", "s0", 0, tokens=2))
    assert [q.pop(0.0).facts.request_id for _ in range(2)] == ["w0", "s0"]
    for i in range(1, 21):
        q.push(call(f"w{i}", 1, "wide", "w0", 1))
        assert q.pop(1.0).facts.user == "wide"
    q.push(call("w21", 2, "wide", "w0", 2))
    order = []
    for k in range(6):  # newcomers lifted to the least active counter ("small"'s, 2)
        q.push(call(f"n{k}", 3 + k, f"new{k}", f"n{k}", 0))
        order.append(q.pop(3.0 + k).facts.request_id)
    return svc, order


def test_an_interaction_under_way_keeps_the_rank_it_started_at_ahead_of_users_placed_since():
    """The tree was let in at counter 0; newcomers are placed at 2 (the least active counter):
    its waiting leaf goes before them, though its user's counter (21) is far above.
    Without the credit (least attained service) the leaf waits behind every newcomer. The
    same when the client names no interaction and its calls were recognized by their prompts."""
    for declared in (True, False):
        svc, order = _tree_then_newcomers(credit=128.0, declared=declared)
        assert svc.get("wide") > 20 and order[0] == "w21"
        _, order = _tree_then_newcomers(credit=0.0, declared=declared)
        assert "w21" not in order


def test_an_undeclared_first_call_anchors_the_interaction_its_recognized_continuations_join():
    """A call that names no interaction and continues none is anchored under its own id (the
    key its continuations are recognized under) at its user's counter before its charge, as a
    declared first call is; so the tree's first children, waiting before any of them ran,
    rank where the root was let in, not behind every tree started since."""
    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=0.0)
    q = make_queue("wsc", service=svc)
    for user, rid, declared in (("u1", "root1", True), ("u2", "root2", False)):
        e = entry(rid, t=0, user=user, prompt_tokens=5, interaction_id=rid if declared else None,
                  interaction_stage=0 if declared else None)
        if not declared:
            e.facts.extra[IMPLICIT] = rid  # recognized as starting its own
        q.push(e)
        before = svc.get(user)  # as placed among the active users
        assert q.pop(0.0).facts.request_id == rid
        assert svc.get(user) == before + 5.0 and q.anchor(rid) == before
    q.push(entry("single", t=0, user="u3", prompt_tokens=5))  # nothing recognized: no key, no anchor
    q.pop(0.0)
    assert q.anchor("single") is None


def test_the_credit_bounds_how_far_below_its_users_standing_an_interaction_ranks():
    """With a credit of 5 the tree ranks at its counter less 5 (17), still behind newcomers
    at 2: one interaction, however long, takes at most that much at its old rank; with 30,
    more than it has had, at its anchor."""
    _, order = _tree_then_newcomers(credit=5.0)
    assert "w21" not in order
    _, order = _tree_then_newcomers(credit=30.0)
    assert order[0] == "w21"


def test_vtc_and_calls_outside_interactions_keep_their_users_standing():
    svc = service(default_weight=1.0, default_output_tokens=0, half_life_s=60.0)
    q = make_queue("wsc", service=svc)
    for i in range(10):
        q.push(entry(f"h{i}", t=0, user="heavy", prompt_tokens=1))
        q.pop(0.0)
    q.push(entry("h10", t=1, user="heavy", prompt_tokens=1))
    q.push(entry("l0", t=1, user="light", prompt_tokens=1))
    assert q.pop(1.0).facts.user == "light"  # no interaction: ranked by the standing now
    assert make_queue("vtc").service.cfg.interaction_credit == 0
