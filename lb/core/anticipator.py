"""Per-replica load anticipation and the `load-aware` routing policy (PreServe §4.3).

A `ReplicaLoad` tracks the requests the LB sent to one replica with their predicted total
output lengths and builds a look-ahead map: the KV fraction the replica will hold at each
of the next l decode iterations, as running requests grow by one token per iteration and
free their KV when they reach their predicted length.

Error refinement (§4.3.1): a prediction is only a guess. When a request reaches its
predicted length and is still generating, its prediction is replaced by what requests that
ran this long went on to produce (the length model's E[L | L > generated]), so an
under-predicted request does not vanish from the map while it still holds KV.

`LoadAwarePolicy` routes to the candidate with the least anticipated work: queued prefill
tokens + remaining decode tokens + β·(peak tokens by which the look-ahead KV would overflow
with the new request: what a preemption would discard and recompute). It follows the Policy protocol of `lb.core.types`; the daemon and the
simulator also call `on_progress` (tokens generated so far) and `on_complete`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from lb.core.length_model import LengthModel
from lb.core.policies import PolicyBase
from lb.core.types import Decision, ReplicaView, RequestFacts


@dataclass
class Tracked:
    facts: RequestFacts
    prompt_tokens: int
    predicted: float  # predicted total output tokens (refined upward as needed)
    generated: int = 0
    refinements: int = 0


@dataclass
class ReplicaLoad:
    capacity_tokens: int
    requests: dict[str, Tracked] = field(default_factory=dict)
    # bound on tracked requests: a caller that misses completions cannot grow this forever
    max_tracked: int = 4096

    def add(self, facts: RequestFacts, predicted: float) -> None:
        self.requests[facts.request_id] = Tracked(facts, max(0, facts.prompt_tokens), max(1.0, predicted))
        while len(self.requests) > self.max_tracked:
            del self.requests[next(iter(self.requests))]  # oldest first

    def progress(self, request_id: str, generated: int, model: LengthModel | None = None) -> None:
        t = self.requests.get(request_id)
        if t is None:
            return
        t.generated = max(t.generated, generated)
        if t.generated >= t.predicted:
            t.predicted = (model.refine(t.facts, t.generated) if model is not None
                           else t.generated * 1.5 + 16)
            t.refinements += 1

    def remove(self, request_id: str) -> Tracked | None:
        return self.requests.pop(request_id, None)

    def kv_tokens(self) -> int:
        return sum(t.prompt_tokens + t.generated for t in self.requests.values())

    def queued_prefill(self) -> int:
        """Prompt tokens of requests that have not produced a token yet."""
        return sum(t.prompt_tokens for t in self.requests.values() if t.generated == 0)

    def remaining_decode(self) -> float:
        return sum(max(0.0, t.predicted - t.generated) for t in self.requests.values())

    def lookahead_tokens(self, iterations: int, extra: Sequence[tuple[int, float]] = ()) -> list[float]:
        """KV tokens held at each of the next `iterations` steps; `extra` adds hypothetical
        (prompt_tokens, predicted_output) requests starting now."""
        held = [(t.prompt_tokens + t.generated, t.predicted - t.generated) for t in self.requests.values()]
        held += [(p, d) for p, d in extra]
        out = []
        for i in range(1, iterations + 1):
            out.append(float(sum(kv + i for kv, left in held if i < left)))
        return out

    def lookahead(self, iterations: int) -> tuple[float, ...]:
        """Anticipated KV fraction at each of the next `iterations` steps (for the scaler)."""
        return tuple(v / self.capacity_tokens for v in self.lookahead_tokens(iterations))


class LoadAwarePolicy(PolicyBase):
    """Route to the least anticipated load: queued prefill + decode + β·overflow (tokens)."""

    name = "load-aware"

    def __init__(self, kv_capacity_tokens: int = 100_000, beta: float = 8.0, lookahead: int = 64,
                 length_model: LengthModel | None = None, capacities: dict[str, int] | None = None,
                 seed: int = 0, rng: random.Random | None = None):
        super().__init__()
        self.default_capacity = kv_capacity_tokens
        self.capacities = dict(capacities or {})
        self.beta = beta
        self.iterations = lookahead
        self.length_model = length_model or LengthModel()
        self.loads: dict[str, ReplicaLoad] = {}
        self.where: dict[str, str] = {}  # request id → target id
        self.rng = rng or random.Random(seed)

    def load(self, target_id: str) -> ReplicaLoad:
        if target_id not in self.loads:
            self.loads[target_id] = ReplicaLoad(self.capacities.get(target_id, self.default_capacity))
        return self.loads[target_id]

    def score(self, req: RequestFacts, view: ReplicaView) -> float:
        load = self.load(view.id)
        predicted = self.length_model.predict(req).expected
        # KV the engine reports beyond what this LB tracks (another LB's requests, caches)
        untracked = max(0.0, view.kv_usage * load.capacity_tokens - load.kv_tokens())
        future = load.lookahead_tokens(self.iterations, [(req.prompt_tokens, predicted)])
        # the peak overflow: tokens a preemption would throw away and recompute
        overflow = max([0.0, *(v + untracked - load.capacity_tokens for v in future)])
        return load.queued_prefill() + req.prompt_tokens + load.remaining_decode() + self.beta * overflow

    def choose(self, req: RequestFacts, candidates: Sequence[ReplicaView], now: float) -> str | None:
        if not candidates:
            return None
        scored = [(self.score(req, c), c.id) for c in candidates]
        best = min(s for s, _ in scored)
        target = self.rng.choice([cid for s, cid in scored if s <= best + 1e-9])
        self.last = Decision(target, "anticipated")
        return target

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None:
        self.load(target_id).add(req, self.length_model.predict(req).expected)
        self.where[req.request_id] = target_id

    def on_progress(self, request_id: str, generated: int, now: float) -> None:
        target = self.where.get(request_id)
        if target in self.loads:
            self.loads[target].progress(request_id, generated, self.length_model)

    def on_complete(self, request_id: str, output_tokens: int, now: float) -> None:
        target = self.where.pop(request_id, None)
        tracked = self.loads[target].remove(request_id) if target in self.loads else None
        if tracked is not None:
            self.length_model.observe(tracked.facts, output_tokens)

    def on_abort(self, request_id: str, now: float) -> None:
        """The request ended without a usable length (failed, cancelled): stop tracking it,
        learn nothing from it."""
        target = self.where.pop(request_id, None)
        if target in self.loads:
            self.loads[target].remove(request_id)

    def forget(self, target_id: str) -> None:
        load = self.loads.pop(target_id, None)
        for rid in (load.requests if load else ()):
            self.where.pop(rid, None)

    @property
    def load_tracker(self) -> "LoadAwarePolicy":
        return self

    def anticipated_kv(self, target_ids: Sequence[str]) -> tuple[tuple[float, ...], ...]:
        """The look-ahead map of each target, for `ScalingSignals.anticipated_kv`."""
        return tuple(self.load(t).lookahead(self.iterations) for t in target_ids)
