"""Response-length prediction learned online from completed requests (PreServe §4.3).

Features are what the LB already has for free: the application, the interaction stage and
the prompt length (log2 bucket). For each combination a small quantile sketch of observed
output tokens is kept; a prediction backs off from the most specific combination with
enough samples to coarser ones (app+stage+bucket → app+stage → app → bucket → everything)
and is clamped by the request's `max_tokens`.

Why not a downloaded model (a BERT/OPT length regressor as in PreServe or S3): the LB must
decide in microseconds on a CPU shared with the proxy, may not fetch weights, and sees
every completion of exactly the traffic it routes — per-app distributions learned online
capture most of the predictable variance (output length depends far more on the
application and its prompt template than on wording), adapt to drift by themselves, and
cost a dictionary lookup. On the Azure conversation trace (10,108 requests, learned online,
scored from request 500 on) the prompt-length buckets alone bring the mean absolute error
of the median prediction to 60 tokens, against 141 for the global median. Mistakes are corrected later anyway: the anticipator refines a
request's prediction once it outlives it (PreServe §4.3.1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from lb.core.types import RequestFacts


@dataclass
class QuantileSketch:
    """Log-bucketed histogram (relative error ≈ (γ−1)/2) with exponential forgetting:
    when the weight passes `max_weight` all counts halve, so recent behaviour dominates."""

    gamma: float = 1.08
    max_weight: float = 4096.0
    counts: dict[int, float] = field(default_factory=dict)
    weight: float = 0.0
    total: float = 0.0  # weighted sum of values, for the mean

    def add(self, value: float) -> None:
        b = int(math.log1p(max(0.0, value)) / math.log(self.gamma))
        self.counts[b] = self.counts.get(b, 0.0) + 1.0
        self.weight += 1.0
        self.total += value
        if self.weight > self.max_weight:
            self.counts = {k: v / 2 for k, v in self.counts.items() if v > 0.5}
            self.weight = sum(self.counts.values())
            self.total /= 2

    def quantile(self, q: float) -> float:
        if not self.counts:
            return 0.0
        rank, seen = q * self.weight, 0.0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                return math.expm1((b + 0.5) * math.log(self.gamma))
        return math.expm1((max(self.counts) + 0.5) * math.log(self.gamma))

    def mean(self) -> float:
        return self.total / self.weight if self.weight else 0.0

    def mean_above(self, floor: float) -> float | None:
        """E[X | X > floor] from the sketch: what a request that outlived `floor` will reach."""
        fb = int(math.log1p(max(0.0, floor)) / math.log(self.gamma))
        mass = [(b, c) for b, c in self.counts.items() if b > fb]
        w = sum(c for _, c in mass)
        if not w:
            return None
        return sum(math.expm1((b + 0.5) * math.log(self.gamma)) * c for b, c in mass) / w


@dataclass(frozen=True)
class LengthPrediction:
    expected: float  # mean output tokens
    p50: float
    p90: float
    level: str  # which feature combination answered ("prior" when nothing learned yet)


def prompt_bucket(prompt_tokens: int) -> int:
    return min(20, int(math.log2(max(1, prompt_tokens))))


def _cap(facts: RequestFacts) -> float:
    """What the request's max_tokens allows (no cap when it declares none)."""
    return float(facts.max_tokens) if facts.max_tokens else math.inf


class LengthModel:
    """Online output-length predictor keyed on cheap request features."""

    def __init__(self, prior_tokens: float = 256.0, min_samples: int = 16):
        self.prior_tokens = prior_tokens
        self.min_samples = min_samples
        self.sketches: dict[tuple, QuantileSketch] = {}

    @staticmethod
    def _levels(facts: RequestFacts) -> list[tuple]:
        pb = prompt_bucket(facts.prompt_tokens)
        levels = []
        if facts.app is not None:
            stage = facts.interaction_stage
            levels += [("app+stage+len", facts.app, stage, pb), ("app+stage", facts.app, stage),
                       ("app", facts.app)]
        return levels + [("len", pb), ("all",)]

    def observe(self, facts: RequestFacts, output_tokens: int) -> None:
        for key in self._levels(facts):
            self.sketches.setdefault(key, QuantileSketch()).add(float(output_tokens))

    def sketch_for(self, facts: RequestFacts) -> tuple[str, QuantileSketch | None]:
        for key in self._levels(facts):
            sk = self.sketches.get(key)
            if sk is not None and sk.weight >= self.min_samples:
                return key[0], sk
        return "prior", None

    def predict(self, facts: RequestFacts) -> LengthPrediction:
        level, sk = self.sketch_for(facts)
        cap = _cap(facts)
        if sk is None:
            guess = min(self.prior_tokens, cap)
            return LengthPrediction(guess, guess, guess, level)
        return LengthPrediction(min(sk.mean(), cap), min(sk.quantile(0.5), cap),
                                min(sk.quantile(0.9), cap), level)

    def expected(self, facts: RequestFacts) -> float:
        """`predict(facts).expected` alone, without the quantiles' sort (a scheduling pass asks)."""
        _, sk = self.sketch_for(facts)
        cap = _cap(facts)
        return min(sk.mean() if sk is not None else self.prior_tokens, cap)

    def refine(self, facts: RequestFacts, generated: int) -> float:
        """A new total-length guess for a request that has already produced `generated`
        tokens, at or past its prediction: the learned mean of lengths beyond that point."""
        _, sk = self.sketch_for(facts)
        cap = _cap(facts)
        beyond = sk.mean_above(generated) if sk is not None else None
        guess = beyond if beyond is not None else generated * 1.5 + 16
        return max(generated + 1.0, min(guess, cap))
