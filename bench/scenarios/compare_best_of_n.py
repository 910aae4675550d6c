"""Scenario `compare-best-of-n`: chat beside parallel sampling (16 apps' system prompts, half the
requests one answer and the rest n = 4 or 8 sampled in parallel; Poisson arrivals;
bench/workloads/best_of_n.py) on SGLang's scheduler as it ships, lb vs the routers users would
pick instead, one region, 4 replicas (bench/scenarios/_compare.py, bench/systems.py).

The live side of the simulator's held-out `lb-bench sim-compare best-of-n --engine sglang`: the
engine runs each sample as a request of its own, with its own KV, so a router that counts
requests undercounts a replica's load by up to 8. Arrivals at `RATE_RPS` of engine time, below
the capacity the simulator measures behind `lb` on those engines; the replay and the engines
`SPEED`x faster (lb's time constants ÷ SPEED).
"""
from __future__ import annotations

from bench.scenarios._compare import Compare, scenario_runner, systems

DESCRIPTION = "chat beside parallel sampling (n = 1, 4, 8) on SGLang's scheduler, open loop below capacity, lb vs routers, 4 replicas"
SPEED = 2.0
PROFILE = "l4-llama3-8b-sglang-fcfs"
# 0.9 x 2.80 req/s, the simulator's capacity on these engines (`sim-compare best-of-n --engine
# sglang`, docs/results.md, fifty-fourth session)
RATE_RPS = 2.52


def compare(quick: bool, speed: float = SPEED) -> Compare:
    return Compare(
        title="Chat beside parallel sampling on SGLang's scheduler, one region",
        scenario="compare-best-of-n", quick=quick, workload="best-of-n",
        systems=systems(quick, regional=False), duration_s=30.0 if quick else 90.0, speed=speed, replicas=4,
        profile=PROFILE, time_scale=speed, params={"total_rps": RATE_RPS},
        notes=[f"16 apps' system prompts of 400-1,600 tokens (Zipf), ~200-token questions, half the requests one "
               f"answer and the rest n = 4 or 8 sampled in parallel, ~200 tokens each; Poisson arrivals at "
               f"{RATE_RPS:g} req/s of engine time (~0.9x capacity), {speed:g}x faster (engines too); 4 {PROFILE} "
               "replicas (SGLang's scheduler as it ships)"])


run = scenario_runner(compare)
