"""`reasoning`: a reasoning model's traffic, open loop and decode-bound.

One of `system_prompts` system prompts (fixed lengths of `system_min_tokens`-`system_max_tokens`,
Zipf-popular: weight 1/rank), a question of its own (lognormal, median `question_median`
tokens), then a long answer of heavy-tailed length (lognormal, median `answer_median` tokens,
sigma 0.9: mean ~1,010, one in a hundred past 5,600), prompt and answer kept inside `context`;
Poisson arrivals at `total_rps`. Every other workload's answers are 64-256 tokens; here the
answer, not the prompt, fills the KV, no prefix is worth much, and how long a request will run
is unknown when it is placed. Synthetic, and held out: added after `lb`'s policy was settled.
The simulator's `reasoning` workload sends the same requests (`Reasoning.draws`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

from bench.workloads.base import (RequestSpec, fixed_lengths, lognormal_tokens, pseudo_text, require_positive,
                                  require_whole, rng_for)

QUESTION_SIGMA, ANSWER_SIGMA = 0.8, 0.9
MIN_QUESTION, MAX_QUESTION, MIN_ANSWER = 16, 1500, 32


class Draw(NamedTuple):
    """One request's shape: when, which system prompt, and its question's and answer's tokens."""
    i: int
    at: float
    system: int
    question_tokens: int
    answer_tokens: int


@dataclass
class Reasoning:
    seed: int = 0
    total_rps: float = 1.0
    system_prompts: int = 8
    system_min_tokens: int = 200
    system_max_tokens: int = 1200
    question_median: int = 150
    answer_median: int = 700
    context: int = 8192  # an 8B model's window on an L4 (the l4-llama3-8b profile's max_model_len)
    name: str = "reasoning"

    def __post_init__(self) -> None:
        require_whole(self, "system_prompts", "system_min_tokens", "system_max_tokens", "question_median", "answer_median",
                      "context")
        require_positive(self, "total_rps", "system_prompts", "system_min_tokens", "question_median", "answer_median")
        if self.system_max_tokens < self.system_min_tokens:
            raise ValueError("reasoning: system_max_tokens must be >= system_min_tokens "
                             f"(got {self.system_max_tokens} < {self.system_min_tokens})")
        if self.context < self.system_max_tokens + MAX_QUESTION + MIN_ANSWER:
            raise ValueError(f"reasoning: context must hold the longest prompt and an answer: at least "
                             f"{self.system_max_tokens + MAX_QUESTION + MIN_ANSWER} (got {self.context})")

    def system_lengths(self) -> list[int]:
        """The system prompts' lengths: the same for every seed (a fleet serves fixed applications)."""
        return fixed_lengths("reasoning", self.system_prompts, self.system_min_tokens, self.system_max_tokens)

    def draws(self) -> Iterator[Draw]:
        """The requests' shapes, in arrival order, without end."""
        systems = self.system_lengths()
        weights = [1.0 / rank for rank in range(1, self.system_prompts + 1)]
        choices = range(self.system_prompts)
        rng = rng_for(self.seed, "reasoning")
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(self.total_rps)
            k = rng.choices(choices, weights)[0]
            q = lognormal_tokens(rng, self.question_median, QUESTION_SIGMA, MIN_QUESTION, MAX_QUESTION)
            answer = lognormal_tokens(rng, self.answer_median, ANSWER_SIGMA, MIN_ANSWER, self.context - systems[k] - q)
            yield Draw(i, t, k, q, answer)
            i += 1

    def arrivals(self) -> Iterator[RequestSpec]:
        systems = self.system_lengths()
        for d in self.draws():
            yield RequestSpec(
                request_id=f"reason-{self.seed}-{d.i}",
                messages=[{"role": "system", "content": pseudo_text(f"reasoning-system/{d.system}", systems[d.system])},
                          {"role": "user", "content": pseudo_text(f"reasoning-question/{self.seed}/{d.i}", d.question_tokens)}],
                max_tokens=d.answer_tokens, user=f"reason-{d.i % 64}", at=d.at, meta={"system": d.system})
