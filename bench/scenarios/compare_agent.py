"""Scenario `compare-agent`: tool-using agent sessions (bench/workloads/agent.py), lb vs the
routers users would pick instead, one region, 4 replicas (bench/scenarios/_compare.py,
bench/systems.py).

The live side of the simulator's held-out `agent` workload (`lb-bench sim-compare agent`): each
session's context grows to ~6,000 tokens over its steps and sits idle in the caches while its
tool runs, so four L4 replicas hold only a few sessions each; the routers differ in keeping a
session where its context is without piling sessions onto one replica. `CLIENTS` closed-loop
clients, one session at a time: in the simulator (360 s, seed 0) 32 clients keep the fleet at
its capacity behind `lb` (2.52 req/s) and past it behind nginx's session hash (2.06 req/s, TTFT
p90 5.9 s against 0.6 s). Engines, tool runs and lb's time constants `SPEED`x faster.
"""
from __future__ import annotations

from bench.scenarios._compare import Compare, scenario_runner, systems

DESCRIPTION = "tool-using agent sessions (growing ~6k-token contexts, 1 s tool runs), lb vs routers, 4 replicas"
SPEED = 4.0
CLIENTS = 32


def compare(quick: bool, speed: float = SPEED) -> Compare:
    return Compare(
        title="Agent sessions, one region",
        scenario="compare-agent", quick=quick, workload="agent",
        systems=systems(quick, regional=False), duration_s=15.0 if quick else 90.0, speed=speed, replicas=4,
        clients=CLIENTS, time_scale=speed,
        notes=[f"{CLIENTS} clients, one agent session each at a time: a 1,500-token system prompt, a task, 4-16 steps "
               "appending the answer and a 50-1,500-token tool observation, ~1 s tool runs; 4 l4-llama3-8b "
               f"replicas, engines and tool runs {speed:g}x faster"])


run = scenario_runner(compare)
