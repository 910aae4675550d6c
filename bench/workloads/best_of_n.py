"""`best-of-n`: chat beside parallel sampling (the API's `n`), open loop.

One of `apps` system prompts (fixed lengths of `system_min_tokens`-`system_max_tokens`,
Zipf-popular: weight 1/rank), a question of its own (lognormal, median `question_median`
tokens), and `n` answers sampled in parallel: half the requests are plain chat (n = 1), the
rest ask for 4 or 8 samples, as a best-of-n reranker, a verifier or self-consistency voting
does (`n_weights`). Each answer is lognormal (median `answer_median` tokens). Poisson arrivals
at `total_rps`.

An engine prefills the prompt once and decodes the n answers side by side, each a request in
its running and waiting counts and each holding its own KV, so a request here costs up to 8
times the decode and the KV of its neighbour with the same prompt. A router that counts
requests (in flight, or pushed since a probe) undercounts that load by n. Synthetic and held
out: added after `lb`'s policy was settled (fifty-fourth session). The simulator's `best-of-n`
workload sends the same requests (`BestOfN.draws`).

Each request's samples are given one length (the client's `min_tokens`/`ignore_eos` applies to
every sample alike); real samples of one prompt end at different lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

from bench.workloads.base import (RequestSpec, fixed_lengths, lognormal_tokens, pseudo_text, require_positive,
                                  require_whole, rng_for)

QUESTION_SIGMA, ANSWER_SIGMA = 0.6, 0.6
MIN_QUESTION, MAX_QUESTION, MIN_ANSWER, MAX_ANSWER = 16, 1000, 16, 1024
N_CHOICES = (1, 4, 8)


class Draw(NamedTuple):
    """One request's shape: when, which app's system prompt, its question's tokens, its samples and
    their length."""
    i: int
    at: float
    system: int
    question_tokens: int
    samples: int
    answer_tokens: int


@dataclass
class BestOfN:
    seed: int = 0
    total_rps: float = 1.0
    apps: int = 16
    system_min_tokens: int = 400
    system_max_tokens: int = 1600
    question_median: int = 200
    answer_median: int = 200
    # the share of requests asking for 1, 4 and 8 samples
    n_weights: tuple[float, float, float] = (0.5, 0.3, 0.2)
    name: str = "best-of-n"

    def __post_init__(self) -> None:
        require_whole(self, "apps", "system_min_tokens", "system_max_tokens", "question_median", "answer_median")
        require_positive(self, "total_rps", "apps", "system_min_tokens", "question_median", "answer_median")
        if self.system_max_tokens < self.system_min_tokens:
            raise ValueError("best-of-n: system_max_tokens must be >= system_min_tokens "
                             f"(got {self.system_max_tokens} < {self.system_min_tokens})")
        weights = tuple(self.n_weights) if isinstance(self.n_weights, (list, tuple)) else ()
        if (len(weights) != len(N_CHOICES) or not all(isinstance(w, (int, float)) and w >= 0 for w in weights)
                or not sum(weights) > 0):
            raise ValueError(f"best-of-n: n_weights must be {len(N_CHOICES)} shares >= 0 (for n = "
                             f"{', '.join(map(str, N_CHOICES))}) that are not all 0 (got {self.n_weights!r})")

    def system_lengths(self) -> list[int]:
        """The apps' system prompts' lengths: the same for every seed (a fleet serves fixed apps)."""
        return fixed_lengths("best-of-n", self.apps, self.system_min_tokens, self.system_max_tokens)

    def mean_samples(self) -> float:
        weights = tuple(self.n_weights)
        return sum(n * w for n, w in zip(N_CHOICES, weights)) / sum(weights)

    def draws(self) -> Iterator[Draw]:
        """The requests' shapes, in arrival order, without end."""
        popularity = [1.0 / rank for rank in range(1, self.apps + 1)]
        rng = rng_for(self.seed, "best-of-n")
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(self.total_rps)
            app = rng.choices(range(self.apps), popularity)[0]
            question = lognormal_tokens(rng, self.question_median, QUESTION_SIGMA, MIN_QUESTION, MAX_QUESTION)
            samples = rng.choices(N_CHOICES, self.n_weights)[0]
            answer = lognormal_tokens(rng, self.answer_median, ANSWER_SIGMA, MIN_ANSWER, MAX_ANSWER)
            yield Draw(i, t, app, question, samples, answer)
            i += 1

    def arrivals(self) -> Iterator[RequestSpec]:
        systems = self.system_lengths()
        for d in self.draws():
            yield RequestSpec(
                request_id=f"bon-{self.seed}-{d.i}",
                messages=[{"role": "system", "content": pseudo_text(f"best-of-n-system/{d.system}", systems[d.system])},
                          {"role": "user", "content": pseudo_text(f"best-of-n-question/{self.seed}/{d.i}", d.question_tokens)}],
                max_tokens=d.answer_tokens, n=d.samples, user=f"bon-{d.i % 64}", at=d.at,
                meta={"system": d.system, "samples": d.samples})
