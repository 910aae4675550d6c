"""Scenario `compare-mixed-tree`: SkyWalker's Mixed Tree macrobenchmark in one region, lb vs the
routers users would pick instead (bench/scenarios/_compare.py, bench/systems.py).

Tree-of-Thoughts clients of which two grow 4-branch trees (a depth-4 4-branch tree fans out
to 64 then 256 sibling requests sharing one prefix: bursts that punish routers which pin a
prefix to one replica), the others 2-branch, all in one region over 4 emulated Llama-3-8B on
L4 replicas, `SPEED`× faster than real (lb's probe interval and affinity bounds divided alike).
"""
from __future__ import annotations

from bench.scenarios._compare import SKYWALKER, Compare, scenario_runner, systems

DESCRIPTION = "Mixed Tree in one region: two 4-branch + six 2-branch ToT clients, lb vs routers, 4 replicas"
CLIENTS = 8
WIDE_EVERY = 4  # clients 3 and 7 grow 4-branch trees
SPEED = 4.0


def compare(quick: bool, speed: float = SPEED) -> Compare:
    return Compare(
        title="Mixed Tree (two 4-branch clients), one region",
        scenario="compare-mixed-tree", quick=quick, workload="mixed-tree",
        systems=systems(quick, regional=False), duration_s=8.0 if quick else 20.0, speed=speed, replicas=4,
        clients=CLIENTS, params={"wide_every": WIDE_EVERY, "output_tokens": 64},
        notes=[f"{CLIENTS} ToT clients, every {WIDE_EVERY}th 4-branch (two), the rest 2-branch, depth 4; "
               f"4 l4-llama3-8b replicas at {speed:g}× speed; lb probe interval and affinity bounds ÷ {speed:g}"],
        paper=[SKYWALKER])


run = scenario_runner(compare)
