"""The simulated scenarios (capacity-day, burst, global-vs-regional-peak) through their own
config builders and `bench.sim.runner`, shrunk to a few seconds: 20-40 minutes of the trace
day at a low volume, and the day's own window rates instead of a Holt-Winters fit
(`forecast = "perfect"`; the fit is tested in test_sim.py)."""
from __future__ import annotations

import pytest

from bench.scenarios import burst, capacity_day
from bench.scenarios import global_vs_regional_peak as gvr
from bench.sim.runner import run_config, run_variants
from bench.sim.world import parse_config

PEAK = 20 * 3600 + 30 * 60  # 20:30, just before the trace day's busiest window


def _shrink(data: dict, minutes: int = 20, rate_scale: float = 0.0005, static: int = 4) -> dict:
    data = {**data, "start_s": PEAK, "duration_s": minutes * 60}
    data["arrivals"] = {**data["arrivals"], "rate_scale": rate_scale}
    data["models"] = [{**m, "replicas": static} for m in data["models"]]
    if "scaling" in data:
        data["scaling"] = {**data["scaling"], "forecast": "perfect"}
    return data


def test_capacity_day_variants_report_the_figures_and_autoscaling_saves_instance_hours(tmp_path):
    # half the volume the 4 replicas were sized for: the plans (μ of quick's static fleet) ask for 2
    configs = {v: _shrink(capacity_day.config(v, quick=True), rate_scale=0.00025) for v in capacity_day.VARIANTS}
    results = run_variants(configs, tmp_path, "capacity-day (test)", workers=1)
    summaries = {v: r["summary"] for v, r in results.items()}
    for v, s in summaries.items():
        assert {"instance_hours", "slo_attainment", "cold_start_waste_hours"} <= set(s), v
        assert s["requests"] > 200 and 0.0 <= s["slo_attainment"] <= 1.0, v
        assert (tmp_path / v / "series.json").exists() and (tmp_path / v / "timeseries.png").exists()
    static = summaries.pop("static-peak")
    assert static["instance_hours"] == pytest.approx(4 * 20 / 60)  # 4 replicas billed 20 min
    assert static["cold_start_waste_hours"] == 0.0 and "scaling" not in static
    for v, s in summaries.items():
        assert s["scaling"]["strategy"] == configs[v]["scaling"]["strategy"] and s["scaling"]["decisions"] > 0, v
    # the plan-driven strategies shed part of the peak fleet (the plan is 1-2 replicas here);
    # reactive may not: a minute of 4x arrivals (ServeGen's bursty clients) drives its KV
    # signal over 70 % and it starts instances that take 5 minutes to come
    for v in ("lt-i", "lt-u", "lt-ua", "preserve"):
        assert summaries[v]["instance_hours"] < static["instance_hours"], v
    assert summaries["reactive"]["cold_start_waste_hours"] > 0


def test_burst_spikes_are_measured_and_the_warm_pool_starts_replicas_in_a_minute():
    data = _shrink(burst.config("lt-ua+warm", quick=True), minutes=30, static=2)
    data["arrivals"]["spikes"] = [{"at_s": PEAK + 300, "duration_s": 600.0, "factor": burst.FACTOR}]
    data["scaling"]["warm_pool"] = 3
    s = run_config(parse_config(data))["summary"]
    assert {"instance_hours", "slo_attainment", "cold_start_waste_hours"} <= set(s)
    spikes = s["spikes"]
    assert spikes["completions"] > 0 and spikes["slo_attainment"] is not None
    scaling = s["scaling"]
    assert scaling["warm_pool"] == 3 and scaling["warm_starts"] >= 1  # the spike drew on the pool
    assert scaling["warm_pool_instance_hours"] == pytest.approx(3 * 0.5)
    # warm starts cost 1 min of start-up each, cold ones 5: the waste is bounded by what started
    assert s["cold_start_waste_hours"] <= (scaling["warm_starts"] * 60 + scaling["cold_starts"] * 300) / 3600 + 1e-9


def test_forwarding_lets_a_phase_shifted_fleet_serve_the_region_at_its_peak():
    """Same fleet, 3 replicas per region, at us's peak hour (eu and asia are off-peak):
    with SkyWalker forwarding us's overflow is served by its peers, without it us queues."""
    fleet = [3, 3, 3]
    runs = {}
    for forward, variant in ((False, "regional"), (True, "global")):
        data = gvr.config(fleet, variant, quick=True)
        data.update(start_s=PEAK, duration_s=1200)
        data["arrivals"]["rate_scale"] = 0.0015
        runs[forward] = run_config(parse_config(data))["summary"]
    alone, shared = runs[False], runs[True]
    assert alone["forwarded"] == 0 and shared["forwarded"] > 0
    assert {"instance_hours", "slo_attainment", "cold_start_waste_hours"} <= set(shared)
    assert shared["instance_hours"] == pytest.approx(alone["instance_hours"])
    assert shared["slo_attainment_by_region"]["us"] > alone["slo_attainment_by_region"]["us"] + 0.05
    assert min(shared["slo_attainment_by_region"].values()) > min(alone["slo_attainment_by_region"].values())
