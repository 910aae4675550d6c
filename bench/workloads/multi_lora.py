"""`multi-lora`: one base model serving many LoRA adapters (fine-tunes), open loop.

`adapters` fine-tunes of one base model, each a customer's or a task's, requested by name as
the API's `model` and Zipf-popular (weight 1/rank). Each adapter's requests share its own system
prompt (fixed lengths of `system_min_tokens`-`system_max_tokens`) before a question of their own
(lognormal, median `question_median` tokens); answers are lognormal (median `answer_median`).
Poisson arrivals at `total_rps`.

Every replica serves every adapter, but one batch runs at most `MAX_LORAS` of them (vLLM
`--max-loras`, SGLang `--max-loras-per-batch`): 32 adapters on 4 replicas of 8 slots each. A
router that spreads each adapter over every replica brings each engine nearly all 32, and a
request for a ninth adapter there is skipped until one of its eight finishes, while the replica
next to it could run it at once. An adapter's KV is its own, so a system prompt cached for one
adapter is no hit for another. Synthetic and held out: added after `lb`'s policy was settled
(fifty-fifth session). The simulator's `multi-lora` workload sends the same requests
(`MultiLora.draws`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

from bench.workloads.base import (RequestSpec, fixed_lengths, lognormal_tokens, pseudo_text, require_positive,
                                  require_whole, rng_for)

QUESTION_SIGMA, ANSWER_SIGMA = 0.6, 0.6
MIN_QUESTION, MAX_QUESTION, MIN_ANSWER, MAX_ANSWER = 16, 1000, 16, 1024
# the fleet's engines in the simulator and the live scenario: 8 adapters a batch (SGLang's
# default; vLLM's is 1, which operators serving many adapters raise). With 4 a batch, 16 slots
# for 32 Zipf-popular adapters are all busy at 0.9x the fleet's compute (~15.5 in use on average
# behind `lb`, one seed in the simulator): the slots, not the GPUs, bound what any router serves.
MAX_LORAS = 8


def adapter_name(k: int) -> str:
    return f"lora-{k}"


class Draw(NamedTuple):
    """One request's shape: when, which adapter (and its system prompt), its question's tokens,
    its answer's."""
    i: int
    at: float
    adapter: int
    question_tokens: int
    answer_tokens: int


@dataclass
class MultiLora:
    seed: int = 0
    total_rps: float = 1.0
    adapters: int = 32
    system_min_tokens: int = 300
    system_max_tokens: int = 900
    question_median: int = 150
    answer_median: int = 150
    name: str = "multi-lora"

    def __post_init__(self) -> None:
        require_whole(self, "adapters", "system_min_tokens", "system_max_tokens", "question_median", "answer_median")
        require_positive(self, "total_rps", "adapters", "system_min_tokens", "question_median", "answer_median")
        if self.system_max_tokens < self.system_min_tokens:
            raise ValueError("multi-lora: system_max_tokens must be >= system_min_tokens "
                             f"(got {self.system_max_tokens} < {self.system_min_tokens})")

    def system_lengths(self) -> list[int]:
        """The adapters' system prompts' lengths: the same for every seed (a fleet serves fixed adapters)."""
        return fixed_lengths("multi-lora", self.adapters, self.system_min_tokens, self.system_max_tokens)

    def draws(self) -> Iterator[Draw]:
        """The requests' shapes, in arrival order, without end."""
        popularity = [1.0 / rank for rank in range(1, self.adapters + 1)]
        rng = rng_for(self.seed, "multi-lora")
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(self.total_rps)
            adapter = rng.choices(range(self.adapters), popularity)[0]
            question = lognormal_tokens(rng, self.question_median, QUESTION_SIGMA, MIN_QUESTION, MAX_QUESTION)
            answer = lognormal_tokens(rng, self.answer_median, ANSWER_SIGMA, MIN_ANSWER, MAX_ANSWER)
            yield Draw(i, t, adapter, question, answer)
            i += 1

    def arrivals(self) -> Iterator[RequestSpec]:
        systems = self.system_lengths()
        for d in self.draws():
            yield RequestSpec(
                request_id=f"lora-{self.seed}-{d.i}",
                messages=[{"role": "system", "content": pseudo_text(f"multi-lora-system/{d.adapter}", systems[d.adapter])},
                          {"role": "user", "content": pseudo_text(f"multi-lora-question/{self.seed}/{d.i}", d.question_tokens)}],
                max_tokens=d.answer_tokens, user=f"lora-{d.i % 64}", at=d.at, adapter=adapter_name(d.adapter),
                meta={"adapter": d.adapter})
