"""Scenario `compare-random`: the serving benchmarks' random dataset (`sglang.bench_serving
--dataset-name random` at its defaults: unique prompts of 1-1,024 tokens, answers of 1-1,024,
no `user`, Poisson arrivals; bench/workloads/random_dataset.py), lb vs the routers users would
pick instead, one region, 4 replicas (bench/scenarios/_compare.py, bench/systems.py).

The live side of the simulator's held-out `lb-bench sim-compare random`: nothing is shared, so
a router can only balance load, and the answers, not the prompts, fill the replicas. Arrivals
at `RATE_RPS` of engine time, below the capacity the simulator measures behind `lb`; the
replay and the engines `SPEED`x faster (lb's time constants ÷ SPEED). Slowed to 2x because
every answer token is one streamed event through the proxy on this machine's cores.
"""
from __future__ import annotations

from bench.scenarios._compare import Compare, scenario_runner, systems

DESCRIPTION = "the serving benchmarks' random dataset (nothing shared), open loop below capacity, lb vs routers, 4 replicas"
SPEED = 2.0
# 0.9 x 2.96 req/s, the simulator's capacity behind lb (`sim-compare random`, docs/results.md)
RATE_RPS = 2.66


def compare(quick: bool, speed: float = SPEED) -> Compare:
    return Compare(
        title="The serving benchmarks' random dataset, one region",
        scenario="compare-random", quick=quick, workload="random",
        systems=systems(quick, regional=False), duration_s=30.0 if quick else 90.0, speed=speed, replicas=4,
        time_scale=speed, params={"total_rps": RATE_RPS},
        notes=[f"unique prompts of 1-1,024 tokens, answers of 1-1,024 (uniform), no user; Poisson arrivals at "
               f"{RATE_RPS:g} req/s of engine time (~0.9x capacity), {speed:g}x faster (engines too); "
               "4 l4-llama3-8b replicas"])


run = scenario_runner(compare)
