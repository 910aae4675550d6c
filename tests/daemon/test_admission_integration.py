"""Admission, NIW deferral, OIT under real overload, priority pass-through and shared limits:
a real `lb` in front of real emulators (and a real redis-server) over loopback.

Overload is real: the emulator runs one request at a time (`--max-running 1`), so a few long
requests fill it, its own queue, and the LB queue.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import Future

from tests.daemon.conftest import http_json, needs_emulator, start_lb_with_emulator
from tests.procs import metric, poll

pytestmark = needs_emulator


def body(max_tokens: int = 4, words: int = 1) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": " ".join(["hello"] * words)}],
            "max_tokens": max_tokens, "ignore_eos": True}


def chat(lb, doc: dict, headers: dict | None = None, timeout: float = 30.0):
    return http_json("POST", lb.url + "/v1/chat/completions", doc, headers=headers, timeout=timeout)


def saturate(pool, lb, n: int, max_tokens: int = 250, user: str = "load") -> list[Future]:
    """n long requests of another tenant; returns once the LB queue or the replica is backed up."""
    futs = [pool.submit(chat, lb, body(max_tokens), {"x-lb-user": user}) for _ in range(n)]
    poll(lambda: metric(lb.url, "lb_replica_running") >= 1 and metric(lb.url, "lb_replica_available") == 0,
         what="the replica to be full")
    return futs


def lower(h: dict) -> dict:
    return {k.lower(): v for k, v in h.items()}


def test_infeasible_request_is_rejected_at_once_with_reason_and_retry_after(procs, tmp_path):
    lb, _ = start_lb_with_emulator(procs, tmp_path, "[admission]\nenabled = true\nprefill_tps = 10.0\n",
                                   "--speed", "50")
    t0 = time.monotonic()
    status, doc = chat(lb, body(words=100))  # ~125 prompt tokens at 10 tok/s: TTFT ≈ 12 s > every tier
    assert time.monotonic() - t0 < 2.0
    assert status == 429 and doc["error"]["code"] == "slo_infeasible"
    assert "ttft-infeasible" in lower(doc["_headers"])["x-lb-reject-reason"]
    assert "TTFT" in doc["error"]["message"] and int(lower(doc["_headers"])["retry-after"]) >= 1
    assert metric(lb.url, "lb_admission_decisions_total", action="reject", reason="ttft-infeasible") == 1
    assert chat(lb, body(words=1))[0] == 200  # a short prompt is still feasible
    assert metric(lb.url, "lb_admission_decisions_total", action="admit") == 1


def test_degradable_request_gets_fewer_tokens_and_says_so(procs, tmp_path):
    lb, _ = start_lb_with_emulator(procs, tmp_path, "[admission]\nenabled = true\ndecode_tps = 10.0\n"
                                   "[tiers.targets.iw-n]\nttft_s = 5.0\ne2e_s = 5.0\n", "--speed", "50")
    status, doc = chat(lb, body(max_tokens=500))  # 500 tokens at 10 tok/s: E2E 50 s > 5 s
    assert status == 200
    degraded = lower(doc["_headers"])["x-lb-degraded"]
    n = int(re.search(r"max_tokens=(\d+)", degraded).group(1))
    assert 32 <= n <= 50 and "tier=iw-n" in degraded
    assert doc["usage"]["completion_tokens"] == n  # the engine really got the lowered limit
    assert metric(lb.url, "lb_admission_decisions_total", action="degrade") == 1


def test_niw_is_held_while_the_region_is_busy_and_released_when_it_is_not(procs, tmp_path, pool):
    lb, _ = start_lb_with_emulator(procs, tmp_path, "", "--max-running", "1")
    blockers = saturate(pool, lb, 3)
    niw = pool.submit(chat, lb, body(max_tokens=4), {"x-lb-tier": "niw", "x-lb-user": "batch"})
    poll(lambda: metric(lb.url, "lb_deferred_waiting") == 1, what="the NIW request to be deferred")
    assert not niw.done() and not all(f.done() for f in blockers)
    assert metric(lb.url, "lb_deferred_released_total") == 0
    assert [f.result()[0] for f in blockers] == [200] * 3
    status, _ = niw.result(timeout=30)
    assert status == 200
    assert metric(lb.url, "lb_deferred_released_total", why="capacity") == 1
    assert metric(lb.url, "lb_deferred_waiting") == 0


def test_oit_throttles_new_work_under_real_overload_but_never_mid_interaction(procs, tmp_path, pool):
    lb, _ = start_lb_with_emulator(procs, tmp_path, '[fairness]\nthrottle = "oit"\nuser_rpm = 2\n'
                                   'overload_queue_len = 0\noverload_no_replica_s = 0.2\n', "--max-running", "1")
    alice = {"x-lb-user": "alice", "x-lb-interaction-id": "conv-1", "x-lb-interaction-stage": "0"}
    assert chat(lb, body(), alice)[0] == 200  # idle region: within and then over the limit is fine
    assert chat(lb, body(), {"x-lb-user": "alice"})[0] == 200
    assert chat(lb, body(), {"x-lb-user": "alice"})[0] == 200  # over the limit, not overloaded: no 429
    blockers = saturate(pool, lb, 5)
    poll(lambda: metric(lb.url, "lb_overloaded") == 1, what="no replica available for 0.2 s")
    status, doc = chat(lb, body(), {"x-lb-user": "alice"})  # new work over the limit, overloaded
    assert status == 429 and doc["error"]["code"] == "rate_limit_exceeded"
    h = lower(doc["_headers"])
    assert int(h["retry-after"]) >= 1 and h["x-ratelimit-limit-requests"] == "2"
    assert h["x-ratelimit-remaining-requests"] == "0" and h["x-ratelimit-reset-requests"].endswith("s")
    # the interaction alice already started is stalled in the queue, not aborted
    status, _ = chat(lb, body(), {**alice, "x-lb-interaction-stage": "1"})
    assert status == 200
    assert [f.result()[0] for f in blockers] == [200] * 5
    assert metric(lb.url, "lb_interactions_aborted_total") == 0 and metric(lb.url, "lb_tokens_wasted_total") == 0


def test_tier_priority_reaches_the_engine_which_runs_iw_f_first(procs, tmp_path, pool):
    # Blind pushing and FCFS: the LB reorders nothing, so only the engine's priority can.
    lb, _ = start_lb_with_emulator(procs, tmp_path, '[pushing]\nmode = "blind"\n', "--max-running", "1")
    blocker = pool.submit(chat, lb, body(max_tokens=150), {"x-lb-user": "load"})
    poll(lambda: metric(lb.url, "lb_replica_running") >= 1, what="the blocker to run")
    done: dict[str, float] = {}

    def timed(tier: str):
        status, _ = chat(lb, body(max_tokens=20), {"x-lb-tier": tier})
        done[tier] = time.monotonic()
        return status

    normal = pool.submit(timed, "iw-n")
    poll(lambda: metric(lb.url, "lb_replica_pending") >= 1, what="iw-n to wait in the engine")
    fast = pool.submit(timed, "iw-f")
    assert [blocker.result()[0], normal.result(), fast.result()] == [200, 200, 200]
    assert done["iw-f"] < done["iw-n"]  # sent later, run first: SGLang's higher priority


def test_two_lbs_sharing_redis_enforce_one_limit(procs, tmp_path, redis_url):
    toml = (f'[fairness]\nthrottle = "rpm"\nuser_rpm = 3\n[state]\nbackend = "redis"\nurl = "{redis_url}"\n'
            f'prefix = "t{time.monotonic_ns()}:"\n')
    lb1, urls = start_lb_with_emulator(procs, tmp_path, toml, "--speed", "50", name="lb1")
    lb2, _ = start_lb_with_emulator(procs, tmp_path, toml, name="lb2", urls=urls)
    alice = {"x-lb-user": "alice"}
    statuses = [chat(lb, body(), alice)[0] for lb in (lb1, lb2, lb1, lb2)]
    assert statuses == [200, 200, 200, 429]  # one window of 3 across both LBs
    assert chat(lb1, body(), {"x-lb-user": "bob"})[0] == 200


def _tree_call_or_newcomers_first(procs, tmp_path, pool, toml: str) -> tuple[float, list[float]]:
    """A tenant runs an interaction alone (6 calls with long prompts: far more service than
    anyone), then the replica fills; its next call queues at the LB behind the blocker, then
    three new tenants' first calls. When each finished: the interaction's call, the newcomers'."""
    lb, _ = start_lb_with_emulator(procs, tmp_path, '[fairness.wsc]\nhalf_life_s = 0\n' + toml,
                                   "--max-running", "1")
    tree = {"x-lb-user": "tree", "x-lb-interaction-id": "tree-1"}
    for stage in range(6):
        assert chat(lb, body(max_tokens=32, words=200), {**tree, "x-lb-interaction-stage": str(min(stage, 1))})[0] == 200
    blockers = saturate(pool, lb, 1, max_tokens=120)
    done: dict[str, float] = {}

    def timed(name: str, headers: dict) -> int:
        status, _ = chat(lb, body(max_tokens=4), headers)
        done[name] = time.monotonic()
        return status

    futs = [pool.submit(timed, "tree", {**tree, "x-lb-interaction-stage": "2"})]
    poll(lambda: metric(lb.url, "lb_queue_length") == 1, what="the interaction's call to queue at the LB")
    for k in range(3):
        futs.append(pool.submit(timed, f"new{k}", {"x-lb-user": f"new{k}", "x-lb-interaction-id": f"n{k}",
                                                    "x-lb-interaction-stage": "0"}))
    poll(lambda: metric(lb.url, "lb_queue_length") == 4, what="the newcomers to queue behind it")
    assert not any(f.done() for f in blockers)
    assert [f.result()[0] for f in blockers] == [200] and [f.result() for f in futs] == [200] * 4
    return done["tree"], [done[f"new{k}"] for k in range(3)]


def test_an_interaction_under_way_keeps_its_rank_ahead_of_tenants_placed_since(procs, tmp_path, pool):
    """Over HTTP, the interaction headers carry the anchor (`[fairness.wsc] interaction_credit`,
    on by default): its call goes before three newcomers though its tenant has had far more
    service; with the credit off (least attained service) it goes after all of them."""
    tree, newcomers = _tree_call_or_newcomers_first(procs, tmp_path, pool, "")
    assert tree < min(newcomers)
    for p in reversed(procs):
        p.stop()
    procs.clear()
    tree, newcomers = _tree_call_or_newcomers_first(procs, tmp_path, pool, "interaction_credit = 0\n")
    assert tree > max(newcomers)
