"""KV leases: the cache an interaction under way will come back for, kept out of SP-P's headroom.

An agent's step or a conversation's turn ends; its next call comes a moment later (the tool
runs, the user types) and continues the context the replica just computed. Between the two
that context is evictable cache, which an engine counts as free room (SGLang's
`/v1/loads` available tokens, vLLM's free blocks) and which SP-P's headroom counted as room
too. Past capacity `lb` then filled it with other requests: the engines ran more at once than
they do when they queue for themselves, evicted the contexts of the sessions in their tool
calls, and the next steps recomputed them. Agent sessions on 16 replicas at 1.3x capacity
(simulator, docs/results.md): 11.1 requests running per replica against 9.6 for a hash ring
whose engines queue, 0.48 of prompt tokens cached against 0.66, 0.88x its throughput and
0.74x the sessions finished; at 1.1x capacity `lb` was 1.09x it.

So a call of an interaction that is not its last (`x-lb-interaction-id` without
`x-lb-final-call`, else a `x-lb-session`) leases, when answered with no other call of the
interaction in flight, its prompt and answer tokens on the replica that answered it. (A tree's
call that ends while its siblings run leases nothing: their shared context is in use, not
evictable, and counted out of the free KV already; leasing it too cost Mixed Tree 3 % of its
throughput at 1.3x capacity.) The lease ends when the interaction's next call arrives (it is
then in the queue, and the cache affinity places it) or after `ttl_s`: a session that does not
come back within that stops holding room. SP-P's headroom on a replica is its free KV less
what is leased there (`lb.core.pushing.has_headroom`). Below capacity the free KV dwarfs the
leases and nothing changes; near it, new work waits in the LB queue instead of evicting the
contexts the next calls need.

Clients that send none of those headers (most third-party clients) are recognized by their
prompts instead (`lb.core.continuations`): a call whose prompt extends an answered call's
continues its interaction. As such an interaction never says which call is its last, the lease
of an undeclared call is its context times the share of its user's calls that were continued.
(Agent sessions without headers at 1.3x capacity had lost what leases gave: docs/results.md.)

Pure: the scheduler passes `now`; bounded per replica.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import NamedTuple

from lb.core.continuations import Continuations, declares, interaction_key
from lb.core.prefix import prompt_size
from lb.core.types import RequestFacts

# How long a lease holds room for the interaction's next call: an agent's tool call or a chat
# turn's reply usually comes within seconds; one that takes longer finds its context if no
# other work needed the room meanwhile. 0 turns leases off.
DEFAULT_LEASE_S = 5.0
# Leases one replica keeps at most (the oldest end first): more interactions than this waiting
# on one replica's cache between their calls is more than its KV holds anyway.
MAX_LEASES_PER_TARGET = 4096
# facts.extra: what an answered call leased and where its prompt ended (`Answered`)
ANSWERED = "lb.leases.answered"


class Answered(NamedTuple):
    """An answered call's lease (tokens 0: none) and, for an undeclared call, the key its
    prompt's end is known by (`short_size`: the prompt's size when shorter than a block): what
    the other LB instances over the same replicas are told (lb.core.instances)."""

    key: str
    tokens: int
    ttl_s: float
    end: bytes
    short_size: int
    user: str


def lease_key(facts: RequestFacts) -> str | None:
    """The interaction a call belongs to: its interaction id, else its session, else the one its
    prompt was recognized to continue (`lb.core.continuations`; a call naming its session is
    not recognized, so the session comes before it)."""
    return interaction_key(facts) or facts.session


class KvLeases:
    def __init__(self, ttl_s: float = DEFAULT_LEASE_S):
        self.ttl_s = ttl_s
        # target → {interaction → (tokens, expires at)}, oldest first
        self._by_target: dict[str, OrderedDict[str, tuple[int, float]]] = {}
        self._expiry: dict[str, list[tuple[float, str]]] = {}  # target → (expires at, interaction), a heap
        self._where: dict[str, str] = {}  # interaction → the target holding its lease
        self._tokens: dict[str, int] = {}  # target → its leases' tokens (kept as they come and go)
        self._in_flight: dict[str, int] = {}  # interaction → its calls placed and not ended
        self._calls: dict[str, str] = {}  # request id of a call in flight → its interaction
        self.continuations = Continuations()  # the interactions of calls that do not name theirs

    def answered(self, facts: RequestFacts, target_id: str, prompt_tokens: int, output_tokens: int,
                 now: float, chain: list[int] | None = None) -> None:
        """`target_id` answered a call of an interaction: unless it was the last, its context
        (prompt and answer) stays leased there until the next call comes or `ttl_s` passes.
        `chain`: the prompt's prefix chain, by which an undeclared call's next one is known."""
        key = lease_key(facts)
        if key is None:
            return
        end = self.continuations.answered(facts, chain, now)  # (leases off, the fair queue still recognizes)
        tokens, ttl_s = self._lease_for(facts, key, prompt_tokens, output_tokens)
        if end is not None or tokens:  # what the other LB instances are told (lb.core.instances)
            short_size = prompt_size(facts) if end and not chain else 0
            facts.extra[ANSWERED] = Answered(key, tokens, ttl_s, end or b"", short_size, facts.user or "")
        if tokens:
            self._lease(target_id, key, tokens, now + ttl_s)

    def _lease_for(self, facts: RequestFacts, key: str, prompt_tokens: int, output_tokens: int) -> tuple[int, float]:
        """The tokens (0: none) and seconds the answered call's context is leased for."""
        if self.ttl_s <= 0:
            return 0, 0.0
        self.end(key)
        others = self._in_flight.get(key, 0) - (facts.request_id in self._calls)
        if facts.final_call or others > 0:
            return 0, 0.0
        tokens, ttl_s = max(0, prompt_tokens) + max(0, output_tokens), self.ttl_s
        if not declares(facts):  # it may be the interaction's last: as likely as its user's calls are
            tokens = round(tokens * self.continuations.share(facts.user))
            ttl_s = self.continuations.lease_s(facts.user, ttl_s)
            if not tokens or ttl_s <= 0:
                return 0, 0.0
        return tokens, ttl_s

    def heard(self, target_id: str, key: str, tokens: int, ttl_s: float, now: float) -> None:
        """Another LB instance leased `tokens` on `target_id` for interaction `key`: held here
        too, until the interaction's next call reaches either instance or `ttl_s` passes."""
        if self.ttl_s > 0 and tokens > 0 and ttl_s > 0:
            self.end(key)
            self._lease(target_id, key, tokens, now + min(ttl_s, self.ttl_s))

    def _lease(self, target_id: str, key: str, tokens: int, expires: float) -> None:
        leases = self._by_target.setdefault(target_id, OrderedDict())
        leases[key] = (tokens, expires)
        expiry = self._expiry.setdefault(target_id, [])
        heapq.heappush(expiry, (expires, key))
        if len(expiry) > 2 * len(leases) + 64:  # leases that ended early: their entries go
            expiry[:] = [(at, k) for k, (_, at) in leases.items()]
            heapq.heapify(expiry)
        self._where[key] = target_id
        self._tokens[target_id] = self._tokens.get(target_id, 0) + tokens
        while len(leases) > MAX_LEASES_PER_TARGET:
            self._drop_oldest(target_id, leases)

    def placed(self, facts: RequestFacts) -> None:
        """A call went to a replica: until it ends, its interaction is not idle."""
        key = lease_key(facts)
        if key is None or facts.request_id in self._calls:
            return
        self._calls[facts.request_id] = key
        self._in_flight[key] = self._in_flight.get(key, 0) + 1

    def ended(self, request_id: str) -> None:
        """A placed call ended (answered, failed or cancelled)."""
        key = self._calls.pop(request_id, None)
        if key is None:
            return
        left = self._in_flight[key] - 1
        if left:
            self._in_flight[key] = left
        else:
            del self._in_flight[key]

    def arrived(self, facts: RequestFacts) -> None:
        """The interaction's next call is here: its lease has done its work."""
        key = lease_key(facts)
        if key is not None:
            self.end(key)

    def end(self, key: str) -> None:
        target = self._where.pop(key, None)
        if target is None:
            return
        lease = self._by_target[target].pop(key, None)
        if lease is not None:
            self._tokens[target] -= lease[0]

    def _drop_oldest(self, target_id: str, leases: OrderedDict) -> None:
        key, (tokens, _) = leases.popitem(last=False)
        self._where.pop(key, None)
        self._tokens[target_id] -= tokens

    def leased(self, target_id: str, now: float) -> int:
        """Tokens leased on `target_id` now (the expired leases end here)."""
        leases = self._by_target.get(target_id)
        if not leases:
            return 0
        expiry = self._expiry[target_id]
        while expiry and expiry[0][0] < now:
            at, key = heapq.heappop(expiry)
            lease = leases.get(key)
            if lease is not None and lease[1] == at:  # not a lease that ended or was renewed
                del leases[key]
                self._where.pop(key, None)
                self._tokens[target_id] -= lease[0]
        return self._tokens[target_id]

    def forget(self, target_id: str) -> None:
        """The target left the fleet: its leases go with it."""
        for key in self._by_target.pop(target_id, {}):
            self._where.pop(key, None)
        self._tokens.pop(target_id, None)
        self._expiry.pop(target_id, None)

    def __len__(self) -> int:
        return len(self._where)
