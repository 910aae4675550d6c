"""The KV that the answers under way hold on each replica, estimated from what the LB sees.

An engine's prefix cache shares its KV with the requests it runs. The answer each running
request has decoded so far sits in blocks that no later request matches, and while the request
runs the engine cannot evict them: the cache keeps the prompts only in what is left. The prefix
trie remembers each replica's prefixes up to its KV size (`PrefixTrie.bound`), so without this
it believes a busy replica still holds prompts its engine has evicted to make room for those
answers, and sends their next requests there to recompute them.

Seen in the simulator (held-out `hot-shift` on SGLang's engines at 1.1x capacity, seed 0):
124 of 3,122 requests went to a replica whose engine no longer held their app's system prompt
while another's did, each because the trie still believed it held it; the engines' caches held
24-30k of their 32.8k tokens of KV (10th-90th percentile), the running requests' answers the
rest. Bounded by what the engines really held, 44 such placements were left and the fleet
served 12.55 req/s against 12.22; bounded by this estimate, 12.45, its TTFT p90 (the requests
still waiting counted) 10.6 s against 14.1 (5 seeds; docs/results.md).

The estimate: each answer under way has decoded one token per engine step since its first
token (a request answered whole: since its predicted first token), at most its expected
length. Summed per replica from running sums (the count, the start times, the lengths), so
asking costs O(1) whatever the batch. Pure: times are passed in. Bounded: at most
`max_tracked` answers are tracked (the oldest dropped), so a caller that misses an end cannot
grow it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_TRACKED = 65_536
# The cache keeps at least this share of a replica's KV in the trie's view, whatever the
# estimate says: a step learned too short (one stalled answer, `lb.core.predicted`) or lengths
# far past the truth must not make the trie forget every prefix a replica holds.
MIN_CACHE_SHARE = 0.25


@dataclass(slots=True)
class _Answer:
    target: str
    tokens: float  # its expected length (all its samples')
    samples: int = 1  # answers it decodes side by side (the API's `n`), a token each a step
    start: float | None = None  # when its decode began; None: not yet


class Decoding:
    """Per replica, the answers under way and the tokens they have decoded so far."""

    def __init__(self, max_tracked: int = MAX_TRACKED):
        self.max_tracked = max_tracked
        self._answers: OrderedDict[str, _Answer] = OrderedDict()
        # target → (answers started, sum of their start times, sum of their expected lengths),
        # a push of n parallel samples n answers that start together
        self._sums: dict[str, tuple[int, float, float]] = {}

    def __len__(self) -> int:
        return len(self._answers)

    def placed(self, request_id: str, target_id: str, answer_tokens: float, starts_at: float | None = None,
               samples: int = 1) -> None:
        """`request_id` was pushed to `target_id` with `samples` answers of about `answer_tokens`
        in all to come; `starts_at`: when its decode begins, where no first token will say (an
        answer that comes back whole: its predicted first token). A retry of the same id replaces it."""
        self.ended(request_id)
        answer = self._answers[request_id] = _Answer(target_id, max(0.0, answer_tokens), max(1, samples))
        if starts_at is not None:
            self._start(answer, starts_at)
        while len(self._answers) > self.max_tracked:
            self.ended(next(iter(self._answers)))

    def first_token(self, request_id: str, now: float) -> None:
        """Its first token came back now: it decodes from here on."""
        answer = self._answers.get(request_id)
        if answer is not None and answer.start is None:
            self._start(answer, now)

    def ended(self, request_id: str) -> None:
        """It ended (answered, failed, cancelled): the engine freed or cached its answer."""
        answer = self._answers.pop(request_id, None)
        if answer is None or answer.start is None:
            return
        count, starts, tokens = self._sums[answer.target]
        if count > answer.samples:
            self._sums[answer.target] = (count - answer.samples, starts - answer.samples * answer.start,
                                         tokens - answer.tokens)
        else:  # the last one: drop the sums, so no rounding carries over
            del self._sums[answer.target]

    def forget(self, target_id: str) -> None:
        self._sums.pop(target_id, None)
        for rid in [rid for rid, a in self._answers.items() if a.target == target_id]:
            del self._answers[rid]

    def tokens(self, target_id: str, now: float, step_s: float | None) -> float:
        """The answer tokens decoded so far on `target_id` by this LB's requests under way there,
        at one per `step_s` each since its start and at most their expected lengths (summed);
        0 while no step is known."""
        sums = self._sums.get(target_id)
        if sums is None or not step_s or step_s <= 0:
            return 0.0
        count, starts, tokens = sums
        return max(0.0, min(tokens, (count * now - starts) / step_s))

    def cache_room(self, target_id: str, kv_tokens: int, now: float, step_s: float | None) -> int:
        """The KV tokens `target_id`'s engine has for its prefix cache: its KV less the answers
        under way there (`tokens`), at least MIN_CACHE_SHARE of it."""
        used = self.tokens(target_id, now, step_s)
        return int(max(kv_tokens * MIN_CACHE_SHARE, kv_tokens - used))

    def _start(self, answer: _Answer, at: float) -> None:
        answer.start = at
        count, starts, tokens = self._sums.get(answer.target, (0, 0.0, 0.0))
        self._sums[answer.target] = (count + answer.samples, starts + answer.samples * at, tokens + answer.tokens)
