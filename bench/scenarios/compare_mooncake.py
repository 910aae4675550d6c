"""Scenario `compare-mooncake`: open-loop replay of Mooncake's conversation trace (real prefix
structure: shared 512-token blocks become shared text), lb vs the routers users would pick
instead, one region (bench/scenarios/_compare.py, bench/systems.py).

Blocks and outputs are scaled by `SIZE_SCALE` and contexts clipped to `MAX_INPUT_TOKENS`
(keeping the leading, shared blocks) so they fit Llama-3-8B on an L4; the replay runs
`SPEED`× faster, as do the 4 emulated replicas (lb's probe interval and affinity bounds ÷ SPEED).
The trace is `bench/data/mooncake` (see bench/data/README.md).
"""
from __future__ import annotations

from bench.scenarios._compare import SKYWALKER, Compare, scenario_runner, systems

DESCRIPTION = "Mooncake trace replay (prefix blocks kept, contexts clipped), lb vs routers, 4 replicas"
SPEED = 4.0
SIZE_SCALE = 0.25
MAX_INPUT_TOKENS = 2048


def compare(quick: bool, speed: float = SPEED) -> Compare:
    return Compare(
        title="Mooncake conversation trace replay, one region",
        scenario="compare-mooncake", quick=quick, workload="mooncake",
        systems=systems(quick, regional=False), duration_s=8.0 if quick else 30.0, speed=speed, replicas=4,
        time_scale=speed, params={"size_scale": SIZE_SCALE, "max_input_tokens": MAX_INPUT_TOKENS},
        notes=[f"Mooncake conversation trace from its start, {speed:g}× faster (engines too); blocks and outputs × "
               f"{SIZE_SCALE:g}, contexts clipped to {MAX_INPUT_TOKENS} tokens; 4 l4-llama3-8b replicas"],
        paper=[SKYWALKER])


run = scenario_runner(compare)
