"""`random`: the serving benchmarks' random dataset, open loop, no prefix shared.

What `python -m sglang.bench_serving --dataset-name random` sends at its defaults (and vLLM's
`vllm bench serve --dataset-name random` with the same lengths): every prompt random tokens of
its own, its length uniform in [`range_ratio` x `input_len`, `input_len`] (at least 1), its
answer's likewise in [`range_ratio` x `output_len`, `output_len`], the answer's length declared
as `max_tokens` (the tools also send `ignore_eos`) and no `user`; Poisson arrivals at
`total_rps`. Nothing is shared, so a prefix-aware router has nothing to keep together and must
balance load alone: the shape an operator benchmarks first, with the tool they already have.
Held out: added after the policy was settled (fiftieth session); the simulator's `random` is
the same draws (bench/sim/workloads_sim.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

from bench.workloads.base import RequestSpec, pseudo_text, require_positive, require_whole, rng_for


class Draw(NamedTuple):
    i: int
    at: float  # at 1 req/s
    input_tokens: int
    output_tokens: int


def draws(seed: int, input_len: int = 1024, output_len: int = 1024, range_ratio: float = 0.0) -> Iterator[Draw]:
    """The arrivals at 1 req/s and each one's lengths."""
    rng = rng_for(seed, "random")
    lo_in, lo_out = max(1, int(input_len * range_ratio)), max(1, int(output_len * range_ratio))
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(1.0)
        yield Draw(i, t, rng.randint(lo_in, input_len), rng.randint(lo_out, output_len))
        i += 1


@dataclass
class RandomDataset:
    seed: int = 0
    total_rps: float = 1.0
    input_len: int = 1024
    output_len: int = 1024
    range_ratio: float = 0.0
    name: str = "random"

    def __post_init__(self) -> None:
        require_whole(self, "input_len", "output_len")
        require_positive(self, "total_rps", "input_len", "output_len")
        if not 0.0 <= self.range_ratio <= 1.0:
            raise ValueError(f"random: range_ratio must be in [0, 1] (got {self.range_ratio!r}); e.g. --param range_ratio=0.5")

    def arrivals(self) -> Iterator[RequestSpec]:
        for d in draws(self.seed, self.input_len, self.output_len, self.range_ratio):
            yield RequestSpec(
                request_id=f"random-{self.seed}-{d.i}",
                messages=[{"role": "user", "content": pseudo_text(f"random/{self.seed}/{d.i}", d.input_tokens)}],
                max_tokens=d.output_tokens, at=d.at / self.total_rps)
