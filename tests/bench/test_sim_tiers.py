"""`sim-compare tiers` in virtual time: tier-aware orders against FCFS (one short seed)."""
from __future__ import annotations

from bench.sim.tiers_workload import capacity_rps, run_one, summarize

DURATION = 60.0


def test_tier_aware_orders_meet_more_iw_f_targets_than_fcfs_near_capacity():
    r = {order: run_one((order, "near", 0, DURATION)) for order in ("fcfs", "pf", "dpa")}
    assert capacity_rps() > 0
    assert r["pf"]["iw-f_violations"] < r["fcfs"]["iw-f_violations"]
    assert r["dpa"]["iw-f_violations"] < r["fcfs"]["iw-f_violations"]
    # PF buys IW-F's targets with IW-N's; DPA keeps both, and the NIW batch jobs it is given
    assert r["dpa"]["iw-n_violations"] < r["pf"]["iw-n_violations"]
    assert r["dpa"]["niw_jobs"] > 0 and r["dpa"]["niw_on_time"] == 1.0
    assert r["pf"]["niw_on_time"] < 1.0  # PF ranks released NIW last: some miss their deadline
    summary = summarize([{**x, "load": "near"} for x in r.values()] + [{**x, "load": "over"} for x in r.values()], 1,
                        DURATION)
    dpa = summary["systems"]["lb dpa @near"]
    assert set(dpa["iw-f_violations"]) == {"median", "ci95"} and "cut_at_deadline" in dpa
