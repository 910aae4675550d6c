"""Cache-affine scheduling of the LB queue: who goes first when a replica frees up.

With selective pushing requests wait in the LB queue, so the LB decides, like an engine's
scheduler, which waiting request a replica that just became available gets. Walking the
queue strictly in order hands that replica to the oldest request even when a younger one
holds a long cached prefix there and the older one would miss its cache anywhere; and a
request whose prefix holder is busy for a moment goes to whichever replica is free and
recomputes its whole prompt. Two bounded fixes, SGLang's longest-prefix-match scheduling
brought up to the LB:

- *LPM window*: among the first `window` entries (in the queue's own order), those with a
  prefix match on a free replica are offered first, longest match first; then everyone
  else in queue order. No head-of-line blocking: an entry nothing can take is skipped.
  Reordering never jumps over an entry that has waited `max_bypass_s`.
- *Hold for the holder*: a request whose best holder (among all live replicas serving it)
  has a match at least `min_gain` of its prompt longer than any free replica's waits for
  that holder, at most `hold_bound` = max(`hold_s`, step × its max_tokens); past it, it
  goes wherever it can. The holder is busy with requests like this one (a tree's other
  thoughts), so it frees a slot about when a thought of this length has decoded: the bound
  grows with max_tokens, at the fleet's learned inter-token time (`hold_per_token_s` until
  one is learned). A fixed 0.06 s was an idle L4's step; a batch that fills its KV decodes
  at ~0.1 s, and under overload holds then ran out before the holder freed a slot: SGLang's
  shared-prefix benchmark at 1.3x capacity sent a third of its requests off their holder
  and cached 0.59 of its prompt tokens; held for the learned step, 0.79 (docs/results.md).
  Recomputing elsewhere costs more than the prefill when KV binds: the prefix then takes KV
  on two replicas, so fewer requests run (sp-micro's long-thought regime: hold 1 s → cache
  hit 0.53; ~15 s → 0.7, docs/results.md).
  No hold for a holder that preempts beside a free replica that does not and would idle
  (`hold`): it frees no slot for the held request.
- *Across regions*: with no local replica free, a request a busy local replica holds much
  more of than any peer region waits for it (at most `max_bypass_s`) rather than leave, and
  one whose context a peer region holds goes there, free local replica or not
  (`across_regions`).
- *Bounded unfairness*: an entry that has waited `max_bypass_s` at the front of the queue
  (among the first `window` entries, where the reordering can pass it over) is never jumped
  over: no entry is passed over for longer than that (beyond what no head-of-line blocking
  already allows: others placed while nothing can take it). A hold delays only the held
  entry itself, so it is bounded by `hold_bound`, not by `max_bypass_s`, and an entry that
  may still be held does not stop the reordering either (`bypass_bound`). Both count from
  when the entry reached the front (`front_wait`), not from its arrival: in a backlog every
  entry arrives seconds before it can be placed, and counted from arrival the bounds had
  passed before any entry got there, so an overloaded LB fell back to strict order and no
  holds, placing each request on whichever replica freed first, its cache elsewhere.

Pure: the daemon passes `now`, the free target ids and the policy's prefix memory.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
import itertools
import math
from typing import Collection, Iterable, Iterator, Mapping

from lb.core.length_model import LengthModel
from lb.core.prefix import uncached_tokens
from lb.core.pushing import DEFAULT_DECODE_RESERVE
from lb.core.types import PrefixMemory, QueueEntry, RequestFacts


# A request held for a busy holder takes a replica the pass left free only if that replica
# carries at most this share of the holder's load (`AffinityScheduler.release`): the holder is
# overloaded next to it, not the fleet. Where every replica is as busy (past capacity) the free
# slot is a moment's, the next request for its own prefixes is on its way, and moving a
# conversation's next turn off its history there cost multi-turn at 1.3x 10 % of its
# throughput (cache hit 0.84 -> 0.69; 3 seeds, docs/results.md). The peers' `lighter_share`.
RELEASE_SHARE = 0.5


@dataclass(frozen=True)
class AffinityConfig:
    window: int = 32  # queue entries considered for longest-match-first placement; 0: strict order
    hold_s: float = 1.0  # a request waits for its busy prefix holder at least this long (a few prefills of an 8B model on an L4)
    # ...and up to this per token of its max_tokens until the fleet's inter-token time is learned from
    # answers (then that: about as long as an answer of its length takes to decode on the holder);
    # 0.06 is ~one batched decode step of an 8B model on an L4
    hold_per_token_s: float = 0.06
    min_gain: float = 0.35  # ...and only if the holder's match beats every free replica's by this share of the prompt
    max_bypass_s: float = 2.0  # an entry waiting this long at the front of the queue is never held nor jumped over

    def __post_init__(self) -> None:
        if (self.window < 0 or self.hold_s < 0 or self.hold_per_token_s < 0 or self.max_bypass_s < 0
                or not 0 < self.min_gain <= 1):
            raise ValueError("affinity: window, hold_s, hold_per_token_s and max_bypass_s must be >= 0 "
                             "and 0 < min_gain <= 1")

    def hold_bound(self, req: RequestFacts, step_s: float | None = None, expected_output: float | None = None) -> float:
        """Longest `req` waits for its busy prefix holder: about as long as its answer takes to
        decode there, at `step_s` per token (the fleet's learned inter-token time; the configured
        `hold_per_token_s` until one is learned). The answer's length is its max_tokens, or where
        the client declares none (chat clients, most SDK calls), `expected_output`: the learned
        length of answers like it (`AffinityScheduler.lengths`)."""
        per_token = step_s if step_s else self.hold_per_token_s
        tokens = req.max_tokens if req.max_tokens is not None else expected_output
        return max(self.hold_s, per_token * (tokens or 0))

    def bypass_bound(self, req: RequestFacts, step_s: float | None = None, expected_output: float | None = None) -> float:
        """Longest the reordering may jump over `req`: while it may still be held for its
        holder, it is waiting for its cache, not being passed over."""
        return max(self.max_bypass_s, self.hold_bound(req, step_s, expected_output))


def front_wait(entry: QueueEntry, now: float) -> float:
    """How long `entry` has waited at the front of the queue, where the reordering may pass
    it over or a hold keep it; before it got there it waited for the queue ahead of it."""
    return now - (entry.enqueued_at if entry.fronted_at is None else entry.fronted_at)


class AffinityScheduler:
    def __init__(self, cfg: AffinityConfig, memory: PrefixMemory | None, lengths: LengthModel | None = None):
        self.cfg = cfg
        self.memory = memory  # None: the policy remembers no prefixes, strict queue order
        # answers' lengths learned from what replicas returned (the scheduler feeds it): a hold's
        # bound for a request that declares no max_tokens
        self.lengths = lengths

    def expected_output(self, facts: RequestFacts) -> float | None:
        """The answer length a hold assumes for a request without max_tokens (None: it has one)."""
        if facts.max_tokens is not None or self.lengths is None:
            return None
        return self.lengths.expected(facts)

    def order(self, entries: Iterable[QueueEntry], now: float, free: Collection[str]) -> Iterator[QueueEntry]:
        """The order to offer entries (given in queue order) to the free replicas in one pass:
        the first `window` entries with a match on a free replica, longest first, then the
        rest in queue order. Reordering stops at the first overdue entry, so nothing jumps
        over a request that has waited `max_bypass_s`."""
        cfg, memory = self.cfg, self.memory
        entries = iter(entries)
        if memory is None or cfg.window == 0 or not free:
            return entries
        head = list(itertools.islice(entries, 2))
        if len(head) < 2:  # one waiting request (the common case at low load): nothing to reorder
            return iter(head)
        entries = itertools.chain(head, entries)
        step = memory.decode_step_s()
        matched: list[tuple[int, int, QueueEntry]] = []
        unmatched: list[QueueEntry] = []
        stop: list[QueueEntry] = []
        for i, entry in enumerate(entries):
            if entry.fronted_at is None:
                entry.fronted_at = now
            if now - entry.fronted_at >= cfg.bypass_bound(entry.facts, step, self.expected_output(entry.facts)):
                stop.append(entry)
                break
            depth, _, _ = memory.affinity(entry.facts, free)
            if depth:
                matched.append((-depth, i, entry))
            else:
                unmatched.append(entry)
            if i + 1 >= cfg.window:
                break
        matched.sort(key=lambda m: m[:2])  # longest match first; equal matches in queue order
        return itertools.chain((e for _, _, e in matched), unmatched, stop, entries)

    def across_regions(self, entry: QueueEntry, now: float, live: Collection[str],
                       remote: dict[str, float]) -> tuple[str, str | None]:
        """A peer region might take `entry`: where does its prefix say it should go? `live`:
        the healthy local targets that could serve it; `remote`: the prompt tokens each peer
        region would compute (`PeerRouter.uncached`).

        ("keep", None): a busy local replica holds more of its prompt than any peer region, by
        half `min_gain` of it, so with no local replica free it waits for it (at most
        `max_bypass_s` at the front, or its hold bound if shorter) instead of leaving to
        recompute that context, and a request behind it with nothing cached here leaves
        instead; ("follow", region): that peer region holds that much more than every local
        replica (a tree or conversation whose earlier calls went there), so it goes there, free
        local replica or not, to queue beside its cache; ("any", None): neither.

        Half `min_gain`, not all of it: a split tree recomputes its context for each later call
        on both sides, not once, and the tries hold prompts, not answers, so a call's parent
        answer, cached where the parent ran, counts for nothing. Three regions over 300 s, 2
        seeds, TTFT p90 at 1.1x, by the share of the prompt across regions: 0.15 530/491 ms,
        0.25 496/536, 0.35 568/587, 0.5 615/583 (docs/results.md); 0.175 since `min_gain` is 0.35."""
        memory, facts = self.memory, entry.facts
        if memory is None or not remote:
            return "any", None
        depth, blocks, _ = memory.affinity(facts, live)
        if not blocks:
            return "any", None
        prompt = max(1, facts.prompt_tokens)
        here = uncached_tokens(prompt, depth, blocks)
        gain = self._region_gain(prompt)
        region = min(remote, key=remote.__getitem__)
        # a peer could serve it now: it waits for its cache at most max_bypass_s, however long its
        # hold bound (60 s for 1,000 tokens); measured level with the hold bound (docs/results.md)
        keep_for = min(self.cfg.hold_bound(facts, memory.decode_step_s(), self.expected_output(facts)),
                       self.cfg.max_bypass_s)
        if remote[region] - here >= gain and front_wait(entry, now) < keep_for:
            return "keep", None
        if here - remote[region] >= gain:
            return "follow", region
        return "any", None

    def may_follow(self, facts: RequestFacts, remote: dict[str, float]) -> bool:
        """Could `across_regions` answer "follow" for these peer estimates? A cheap precondition
        (a peer must leave at most the prompt less the threshold to compute), so a request no
        peer region remembers skips the local prefix match."""
        prompt = max(1, facts.prompt_tokens)
        return self.memory is not None and min(remote.values(), default=prompt) <= prompt - self._region_gain(prompt)

    def _region_gain(self, prompt: float) -> float:
        """How many more of the prompt's tokens one side must hold to keep or draw a request
        across regions: half `min_gain` (`across_regions` says why)."""
        return self.cfg.min_gain / 2 * prompt

    def hold(self, entry: QueueEntry, now: float, free: Collection[str], live: Collection[str],
             preempted_at: Mapping[str, float] | None = None) -> bool:
        """Should `entry` wait for a busy replica that holds much more of its prompt than
        any free one? `live`: the healthy targets that could serve it, free or not;
        `preempted_at`: when each target that preempts last did, passed by a caller with no
        more requests waiting than replicas free (else None), so that a free one would idle.

        Not while every holder has preempted within the hold's bound and a free replica has
        not (`_overcommitted`). The bound assumes the holder frees a slot about when an answer
        like this one has decoded there; a replica that preempts runs more than its KV holds
        and readmits what it preempted before anything new, so it frees none, and what it
        takes it preempts again. A reasoning model's answers (thousands of tokens) after a
        surge kept the holders of its system prompts preempting while the requests held for
        them waited up to their bound, a minute or more, beside a replica with half its KV
        free (docs/results.md). Where every replica preempts (the fleet past its capacity)
        the hold stands: there its cache is what the fleet lacks. So it does while others
        wait for the free replica: chats released from the holder of their system prompt on
        16 replicas past capacity took the free replicas the long documents behind them had
        nowhere else to find, and the p90 rose from 30 to 42 s (held-out `long-short`).

        `min_gain` is 0.35, not 0.5: on 16 replicas past capacity a tree spread over ever more of
        them at 0.5, since some free replica nearly always held part of it and so came within
        half a prompt of the holder (Mixed Tree at 1.3x: 0.96x the hash ring's throughput, the
        intervals apart; 0.98x at 0.35, overlapping); on 4 replicas the suite moves within its
        intervals (docs/results.md)."""
        cfg, memory = self.cfg, self.memory
        if memory is None or len(live) <= len(free):
            return False
        bound = cfg.hold_bound(entry.facts, memory.decode_step_s(), self.expected_output(entry.facts))
        if front_wait(entry, now) >= bound:
            return False
        depth_all, blocks, holders = memory.affinity(entry.facts, live)
        if not blocks or not set(holders).isdisjoint(free):
            return False
        if preempted_at and self._overcommitted(holders, free, preempted_at, now - bound):
            return False
        depth_all += self._answer_blocks(entry.facts, holders, depth_all, blocks)
        if depth_all < cfg.min_gain * blocks:
            return False
        depth_free, _, _ = memory.affinity(entry.facts, free)
        return depth_all - depth_free >= cfg.min_gain * blocks

    def release(self, entry: QueueEntry, free: Collection[str], live: Collection[str], running: Mapping[str, int],
                waiting: Mapping[str, int], per_token_s: float, ahead: Counter) -> bool:
        """`entry` is held for a busy holder (`hold`) and a replica in `free` is still free once the
        pass has placed every request it could: should `entry` take it rather than wait?

        Yes when the wait for the holder is longer than the prefill it would redo there, and that
        replica carries at most `RELEASE_SHARE` of the holder's load. The wait: the requests
        ahead of it for those holders (held this pass, `ahead`, and waiting in their engines) over
        the rate they free slots (what they run, each done once an answer like this one has
        decoded). The hold's own bound is an answer's decode time whatever waits: a prefix that
        turned hot (held-out `hot-shift`, an app's 1,200-token system prompt with a quarter of the
        traffic) kept 35 requests waiting for its one holder while three replicas ran half full,
        TTFT p90 at 0.9x 2.35x llm-d's; released so, level (docs/results.md).

        `running`: what each target runs; `waiting`: what waits in its engine, the pushes it has
        not reported included (the two are its load); `per_token_s`: a token's prefill time,
        learned (`Scheduler._prefill_token_s`). A request that stays held counts in `ahead` for
        the next one."""
        memory, facts = self.memory, entry.facts
        depth_all, blocks, holders = memory.affinity(facts, live)
        if not blocks or not holders:
            return True
        depth_all += self._answer_blocks(facts, holders, depth_all, blocks)
        depth_free, _, _ = memory.affinity(facts, free)
        busy = [h for h in holders if h not in free]
        if depth_free >= depth_all or not busy:
            return True  # a free replica holds it now (a request placed there this pass)

        def load(t: str) -> int:
            return running.get(t, 0) + waiting.get(t, 0)

        if min(map(load, free)) > RELEASE_SHARE * min(map(load, busy)):
            return False
        holders = busy
        redo_s = max(0.0, depth_all - depth_free) / blocks * max(1, facts.prompt_tokens) * per_token_s
        answer = facts.max_tokens if facts.max_tokens is not None else self.expected_output(facts)
        decode_s = (answer or DEFAULT_DECODE_RESERVE) * (memory.decode_step_s() or self.cfg.hold_per_token_s)
        # an engine with requests waiting runs at least one: a probe that caught it between
        # batches (none running) says nothing of its line, which is not endless
        rate = max(1, sum(running.get(h, 0) for h in holders)) / max(decode_s, 1e-3)
        key = tuple(sorted(holders))
        before = ahead[key] + min(waiting.get(h, 0) for h in holders)
        if (before + 1) / rate <= redo_s:
            ahead[key] += 1
            return False
        return True

    @staticmethod
    def _overcommitted(holders: list[str], free: Collection[str], preempted_at: Mapping[str, float],
                       since: float) -> bool:
        """Has every holder preempted since `since`, and some free replica not?"""
        never = -math.inf
        return (all(preempted_at.get(h, never) >= since for h in holders)
                and any(preempted_at.get(f, never) < since for f in free))

    def _answer_blocks(self, facts: RequestFacts, holders: list[str], depth: int, blocks: int) -> float:
        """The prompt blocks past the trie's match that a holder also has: the answer it gave
        right where the match ends, which `facts` continues (a conversation's next turn carries
        the last answer and a short new message; the trie, holding prompts, matched only the
        last prompt, often under `min_gain` of this one, and the turn left its history)."""
        tokens = max((self.memory.answer_after(facts, h, depth) for h in holders), default=0)
        if not tokens:
            return 0.0
        return min(blocks - depth, tokens * blocks / max(1, facts.prompt_tokens))
