"""Route by predicted time to first token, with each replica's rates learned online.

For each eligible replica the scorer estimates what placing the request there costs:

    cost(r) = step(r) x (1 + ratio x (ahead(r) + uncached(r) + others_weight x running(r) x uncached(r)))

the request's TTFT there plus the delay it adds to the requests already running there.

- `uncached(r)`: the prompt tokens `r` would not find cached — the prompt minus the prefix
  the trie says `r` holds (the prefix trie is the cache estimate), and minus the answer `r`
  gave right where that prefix ends when this request waited for `r` to continue it (a
  conversation's next turn held for its busy holder: `lb.core.affinity`, `PrefixTrie.answer_after`).
- `ahead(r)`: prefill work in front of it (`PredictedTtftScorer.ahead`): the uncached
  tokens of this LB's pushes to `r` with no first token back yet (a non-streamed one: until
  its predicted TTFT) (`view.prefill_ahead`, from `lb.core.backlog`: it sees requests the
  engine already runs but is still prefilling — a long prompt in chunked prefill holds every
  later one up for seconds while counting as one running request — and a tree's siblings
  waiting on their prefix's holder at their own suffix's size), plus the engine's waiting
  requests at the last probe beyond this LB's own (other clients' work, at this request's
  size: the only size the LB knows for them) and the other instances' pushes since.
- `running(r) x uncached(r)`: each running request's next token waits for this prefill,
  weighted by `others_weight` (default 0.05). `running(r)` is the last probe's count plus the
  pushes it has not seen: probes come early only when a decision waits on them
  (`Scheduler.wants_probe`), so between them the LB's own pushes are what it knows.
- `step(r)`: the replica's inter-token time, learned from its streamed responses
  ((e2e − TTFT) / (output tokens − 1)), or while it has none from its non-streamed ones
  (e2e / (output tokens + ratio x work)): the engine step a new request waits for at least
  once, longer on a replica with a bigger batch or slower hardware.
- `ratio`: prefill time per token in steps, one number for the fleet (`TtftModel`).

Nothing depends on a profile's constants: a replica with no samples yet takes the median
of the replicas that have some (a new replica is assumed typical); with no samples at all
the ranking is by token work alone. Selective pushing stays the gate: the scorer ranks only
replicas SP-P already admits. Ties (equal predictions) fall to least load.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice
from dataclasses import dataclass
from statistics import median

from lb.core.prefix import PrefixTrie, TrieMemory, request_chain, uncached_tokens
from lb.core.types import Decision, ReplicaView, RequestFacts

# EWMA weight of one sample: about the last 10 requests of a replica count, so a replica that
# slows down (a bigger batch, a noisy neighbour) is seen within a few completions.
DEFAULT_ALPHA = 0.1
# Work counted per placement until its response comes back; bounded (oldest dropped).
MAX_TRACKED = 65_536
# How much the delay a prefill adds to the running requests counts against its own TTFT.
# At 1.0 a prefix's holder keeps most siblings of a burst (the 64 leaves of a 4-branch tree
# finish their parents in one step and arrive together) while other replicas idle; at 0
# prefixes scatter. Measured in the simulator (`sim-compare`, 3 seeds x 150 s, medians;
# mixed-tree TTFT p90 ms and req/s): at 0.9x capacity 0.2 → 1,077 / 46.0, 0.1 → 931 / 46.6,
# 0.05 → 824 / 46.7; at 1.3x 1,272 / 59.3, 1,318 / 58.3, 1,091 / 59.0; at 0.5x 836, 664, 585
# (round robin 454), and 0 → 428 but −4 % throughput at 0.7x and −10 % at 0.9x (the scattered
# prefixes are recomputed). On the other six workloads 0.05 and 0.2 are level within the
# seeds. The weight was chosen over the whole suite, not one workload (docs/results.md).
# Re-checked on 2026-11-27 (sampled answers, 5 seeds x 300 s, mixed-tree p90 ms for 0.05 /
# 0.1 / 0.2): 557 / 618 / 732 at 0.5x, 936 / 1,021 / 1,051 at 0.9x, level at 1.3x; 0.2 would
# win only ToT's first 40 s from an empty fleet (21.7 against 19.4 req/s).
DEFAULT_OTHERS_WEIGHT = 0.05
# One answer may raise a replica's learned inter-token time at most this many times over. A
# replica that stalled once (a pause of the host, of its process, of the network) gave one answer
# a decode pace many times its real one; at low load the policy then sent nothing more there, so
# nothing corrected it: with sequential requests over a 4x faster and a 4x slower emulator the
# slow one took 17 of 24 after one such answer on the fast one (the tests' machine busy). A real
# slowdown still shows within a few answers (each may add up to 3x the rate, at DEFAULT_ALPHA
# +30 % an answer); a faster pace is taken as it comes.
MAX_STEP_RISE = 4.0
# Uncached prefill of the latest pushes kept per target; more than SP-P's unseen cap (64).
MAX_UNSEEN_TRACKED = 128
# A TTFT teaches the prefill ratio only if the prediction counted some work for it. A fully
# cached prompt with nothing ahead still waits for the step in flight (its excess over one
# step is not zero), and fed to the ratio (mean excess over mean work) such samples drove the
# work average to 0 and the ratio to infinity: with 120 ToT clients on 4 replicas it passed
# 70 steps per token within 150 s and overflowed by 450 s, every cost became inf or nan, and
# TTFT p90 went from ~450 ms to 1-2.7 s for the rest of the run (bench.sim.spp over 1,500 s).
MIN_WORK_TOKENS = 1.0


@dataclass
class Rates:
    """One replica's learned inter-token time: from streamed answers (EWMA; None until its
    first sample), else from answers that came back whole (`TtftModel.served`)."""

    step_s: float | None = None
    whole_step_s: float | None = None

    def step(self) -> float | None:
        return self.step_s if self.step_s is not None else self.whole_step_s


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


def _step_ewma(old: float | None, sample: float, alpha: float) -> float:
    """A replica's inter-token time after one more answer, one answer's rise bounded (MAX_STEP_RISE)."""
    return _ewma(old, sample if old is None else min(sample, MAX_STEP_RISE * old), alpha)


class TtftModel:
    """Per-replica speeds, one fleet-wide prefill ratio, and the predictions made from them
    (pure; no clock of its own).

    A replica's speed is its inter-token time `step`, a clean signal (each response averages
    it over all its tokens). Prefill per token scales with the same hardware speed, so it is
    modelled as `ratio x step`, the ratio learned from every replica's TTFTs pooled (TTFT
    beyond one step, over the prefill work the prediction counted, each in step units): one
    noisy replica cannot skew its own prefill rate, and a 2x slower replica shows it in its
    steps at once.
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA, max_tracked: int = MAX_TRACKED,
                 others_weight: float = DEFAULT_OTHERS_WEIGHT):
        self.alpha = alpha
        self.max_tracked = max_tracked
        self.others_weight = others_weight
        self.rates: dict[str, Rates] = {}
        self._excess_steps: float | None = None  # EWMA of (TTFT - step) / step
        self._work_tokens: float | None = None  # EWMA of the work counted for those
        self._work: OrderedDict[str, tuple[str, float]] = OrderedDict()  # request id → (target, work)
        self._typical: float | None = None  # the median learned step, kept until a rate changes
        self._typical_known = False

    def prefill_ratio(self) -> float:
        """Prefill time per token, in steps; 1/256 before any sample (a guess that only
        orders replicas until the first responses come back)."""
        if self._excess_steps is None or not self._work_tokens:
            return 1.0 / 256
        return self._excess_steps / self._work_tokens

    def predict(self, views: list[ReplicaView], work: list[float], uncached: list[float]) -> list[float]:
        """Predicted cost of placing the request on each view: its TTFT there for the given
        prefill work (tokens), plus (times `others_weight`) the delay its own uncached prefill
        adds to every request running there (each of their next tokens waits for it)."""
        ratio = self.prefill_ratio()
        out = []
        for view, w, u in zip(views, work, uncached):
            r = self.rates.get(view.id)
            step = r.step() if r is not None else None
            if step is None:  # a replica without samples: assumed typical
                step = self.typical_step() or 1.0
            out.append(step * (1.0 + ratio * (w + self.others_weight * (view.running + view.pushed_since_probe) * u)))
        return out

    def typical_step(self) -> float | None:
        """The median of the replicas' learned steps (None before any sample)."""
        if not self._typical_known:
            steps = [s for r in self.rates.values() if (s := r.step()) is not None]
            self._typical, self._typical_known = (median(steps) if steps else None), True
        return self._typical

    def unanswered(self, request_id: str) -> bool:
        """Placed and its response not back yet (as far as the last MAX_TRACKED placements go)."""
        return request_id in self._work

    def placed(self, request_id: str, target_id: str, work: float) -> None:
        self._work[request_id] = (target_id, work)
        while len(self._work) > self.max_tracked:
            self._work.popitem(last=False)

    def served(self, request_id: str, target_id: str, ttft_s: float | None, e2e_s: float | None,
               output_tokens: int) -> None:
        """The response to a placed request came back: learn the target's speed and the
        fleet's prefill ratio from it."""
        placed = self._work.pop(request_id, None)
        self._typical_known = False
        if ttft_s is None:
            # Answered whole (not streamed): only its end-to-end time, which the model puts at
            # step x (n + ratio x work) (TTFT, then n - 1 steps). That gives the replica's step;
            # the prefill ratio is left to streamed answers: fitted jointly from whole answers,
            # whose time is mostly decode, it came out 0-0.07 across four equal replicas and
            # all-non-streamed ToT's p90 went 335 -> 873 ms (`sim-compare --no-stream`).
            if e2e_s is not None and e2e_s > 0 and output_tokens >= 1 and placed is not None and placed[0] == target_id:
                r = self.rates.setdefault(target_id, Rates())
                sample = e2e_s / (output_tokens + self.prefill_ratio() * placed[1])
                r.whole_step_s = _step_ewma(r.whole_step_s, sample, self.alpha)
            return
        if ttft_s < 0:
            return
        r = self.rates.setdefault(target_id, Rates())
        if e2e_s is not None and output_tokens >= 2 and e2e_s > ttft_s:
            r.step_s = _step_ewma(r.step_s, (e2e_s - ttft_s) / (output_tokens - 1), self.alpha)
        if placed is not None and placed[0] == target_id and r.step_s and placed[1] >= MIN_WORK_TOKENS:
            self._excess_steps = _ewma(self._excess_steps, max(0.0, ttft_s - r.step_s) / r.step_s, self.alpha)
            self._work_tokens = _ewma(self._work_tokens, placed[1], self.alpha)

    def forget(self, target_id: str) -> None:
        self.rates.pop(target_id, None)
        self._typical_known = False


class PredictedTtftScorer(TrieMemory):  # a scorer part of lb.core.policies.ComposedPolicy
    """Scores each candidate by minus its predicted TTFT (higher wins); remembers prefixes
    as the prefix-trie policy does (it is the policy's prefix memory for cache affinity)."""

    def __init__(self, trie: PrefixTrie, *, block_chars: int, isolate_tenants: bool, alpha: float = DEFAULT_ALPHA,
                 others_weight: float = DEFAULT_OTHERS_WEIGHT):
        self.trie = trie
        self.block_chars = block_chars
        self.isolate_tenants = isolate_tenants
        self.model = TtftModel(alpha, others_weight=others_weight)
        self._last: dict[str, float] = {}  # candidate id → work, from the last `score`
        self._last_uncached: dict[str, float] = {}
        self._depths: dict[str, int] = {}  # candidate id → its matched blocks, from the last `score`
        self._cost: dict[str, float] = {}  # candidate id → its predicted cost, from the last `score`
        # per target, (request id, uncached tokens) of its latest pushes, newest last: the unseen ones
        # (`pushed_since_probe`, settled by each probe) are the prefill still ahead there
        self._pushed: dict[str, deque] = {}

    def unseen_prefill(self, view: ReplicaView) -> float:
        """Uncached prompt tokens of the pushes to `view` its last probe has not counted: ours
        (the newest of `pushed_since_probe`, skipping those already answered: a request that
        ended before the next probe is not ahead of anyone, and a conversation's next turn or
        a tree's children come right after it) and the other LB instances' (lb.core.instances)."""
        remote = min(view.remote_since_probe, view.pushed_since_probe)
        own = view.pushed_since_probe - remote
        pushed = self._pushed.get(view.id)
        work = view.remote_prefill_since_probe
        if pushed and own > 0:
            unanswered = self.model.unanswered
            work += sum(u for rid, u in islice(reversed(pushed), own) if unanswered(rid))
        return work

    def ahead(self, view: ReplicaView, prompt: int) -> float:
        """Prefill work in front of a new request on `view`. This LB's own pushes there with no
        first token yet count at their uncached size (`prefill_ahead`, which the scheduler
        copies from `lb.core.backlog`; or, where nothing fed it, the unseen pushes this scorer
        placed), with the other instances' pushes since the last probe; the waiting requests
        that probe counted beyond this LB's own (other clients' work) count at this request's
        size, the only size the LB knows for them."""
        own_unseen = view.pushed_since_probe - min(view.remote_since_probe, view.pushed_since_probe)
        others = max(0, view.pending - max(0, view.prefill_ahead_count - own_unseen))
        known = max(view.prefill_ahead + view.remote_prefill_since_probe, self.unseen_prefill(view))
        return known + others * prompt

    def score(self, req: RequestFacts, candidates: list[ReplicaView], now: float, decision: Decision) -> list[float]:
        chain = request_chain(req, self.block_chars, self.isolate_tenants)
        prompt = max(1, req.prompt_tokens)
        self._depths = depths = self.trie.depths(chain, [v.id for v in candidates])
        # less an answer a candidate gave where its match ends that this request waited for
        # (the hold claimed it: lb.core.affinity); counted for every request that continues an
        # answer, a tree's first children stayed on their busy holders: Mixed Tree's p90 +6 % at
        # 0.7-0.9x capacity in the simulator, against none with the hold alone
        uncached = [max(0.0, uncached_tokens(prompt, depths[v.id], len(chain))
                        - self.answer_after(req, v.id, depths[v.id], claim=False)) for v in candidates]
        work = [self.ahead(v, prompt) + u for v, u in zip(candidates, uncached)]
        self._last = {v.id: w for v, w in zip(candidates, work)}
        self._last_uncached = {v.id: u for v, u in zip(candidates, uncached)}
        costs = self.model.predict(candidates, work, uncached)
        self._cost = {v.id: c for v, c in zip(candidates, costs)}
        decision.matched_blocks = decision.best_blocks = max(depths.values(), default=0)
        decision.total_blocks = len(chain)
        decision.reason = "predicted"
        return [-t for t in costs]

    def chosen(self, decision: Decision) -> None:
        """The explanation names the chosen replica's own prefix match (what it will not
        recompute), not the best candidate's."""
        decision.matched_blocks = self._depths.get(decision.target, 0)
        decision.predicted_ttft_s = self._cost.get(decision.target)

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None:
        work = self._last.get(target_id, float(req.prompt_tokens))
        self.model.placed(req.request_id, target_id, work)
        uncached = self._last_uncached.get(target_id, float(req.prompt_tokens))
        self._pushed.setdefault(target_id, deque(maxlen=MAX_UNSEEN_TRACKED)).append((req.request_id, uncached))
        self.trie.insert(request_chain(req, self.block_chars, self.isolate_tenants), target_id, now)

    def served(self, req: RequestFacts, target_id: str, ttft_s: float | None, e2e_s: float | None,
               output_tokens: int, now: float) -> None:
        self.model.served(req.request_id, target_id, ttft_s, e2e_s, output_tokens)

    def decode_step_s(self, target_id: str | None = None) -> float | None:
        rates = self.model.rates.get(target_id) if target_id is not None else None
        step = rates.step() if rates is not None else None
        return step if step is not None else self.model.typical_step()

    def prefill_token_s(self) -> float | None:
        step = self.model.typical_step()
        return None if step is None else step * self.model.prefill_ratio()

    def forget(self, target_id: str) -> None:
        self.trie.forget(target_id)
        self.model.forget(target_id)
        self._pushed.pop(target_id, None)
