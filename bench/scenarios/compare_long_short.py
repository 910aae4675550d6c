"""Scenario `compare-long-short`: a chat service beside long documents (4 system prompts of 300
tokens, 100-token questions, 200-token answers; one request in ten a unique 6,000-token document
with a 300-token answer; Poisson arrivals; bench/workloads/long_short.py) on SGLang's scheduler
as it ships (arrival order, a decode reservation, retractions), lb vs the routers users would
pick instead, one region, 4 replicas (bench/scenarios/_compare.py, bench/systems.py).

The live side of the simulator's held-out `lb-bench sim-compare long-short --engine sglang`:
a document's prefill holds a replica's steps for seconds and the chats behind it wait, so the
routers differ in where they let chats queue. Arrivals at `RATE_RPS` of engine time, past the
capacity the simulator measures behind `lb` on those engines; the replay and the engines
`SPEED`x faster (lb's time constants ÷ SPEED).
"""
from __future__ import annotations

from bench.scenarios._compare import Compare, scenario_runner, systems

DESCRIPTION = "chat beside long documents on SGLang's scheduler, open loop past capacity, lb vs routers, 4 replicas"
SPEED = 2.0
PROFILE = "l4-llama3-8b-sglang-fcfs"
# 1.39 x 4.79 req/s, the simulator's capacity on these engines (`sim-compare long-short --engine
# sglang`; 1.3x the 5.12 it measures with `--schedule-policy lpm`): `sim-compare ... --load 1.391
# --duration 120` is this run's window in the simulator (docs/results.md, forty-first session)
RATE_RPS = 6.66


def compare(quick: bool, speed: float = SPEED) -> Compare:
    return Compare(
        title="Chat beside long documents on SGLang's scheduler, one region",
        scenario="compare-long-short", quick=quick, workload="long-short",
        systems=systems(quick, regional=False), duration_s=10.0 if quick else 60.0, speed=speed, replicas=4,
        profile=PROFILE, time_scale=speed, params={"total_rps": RATE_RPS},
        notes=[f"4 system prompts x 300 tokens, 100-token questions, 200-token answers; 1 request in 10 a unique "
               f"6,000-token document (300-token answers); Poisson arrivals at {RATE_RPS:g} req/s of engine time "
               f"(~1.39x capacity), {speed:g}x faster (engines too); 4 {PROFILE} replicas (SGLang's scheduler as "
               "it ships: arrival order, a decode reservation, retractions)"])


run = scenario_runner(compare)
