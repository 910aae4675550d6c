"""Workloads for `lb-bench run`: closed-loop programs and open-loop trace replays.

`make_workload(name, seed=..., **params)` builds one by name; `WORKLOADS` lists them. Params
are the dataclass fields of each workload (e.g. `output_tokens`, `size_scale`, `total_rps`).
"""
from __future__ import annotations

from typing import Callable

from bench.workloads.agent import Agent
from bench.workloads.azure_conv import AzureConv
from bench.workloads.best_of_n import BestOfN
from bench.workloads.base import ClosedLoopWorkload, OpenLoopWorkload, RequestSpec
from bench.workloads.long_short import LongShort
from bench.workloads.mixed_tree import MixedTree
from bench.workloads.mooncake import Mooncake
from bench.workloads.multi_lora import MultiLora
from bench.workloads.multiturn import MultiTurn
from bench.workloads.random_dataset import RandomDataset
from bench.workloads.reasoning import Reasoning
from bench.workloads.servegen import ServeGen
from bench.workloads.shared_prefix import SharedPrefix
from bench.workloads.tot import TreeOfThoughts

WORKLOADS: dict[str, Callable[..., object]] = {
    "tot": TreeOfThoughts,
    "mixed-tree": MixedTree,
    "multiturn": MultiTurn,
    "azure-conv": AzureConv,
    "mooncake": Mooncake,
    "servegen": ServeGen,
    "shared-prefix": SharedPrefix,
    "agent": Agent,
    "reasoning": Reasoning,
    "long-short": LongShort,
    "random": RandomDataset,
    "best-of-n": BestOfN,
    "multi-lora": MultiLora,
}


def make_workload(name: str, seed: int = 0, **params) -> ClosedLoopWorkload | OpenLoopWorkload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](seed=seed, **params)


def is_open_loop(workload: object) -> bool:
    return hasattr(workload, "arrivals")


__all__ = ["WORKLOADS", "make_workload", "is_open_loop", "RequestSpec"]
