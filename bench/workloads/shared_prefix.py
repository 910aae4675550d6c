"""`shared-prefix`: SGLang's own shared-prefix benchmark (`python -m sglang.bench_serving
--dataset-name generated-shared-prefix`), open loop.

At its defaults: 64 system prompts of 2,048 tokens, each request one of them (uniformly, as the
benchmark's shuffled 64 x 16 prompts) and a 128-token question of its own, 256-token answers,
Poisson arrivals at `total_rps`. The simulator's `shared-prefix` workload is the same traffic
(bench/sim/workloads_sim.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from bench.workloads.base import RequestSpec, pseudo_text, require_positive, rng_for


@dataclass
class SharedPrefix:
    seed: int = 0
    total_rps: float = 1.0
    groups: int = 64
    system_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 256
    name: str = "shared-prefix"

    def __post_init__(self) -> None:
        require_positive(self, "total_rps", "groups", "system_tokens", "question_tokens", "output_tokens")

    def arrivals(self) -> Iterator[RequestSpec]:
        rng = rng_for(self.seed, "shared-prefix")
        t = 0.0
        i = 0
        while True:
            t += rng.expovariate(self.total_rps)
            group = rng.randrange(self.groups)
            yield RequestSpec(
                request_id=f"gsp-{self.seed}-{i}",
                messages=[{"role": "system", "content": pseudo_text(f"gsp-system/{group}", self.system_tokens)},
                          {"role": "user", "content": pseudo_text(f"gsp-question/{self.seed}/{i}", self.question_tokens)}],
                max_tokens=self.output_tokens, user="gsp", app="shared-prefix", at=t, meta={"group": group})
            i += 1
