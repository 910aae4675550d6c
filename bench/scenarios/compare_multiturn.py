"""Scenario `compare-multiturn`: SkyWalker's multi-turn macrobenchmark, lb vs the routers users
would pick instead (bench/scenarios/_compare.py, bench/systems.py).

Three regions (us, eu, asia) with SkyWalker's one-way latencies; multi-turn conversations from
every region's clients, 80 per region in the paper, scaled down ÷ 4 to 20 per region so two
cores can drive them. `lb` runs one per region with peering (and, in full runs, as one central
coordinator too); every other system is the paper's global-coordinator baseline: one router in
us, reached by eu and asia clients across the (delay-proxied) WAN. Emulated Llama-3-8B on L4
replicas, 2 per region, run `SPEED`× faster than real; the LB probe interval, the cache-affine
scheduler's bounds and the WAN latencies are divided by the same factor, keeping the time
ratios faithful.
"""
from __future__ import annotations

from bench.scenarios._compare import SKYWALKER, Compare, compressed_latency, regions, scenario_runner, systems

DESCRIPTION = "multi-turn, 3 regions (20 clients each): lb per region vs SGLang/vLLM router, nginx, direct in us"
PAPER_CLIENTS = 80  # per region
SCALE = 4
SPEED = 4.0
REPLICAS_PER_REGION = 2


def compare(quick: bool, speed: float = SPEED) -> Compare:
    clients = {name: PAPER_CLIENTS // SCALE for name in ("us", "eu", "asia")}
    return Compare(
        title="Multi-turn conversations, 3 regions",
        scenario="compare-multiturn", quick=quick, workload="multiturn", systems=systems(quick, regional=True),
        duration_s=8.0 if quick else 20.0, speed=speed, params={"output_tokens": 64},
        regions=regions(clients, REPLICAS_PER_REGION), latency_ms=compressed_latency(speed),
        notes=[f"clients {PAPER_CLIENTS}/region in the paper, ÷ {SCALE} here; {REPLICAS_PER_REGION} l4-llama3-8b "
               f"replicas per region at {speed:g}× speed; probe interval and WAN latency ÷ {speed:g}"],
        paper=[SKYWALKER])


run = scenario_runner(compare)
