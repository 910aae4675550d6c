"""Routing policies: which available target gets this request.

Composed llm-d style from small parts instead of subclass towers:
  filters  narrow the candidates (power-of-two samples two),
  scorers  give each candidate a score (higher wins; several scorers compare
           lexicographically, the first decides and the next breaks its ties),
  picker   takes a best-scored candidate, breaking remaining ties with a seeded RNG, never
           by list order, so LBs with the same stale view do not herd onto one target.
Candidates are already available and serve the model (see `lb.core.pushing`); a policy only
ranks them. `observe` feeds dispatch decisions back (trie inserts), `forget` drops a target.
"""
from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence

from lb.core.predicted import DEFAULT_OTHERS_WEIGHT, PredictedTtftScorer
from lb.core.prefix import DEFAULT_BLOCK_CHARS, DEFAULT_MAX_NODES, PrefixTrie, TrieMemory, request_chain
from lb.core.ring import DEFAULT_VNODES, HashRing
from lb.core.types import Decision, Policy, PrefixMemory, ReplicaView, RequestFacts

DEFAULT_POLICY = "predicted-ttft"


def load(view: ReplicaView) -> int:
    """Requests on a target as best the LB knows.

    The engine's own counts (pending + running at the last probe, plus what we pushed since)
    also see other clients of the replica, e.g. a second LB; our outstanding count is always
    fresh but sees only us. Both undercount in their own way, so take the larger.
    """
    if not view.reports_pending:
        return view.outstanding
    return max(view.outstanding, view.pending + view.running + view.pushed_since_probe)


class PolicyBase:
    """No-op defaults for every hook of `lb.core.types.Policy`; a policy overrides what it uses."""

    name = "base"

    def __init__(self) -> None:
        self.last = Decision(None, "none")

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None:
        pass

    def served(self, req: RequestFacts, target_id: str, ttft_s: float | None, e2e_s: float | None,
               output_tokens: int, now: float) -> None:
        pass

    def register(self, target_id: str) -> None:
        pass

    def forget(self, target_id: str) -> None:
        pass

    @property
    def prefix_memory(self) -> PrefixMemory | None:
        return None

    @property
    def load_tracker(self):
        return None


def pick_best(candidates: Sequence[ReplicaView], scores: Sequence | Callable[[ReplicaView], object], rng: random.Random) -> ReplicaView | None:
    """The candidate with the highest score (a list aligned with `candidates`, or a function
    of a candidate); equal scores are broken by `rng`."""
    if not candidates:
        return None
    if callable(scores):
        scores = [scores(view) for view in candidates]
    best = max(scores)
    tied = [view for view, score in zip(candidates, scores) if score == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class Part:
    """A filter or scorer; stateful ones learn from dispatches and forget removed targets."""

    def chosen(self, decision: Decision) -> None:
        """The picker chose `decision.target`: make the explanation about that target."""

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None:
        pass

    def served(self, req: RequestFacts, target_id: str, ttft_s: float | None, e2e_s: float | None,
               output_tokens: int, now: float) -> None:
        pass

    def forget(self, target_id: str) -> None:
        pass


class SampleFilter(Part):
    """Keep `n` candidates drawn at random (power of two choices)."""

    def __init__(self, n: int, rng: random.Random):
        self.n, self.rng = n, rng

    def filter(self, req: RequestFacts, candidates: list[ReplicaView], now: float) -> list[ReplicaView]:
        return candidates if len(candidates) <= self.n else self.rng.sample(candidates, self.n)


class LoadScorer(Part):
    def score(self, req: RequestFacts, candidates: list[ReplicaView], now: float, decision: Decision) -> list[int]:
        return [-load(view) for view in candidates]


class SpeedLoadScorer(Part):
    """Least load, weighted by each replica's speed as learned from its answers: score
    −(load + 1) × (its step ÷ the candidates' typical step), so with equal loads the faster
    replica wins, and a 2× slower one is chosen over a fast one only when the fast one
    carries about twice its work. Replicas differ in hardware and engines; nothing here
    depends on a profile's constants.

    A replica's speed is the floor of its inter-token times ((e2e − TTFT) / (output − 1) per
    answer): the fastest step it showed recently, which is its hardware's pace at a light
    batch; the batch's own effect is already in `load`, and an average would count it twice.
    The floor drifts up 1 % per answer, so a replica that became slower is seen within ~100
    answers. Speeds within a factor of 1.5 of the typical count as equal: identical replicas'
    floors differ by noise, and acting on it unbalanced homogeneous fleets in the simulator
    (bursty at 1.1× capacity, p90 1,918 → 2,126 ms with no dead band). Without samples it is
    plain least load. Measured (`sim-compare heterogeneous`, 5 seeds, lb default): TTFT p90
    −9 to −15 % at 0.7-1.1× capacity, throughput level or +4 %; tot, mixed-tree, multiturn,
    bursty and regions unchanged within the seeds (docs/results.md)."""

    DRIFT = 1.01  # the floor's rise per answer
    BAND = 1.5  # speeds within this factor of the typical count as equal

    def __init__(self) -> None:
        self.floor: dict[str, float] = {}  # target → its fastest recent inter-token time, s

    def score(self, req: RequestFacts, candidates: list[ReplicaView], now: float, decision: Decision) -> list:
        known = sorted(self.floor[v.id] for v in candidates if v.id in self.floor)
        if not known:
            return [-load(view) for view in candidates]
        typical = known[len(known) // 2]

        def pace(view: ReplicaView) -> float:
            f = self.floor.get(view.id, typical) / typical
            return 1.0 if 1 / self.BAND < f < self.BAND else f

        return [-(load(view) + 1) * pace(view) for view in candidates]

    def served(self, req: RequestFacts, target_id: str, ttft_s: float | None, e2e_s: float | None,
               output_tokens: int, now: float) -> None:
        if ttft_s is None or e2e_s is None or output_tokens < 2 or e2e_s <= ttft_s:
            return
        step = (e2e_s - ttft_s) / (output_tokens - 1)
        old = self.floor.get(target_id)
        self.floor[target_id] = step if old is None else min(old * self.DRIFT, step)

    def forget(self, target_id: str) -> None:
        self.floor.pop(target_id, None)


class PrefixScorer(Part, TrieMemory):
    """Longest prefix match among *available* targets (SkyWalker); below `min_match_ratio`
    of the prompt every candidate scores 0 and the next scorer (load) decides."""

    def __init__(self, trie: PrefixTrie, *, min_match_ratio: float, block_chars: int, isolate_tenants: bool):
        self.trie = trie
        self.min_match_ratio = min_match_ratio
        self.block_chars = block_chars
        self.isolate_tenants = isolate_tenants
        # the last `score`'s chain, and the candidates holding its longest match
        self._chain, self._holding = (), set()

    def score(self, req: RequestFacts, candidates: list[ReplicaView], now: float, decision: Decision) -> list[int]:
        chain = request_chain(req, self.block_chars, self.isolate_tenants)
        depth, holders = self.trie.match(chain, {view.id for view in candidates})
        decision.matched_blocks, decision.total_blocks, decision.best_blocks = depth, len(chain), depth
        self._chain, self._holding = chain, (holding := set(holders))
        if not chain or depth / len(chain) < self.min_match_ratio:
            return [0] * len(candidates)
        decision.reason = "prefix"
        return [depth if view.id in holding else 0 for view in candidates]

    def chosen(self, decision: Decision) -> None:
        """The explanation names the chosen target's own match (what it will not recompute):
        a load tie-break may pick a target holding less than the longest match, or none."""
        if decision.target not in self._holding:
            decision.matched_blocks = self.trie.match(self._chain, {decision.target})[0] if self._chain else 0

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None:
        self.trie.insert(request_chain(req, self.block_chars, self.isolate_tenants), target_id, now)

    def forget(self, target_id: str) -> None:
        self.trie.forget(target_id)


class ComposedPolicy(PolicyBase):
    """filters → scorers → random-tie picker."""

    def __init__(self, name: str, *, filters: Sequence[SampleFilter] = (), scorers: Sequence[Part], rng: random.Random, default_reason: str = "load"):
        super().__init__()
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.rng = rng
        self.default_reason = default_reason
        self.last = Decision(None, "none")

    def choose(self, req: RequestFacts, candidates: Sequence[ReplicaView], now: float) -> str | None:
        decision = Decision(None, self.default_reason)
        cands = list(candidates)
        for f in self.filters:
            cands = f.filter(req, cands, now)
        if cands:
            per_scorer = [s.score(req, cands, now, decision) for s in self.scorers]
            scores = per_scorer[0] if len(per_scorer) == 1 else list(zip(*per_scorer))
            decision.target = pick_best(cands, scores, self.rng).id
            for s in self.scorers:
                s.chosen(decision)
        else:
            decision.reason = "none"
        self.last = decision
        return decision.target

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None:
        for part in (*self.filters, *self.scorers):
            part.observe(req, target_id, now)

    def served(self, req: RequestFacts, target_id: str, ttft_s: float | None, e2e_s: float | None,
               output_tokens: int, now: float) -> None:
        for part in (*self.filters, *self.scorers):
            part.served(req, target_id, ttft_s, e2e_s, output_tokens, now)

    def forget(self, target_id: str) -> None:
        for part in (*self.filters, *self.scorers):
            part.forget(target_id)

    @property
    def prefix_memory(self) -> PrefixScorer | PredictedTtftScorer | None:
        """What cache-affine scheduling (lb.core.affinity) asks about prefixes, if this policy remembers them."""
        return next((s for s in self.scorers if isinstance(s, (PrefixScorer, PredictedTtftScorer))), None)


class RoundRobin(PolicyBase):
    """Cycle through candidate ids in sorted order, resuming after the last one chosen."""

    name = "round-robin"

    def __init__(self, *, rng: random.Random):
        super().__init__()
        self._last: str | None = None

    def choose(self, req: RequestFacts, candidates: Sequence[ReplicaView], now: float) -> str | None:
        ids = sorted(view.id for view in candidates)
        if not ids:
            target = None
        elif self._last is None:
            target = ids[0]
        else:
            target = next((i for i in ids if i > self._last), ids[0])
        if target is not None:
            self._last = target
        self.last = Decision(target, "round-robin" if target else "none")
        return target


class ConsistentHash(PolicyBase):
    """SkyWalker-CH: the request's affinity key (session, else user) picks a ring position;
    walk clockwise to the first available target. Every target ever seen stays on the ring
    until forgotten, so a target that is only briefly full keeps its keys."""

    name = "consistent-hash"

    def __init__(self, *, rng: random.Random, vnodes: int = DEFAULT_VNODES):
        super().__init__()
        self.ring = HashRing(vnodes)

    def register(self, target_id: str) -> None:
        self.ring.add(target_id)

    def choose(self, req: RequestFacts, candidates: Sequence[ReplicaView], now: float) -> str | None:
        ids = set()
        for view in candidates:
            ids.add(view.id)
            if view.id not in self.ring:
                self.ring.add(view.id)
        target = self.ring.owner(req.affinity_key, ids) if ids else None
        self.last = Decision(target, "ring" if target else "none")
        return target

    def forget(self, target_id: str) -> None:
        self.ring.remove(target_id)


class CacheAware(PolicyBase):
    """SGLang Router's cache_aware policy, as a baseline inside the same daemon.

    If load is imbalanced (max - min > balance_abs and max > balance_rel * min, on the
    router's own in-flight counts) take the least loaded. Otherwise take the target with
    the longest prefix match over *all* targets it has sent to, if the match ratio exceeds
    cache_threshold, else the target with the smallest tree (most free cache). Unlike
    prefix-trie it does not look for the best *available* match: when the best match is not
    a candidate it falls to the smallest-tree branch, as SGLang falls back when its pick is
    unusable. Tree: block hashes instead of SGLang's characters, same LRU size bound.
    """

    name = "cache-aware"

    def __init__(
        self,
        *,
        rng: random.Random,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        max_nodes: int = DEFAULT_MAX_NODES,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        isolate_tenants: bool = False,
    ):
        super().__init__()
        self.rng = rng
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.block_chars = block_chars
        self.isolate_tenants = isolate_tenants
        self.trie = PrefixTrie(max_nodes)

    def imbalanced(self, candidates: Sequence[ReplicaView]) -> bool:
        loads = [view.outstanding for view in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def choose(self, req: RequestFacts, candidates: Sequence[ReplicaView], now: float) -> str | None:
        self.last = decision = Decision(None, "none")
        if not candidates:
            return None
        if self.imbalanced(candidates):
            decision.reason = "imbalance"
            decision.target = pick_best(candidates, [-view.outstanding for view in candidates], self.rng).id
            return decision.target
        chain = request_chain(req, self.block_chars, self.isolate_tenants)
        depth, holders = self.trie.match(chain)
        decision.matched_blocks, decision.total_blocks, decision.best_blocks = depth, len(chain), depth
        if chain and depth / len(chain) > self.cache_threshold:
            holding = set(holders)
            hits = [view for view in candidates if view.id in holding]
            if hits:
                decision.reason = "cache"
                decision.target = pick_best(hits, [-view.outstanding for view in hits], self.rng).id
                return decision.target
        decision.reason = "smallest-tree"
        size = self.trie.size_of
        decision.target = pick_best(candidates, [(-size(view.id), -view.outstanding) for view in candidates], self.rng).id
        return decision.target

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None:
        self.trie.insert(request_chain(req, self.block_chars, self.isolate_tenants), target_id, now)

    def forget(self, target_id: str) -> None:
        self.trie.forget(target_id)


# SGLang Router's cache_threshold default, so prefix-trie and cache-aware differ only in
# what the comparison is about: available-only matching and how load is weighed.
DEFAULT_MIN_MATCH_RATIO = 0.3


def prefix_trie(
    *,
    rng: random.Random,
    min_match_ratio: float = DEFAULT_MIN_MATCH_RATIO,
    max_nodes: int = DEFAULT_MAX_NODES,
    block_chars: int = DEFAULT_BLOCK_CHARS,
    isolate_tenants: bool = False,
) -> ComposedPolicy:
    """SkyWalker: longest available prefix match; least load, weighted by each replica's
    learned speed, breaks ties and weak matches."""
    scorer = PrefixScorer(PrefixTrie(max_nodes), min_match_ratio=min_match_ratio, block_chars=block_chars, isolate_tenants=isolate_tenants)
    return ComposedPolicy("prefix-trie", scorers=[scorer, SpeedLoadScorer()], rng=rng)


def predicted_ttft(
    *,
    rng: random.Random,
    max_nodes: int = DEFAULT_MAX_NODES,
    block_chars: int = DEFAULT_BLOCK_CHARS,
    isolate_tenants: bool = False,
    others_weight: float = DEFAULT_OTHERS_WEIGHT,
) -> ComposedPolicy:
    """Least predicted TTFT (lb/core/predicted.py): queued work plus uncached prefill at each
    replica's learned rates; least load breaks ties."""
    if isinstance(others_weight, bool) or not isinstance(others_weight, (int, float)) or not 0 <= others_weight < math.inf:
        raise ValueError(f"others_weight must be a number >= 0 (got {others_weight!r}); "
                         f"the default is {DEFAULT_OTHERS_WEIGHT}, 0 ignores the running batch")
    scorer = PredictedTtftScorer(PrefixTrie(max_nodes), block_chars=block_chars, isolate_tenants=isolate_tenants,
                                 others_weight=others_weight)
    return ComposedPolicy("predicted-ttft", scorers=[scorer, LoadScorer()], rng=rng, default_reason="predicted")


def least_load(*, rng: random.Random) -> ComposedPolicy:
    return ComposedPolicy("least-load", scorers=[LoadScorer()], rng=rng)


def power_of_two(*, rng: random.Random) -> ComposedPolicy:
    return ComposedPolicy("power-of-two", filters=[SampleFilter(2, rng)], scorers=[LoadScorer()], rng=rng)


def load_aware(rng: random.Random, kv_capacity_tokens: int = 100_000, beta: float = 8.0,
               lookahead: int = 64) -> Policy:
    """PreServe's anticipated-load routing (lb/core/anticipator.py)."""
    from lb.core.anticipator import LoadAwarePolicy
    return LoadAwarePolicy(kv_capacity_tokens=kv_capacity_tokens, beta=beta, lookahead=lookahead, rng=rng)


POLICIES: dict[str, Callable[..., Policy]] = {
    "prefix-trie": prefix_trie,
    "predicted-ttft": predicted_ttft,
    "consistent-hash": ConsistentHash,
    "round-robin": RoundRobin,
    "least-load": least_load,
    "power-of-two": power_of_two,
    "cache-aware": CacheAware,
    "load-aware": load_aware,
}


def policy_options(name: str) -> dict[str, object]:
    """The options `make_policy(name, ...)` accepts, with their defaults."""
    params = inspect.signature(POLICIES[name]).parameters
    return {k: p.default for k, p in params.items() if k != "rng"}


def make_policy(name: str, *, seed: int = 0, **options) -> Policy:
    """Build a policy by config name; unknown names or options fail naming the valid ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    known = policy_options(name)
    for key in options:
        if key not in known:
            valid = ", ".join(sorted(known)) or "none"
            raise ValueError(f"policy {name!r} has no option {key!r}; valid options: {valid}")
    return POLICIES[name](rng=random.Random(seed), **options)
