"""Scenario `compare-multi-lora`: one base model serving 32 LoRA adapters, Zipf-popular, each
with its own system prompt (bench/workloads/multi_lora.py), each engine's batch running at most
8 adapters, lb vs the routers users would pick instead, one region, 4 replicas
(bench/scenarios/_compare.py, bench/systems.py).

The live side of the simulator's held-out `lb-bench sim-compare multi-lora`: the engines skip a
request whose adapter would be one too many for the batch, so a router that spreads each adapter
over every replica leaves requests waiting in an engine beside a replica that could run them.
Arrivals at `RATE_RPS` of engine time, below the capacity the simulator measures behind `lb`;
the replay and the engines `SPEED`x faster (lb's time constants ÷ SPEED).
"""
from __future__ import annotations

from bench.scenarios._compare import Compare, scenario_runner, systems
from bench.workloads.multi_lora import MAX_LORAS, MultiLora

DESCRIPTION = "one model serving 32 LoRA adapters (8 a batch), open loop below capacity, lb vs routers, 4 replicas"
SPEED = 1.0
PROFILE = "l4-llama3-8b"
# 0.9 x 10.17 req/s, the simulator's capacity on these engines (`sim-compare multi-lora`,
# docs/results.md, fifty-fifth session)
RATE_RPS = 9.15


def compare(quick: bool, speed: float = SPEED) -> Compare:
    adapters = MultiLora().adapters
    return Compare(
        title="One model serving 32 LoRA adapters, one region",
        scenario="compare-multi-lora", quick=quick, workload="multi-lora",
        systems=systems(quick, regional=False), duration_s=30.0 if quick else 90.0, speed=speed, replicas=4,
        profile=PROFILE, time_scale=speed, params={"total_rps": RATE_RPS},
        emulator_args=["--lora-adapters", str(adapters), "--max-loras", str(MAX_LORAS)],
        notes=[f"{adapters} LoRA adapters of one model (Zipf), each with its own system prompt of 300-900 tokens, "
               f"~150-token questions and answers, at most {MAX_LORAS} adapters a batch; Poisson arrivals at "
               f"{RATE_RPS:g} req/s of engine time (~0.9x capacity), {speed:g}x faster (engines too); 4 {PROFILE} "
               "replicas"])


run = scenario_runner(compare)
