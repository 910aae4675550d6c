"""`sim-compare fairness` in virtual time: the abuser's effect on benign tenants per queue
order, and what throttling wastes (one short seed; the figures are in docs/fairness.md)."""
from __future__ import annotations

import argparse
import json

from bench.sim.fair_workload import run, run_one, starts
from bench.sim.workloads_sim import WORKLOADS

DURATION = 60.0


def test_orders_isolate_benign_tenants_and_oit_wastes_nothing_while_rpm_aborts():
    r = {name: run_one((name, 0, True, DURATION)) for name in ("lb fcfs", "lb rpm", "lb wsc (cumulative)", "lb wsc",
                                                                "lb wsc+oit")}
    p90 = {name: x["benign_p90_s"] for name, x in r.items()}
    # the decayed standing (default) protects the benign tenants better than the papers' lift,
    # which beats FCFS
    assert p90["lb wsc"] < p90["lb wsc (cumulative)"] < p90["lb fcfs"]
    # RPM throttles mid-interaction: interactions aborted, the tokens of their earlier stages wasted
    assert r["lb rpm"]["interactions_aborted"] > 0 and r["lb rpm"]["tokens_wasted"] > 0
    # OIT throttles only at an interaction's first stage, and only under overload
    assert r["lb wsc+oit"]["interactions_aborted"] == 0 and r["lb wsc+oit"]["tokens_wasted"] == 0
    assert r["lb wsc+oit"]["interactions_refused"] > 0
    assert r["lb wsc+oit"]["service_share"]["abuser"] < r["lb wsc"]["service_share"]["abuser"]


def test_without_headers_oit_still_wastes_nothing_and_rpm_still_aborts():
    """Clients send no interaction header (the OpenAI `user` stays): each stage's prompt
    carries the last one and its answer, and the daemon's scheduler recognizes it before the
    throttle, short first prompts (a third are under one block) included."""
    r = {name: run_one((name, 0, True, DURATION, False)) for name in ("lb rpm", "lb wsc+oit")}
    assert r["lb rpm"]["interactions_aborted"] > 0 and r["lb rpm"]["tokens_wasted"] > 0
    assert r["lb wsc+oit"]["interactions_aborted"] == 0 and r["lb wsc+oit"]["tokens_wasted"] == 0
    assert r["lb wsc+oit"]["interactions_refused"] > 0


def test_the_abuser_is_the_only_difference_between_the_two_runs_of_a_seed():
    alone, abused = starts(1, False, DURATION), starts(1, True, DURATION)
    assert [x for x in abused if x[2] != "abuser"] == alone
    abuse = [x for x in abused if x[2] == "abuser"]
    assert 5 * len(alone) < len(abuse) * 4 < 15 * len(alone)  # ~10x the mean tenant = 2.5x all four


def test_sim_compare_fairness_writes_the_summary_with_its_own_columns(tmp_path):
    assert "fairness" in WORKLOADS
    args = argparse.Namespace(seeds=1, quick=True, out=str(tmp_path), workers=1)
    assert run(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    wsc = summary["systems"]["lb wsc+oit"]
    for key in ("throughput_rps", "ttft_p50_s", "ttft_p90_s", "benign_p90_ratio", "benign_p90_ratio_own"):
        assert set(wsc[key]) == {"median", "ci95"}
    assert {"service_share", "tokens_wasted", "interactions_aborted", "errors", "cut_at_deadline"} <= set(wsc)
    assert summary["systems"]["lb fcfs"]["benign_p90_ratio"]["median"] > 1
