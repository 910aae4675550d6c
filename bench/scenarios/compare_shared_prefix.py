"""Scenario `compare-shared-prefix`: SGLang's own shared-prefix benchmark (64 system prompts of
2,048 tokens, 128-token questions, 256-token answers, Poisson arrivals; bench/workloads/
shared_prefix.py), lb vs the routers users would pick instead, one region, 4 replicas
(bench/scenarios/_compare.py, bench/systems.py).

The live side of the simulator's held-out workload (`lb-bench sim-compare shared-prefix`): its
system prompts are as much as the four L4 replicas' KV holds, so the routers differ in how well
they keep each prompt on few replicas. Arrivals at `RATE_RPS` of engine time, just past the
capacity the simulator measures behind `lb`; the replay and the engines `SPEED`x faster (lb's
time constants ÷ SPEED).
"""
from __future__ import annotations

from bench.scenarios._compare import Compare, scenario_runner, systems

DESCRIPTION = "SGLang's generated-shared-prefix benchmark, open loop just past capacity, lb vs routers, 4 replicas"
SPEED = 4.0
# 1.1 x 3.24 req/s, the simulator's capacity as first measured (24 clients a replica); 1.04 x the
# 3.43 measured since with enough clients to saturate the fleet (docs/results.md)
RATE_RPS = 3.564


def compare(quick: bool, speed: float = SPEED) -> Compare:
    return Compare(
        title="SGLang's shared-prefix benchmark, one region",
        scenario="compare-shared-prefix", quick=quick, workload="shared-prefix",
        systems=systems(quick, regional=False), duration_s=10.0 if quick else 60.0, speed=speed, replicas=4,
        time_scale=speed, params={"total_rps": RATE_RPS},
        notes=[f"64 system prompts x 2,048 tokens, 128-token questions, 256-token answers; Poisson arrivals at "
               f"{RATE_RPS:g} req/s of engine time (~1.04x capacity), {speed:g}x faster (engines too); "
               "4 l4-llama3-8b replicas"])


run = scenario_runner(compare)
