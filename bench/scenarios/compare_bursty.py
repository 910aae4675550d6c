"""Scenario `compare-bursty`: ServeGen's eight busiest tenants at noon (their own bursty
arrival shapes, Azure conversation sizes halved; bench/workloads/servegen.py) past the fleet's
capacity, lb vs the routers users would pick instead, one region, 4 replicas
(bench/scenarios/_compare.py, bench/systems.py).

The live side of the simulator's `bursty` workload (`lb-bench sim-compare bursty`). One tenant
sends about half the requests, so past capacity the p90 over everyone is that tenant's; the
report also gives each tenant's own p90 (`tenants.p90_median_s`, `tenants.p90_worst_s`:
bench.stats.tenant_summary, a request without a first token at the end counted at its wait):
a router that lets the heavy tenant's backlog sit in the engines' queues makes every tenant
wait; `lb`'s fair queue keeps it at the LB and serves the others first. Arrivals at
`RATE_RPS` of engine time, 1.3x the capacity the simulator measures; the replay and the
engines `SPEED`x faster (lb's time constants ÷ SPEED).
"""
from __future__ import annotations

from bench.scenarios._compare import Compare, scenario_runner, systems

DESCRIPTION = "ServeGen's bursty tenants at 1.3x capacity, each tenant's p90, lb vs routers, 4 replicas"
SPEED = 4.0
CAPACITY_RPS = 8.23  # `lb-bench sim-compare bursty`'s measured capacity (docs/results.md)
LOAD = 1.3
RATE_RPS = round(LOAD * CAPACITY_RPS, 2)


def tenant_notes(variants: dict[str, dict]) -> list[str]:
    notes = []
    for name, v in variants.items():
        figures = v.get("repeats", {}).get("figures", {})
        med, worst = figures.get("tenants.p90_median_s"), figures.get("tenants.p90_worst_s")
        if med and med["median"] is not None:
            notes.append(f"{name}: each tenant's TTFT p90, the median tenant's {_s(med)} s, the worst's "
                         f"{_s(worst)} s (median [min, max] over the runs)")
    return notes


def _s(fig: dict) -> str:
    return f"{fig['median']:.2f} [{fig['min']:.2f}, {fig['max']:.2f}]"


def compare(quick: bool, speed: float = SPEED) -> Compare:
    return Compare(
        title="Bursty tenants past capacity, one region",
        scenario="compare-bursty", quick=quick, workload="servegen",
        systems=systems(quick, regional=False), duration_s=10.0 if quick else 60.0, speed=speed, replicas=4,
        time_scale=speed, params={"total_rps": RATE_RPS, "size_scale": 0.5},
        derived_notes=tenant_notes,
        notes=[f"ServeGen's 8 busiest tenants at noon, Azure conversation sizes x0.5; {RATE_RPS:g} req/s of "
               f"engine time ({LOAD:g}x the simulator's capacity), {speed:g}x faster (engines too); "
               "4 l4-llama3-8b replicas"])


run = scenario_runner(compare)
