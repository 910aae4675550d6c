"""Which interaction a call continues when the client does not say (no interaction or session
header), and how often a user's calls are continued at all.

Most third-party clients send none of `lb`'s headers. An agent's next step, or a chat's next
turn, still shows itself: its prompt is the earlier call's prompt, that call's answer and what
came after, so its prefix chain (`lb.core.prefix`) holds the earlier prompt's last whole block.
`recognize` gives such a call the earlier call's interaction, and a call that continues none its
own. The same prompt sent again (it extends the earlier one by no whole block) is a new
question, not a next step; a block where two of a user's interactions' prompts ended (a shared
system prompt and questions shorter than a block) recognizes neither. Other users' prompts
ending there do not count: a call continues a call of its own user. A prompt shorter than one block
(a chat's "hi") has no chain: it is known by a hash of the whole prompt, kept per user, and a
call of a block or more that starts with it continues it. Two things use what is
recognized: the KV leases (`lb.core.leases`) and the fair queue, which keeps a recognized
interaction's rank as a declared one's (`interaction_of`, `lb.core.queueing.WSCQueue`);
without it agents without headers at 1.3x capacity finished 0.144 sessions a second against
0.225 with headers.

Leasing the context of every answered call would hold room for calls that never come: single
questions, a tree's leaves. So each user's continued share is learned (decayed over their last
~64 answered calls): a user whose calls are continued 90 % of the time (an agent) leases 90 % of
an answered context, one who asks single questions ~0. At 1.3x capacity, leasing every
undeclared call in full cost document Q&A 22 % of its throughput and bursty tenants 6 %.

How long a continuation takes to come is learned per user as well: the gap from an answer to
the call continuing it (the tool's run, the user's typing). A lease waits for a next call at most
`GAP_MARGIN` times the longest of the user's last `GAPS_KEPT` gaps: a tree's next calls come the
moment its answers do, so the lease of a leaf that no call continues ends at once instead of
holding its share of room for `lease_s` (that had cost Tree of Thoughts without headers 16 % of
the trees finished a second at 1.3x capacity, the requests served level).

Pure and bounded: prompt ends and users kept at most `MAX_PROMPT_ENDS` and `MAX_USERS`.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from lb.core.prefix import prompt_prefix_hash, prompt_size
from lb.core.types import RequestFacts

# facts.extra: the interaction an undeclared call continues (or starts), as recognized
IMPLICIT = "lb.continuations.interaction"
# facts.extra: the key of the answered prompt's end the call was recognized to continue (the
# other LB instances are told, so every instance learns the user's continued share)
CONTINUED = "lb.continuations.continued"
# Answered prompts whose continuations are recognized, at most (the oldest forgotten first).
MAX_PROMPT_ENDS = 65536
# Users whose prompts ended at one block, kept per block (the least recent forgotten first). A
# continuation comes from the user of the call it continues, so prompts of other users that end
# at the same block (the same system prompt and question, as many users send) do not make a
# user's next call ambiguous: Tree of Thoughts' trees, each its own user asking a question
# others ask too, had 15 % of their first children recognized when one block held one end.
MAX_USERS_PER_END = 16
# Users whose continued share is kept, at most (the least recently answered forgotten first).
MAX_USERS = 4096
# Each answered call weighs this much less than the one after it: a user's share is over
# their last ~64 answered calls, so a client that changes what it sends is followed.
DECAY = 1.0 - 1.0 / 64
# A user with fewer answered calls than this (decayed) is given everyone's share.
MIN_ANSWERED = 4.0
# Gaps from an answer to its continuation kept per user, and how many before they bound a lease.
GAPS_KEPT = 32
MIN_GAPS = 4
# A lease waits this many times the longest recent gap (the gaps vary: a tool runs 1 s, then 4 s).
GAP_MARGIN = 1.5
# Answered prompts shorter than one block kept per user (a chat's first turn, "hi"): a call is
# checked against each, one hash apiece, only when no block of its chain was a prompt's end.
SHORT_KEPT = 8


def declares(facts: RequestFacts) -> bool:
    """Does the call name its interaction (headers), or must its prompt tell?"""
    return bool(facts.interaction_id or facts.session)


def recognized_continuation(facts: RequestFacts) -> bool:
    """Was the undeclared call recognized to continue an answered call (a later stage)?"""
    key = facts.extra.get(IMPLICIT)
    return key is not None and key != facts.request_id


def continues(facts: RequestFacts) -> bool | None:
    """For an undeclared call the scheduler looked at: does it continue an answered call? None
    for a call that names its interaction, or one nothing recognized (no prefix memory)."""
    if declares(facts) or IMPLICIT not in facts.extra:
        return None
    return recognized_continuation(facts)


def interaction_key(facts: RequestFacts) -> str | None:
    """The interaction the call names, else the one it was recognized to continue or start
    (None for a call nothing recognized, or one that names only its session)."""
    return facts.interaction_id or facts.extra.get(IMPLICIT)


def interaction_of(facts: RequestFacts) -> str | None:
    """The interaction the call names, else the one it was recognized to continue (a later
    stage: `mid_interaction`). The fair queue anchors an interaction under `interaction_key`,
    which also names the one an undeclared first call may start."""
    if facts.interaction_id is not None:
        return facts.interaction_id
    return facts.extra.get(IMPLICIT) if recognized_continuation(facts) else None


class Continuations:
    def __init__(self):
        # an answered undeclared call's last whole prompt block → its user → [its interaction
        # (None: two of the user's interactions ended a prompt there), its user, continued yet?,
        # answered at, the block]
        self._ends: OrderedDict[bytes, dict[str, list]] = OrderedDict()
        # user → [answered, continued (both decayed), the last gaps to a continuation]
        self._users: OrderedDict[str, list] = OrderedDict()
        self._all = [0.0, 0.0]  # every user's together
        # user → (size, key in _ends) of their latest answered prompts shorter than a block
        self._short: OrderedDict[str, deque] = OrderedDict()

    def recognize(self, facts: RequestFacts, chain: list[int], now: float) -> None:
        """An undeclared call arrived: it joins the interaction of the latest answered prompt it
        extends by a whole block at least (`chain`: its prefix chain), else starts its own."""
        if declares(facts) or IMPLICIT in facts.extra:
            return
        key, ends, end, user = None, self._ends, None, facts.user or ""
        if ends:
            for i in range(len(chain) - 2, -1, -1):  # a continuation's match sits near its end
                slot = ends.get(chain[i])
                if slot is not None:
                    end = slot.get(user)
                    if end is not None:
                        break
            if end is None and chain:  # or it extends a prompt shorter than a block by one or more
                end = self._short_end(facts)
            if end is not None:
                key = end[0]
                if key is not None and not end[2]:
                    end[2] = True
                    self._continued(end[1], now - end[3])
                    facts.extra[CONTINUED] = end[4]
        facts.extra[IMPLICIT] = key or facts.request_id

    def _short_end(self, facts: RequestFacts) -> list | None:
        """The answered prompt shorter than a block (of this user's last `SHORT_KEPT`) that this
        call's prompt starts with, if any."""
        short = self._short.get(facts.user or "")
        if not short:
            return None
        size = prompt_size(facts)
        for n, key in reversed(short):
            end = self._ends.get(key, {}).get(facts.user or "")
            if end is not None and n < size and prompt_prefix_hash(facts, n) == key:
                return end
        return None

    def answered(self, facts: RequestFacts, chain: list[int] | None, now: float) -> bytes | None:
        """An undeclared call was answered: a later call extending its prompt continues it.
        Returns the key its prompt's end is known by (None when nothing was recorded)."""
        key = facts.extra.get(IMPLICIT)
        if declares(facts) or key is None or chain is None:
            return None
        user = facts.user or ""
        if chain:
            last = chain[-1]
        else:  # shorter than a block: known by a hash of the whole prompt, kept per user
            size = prompt_size(facts)
            if not size:
                return None
            last = prompt_prefix_hash(facts, size)
            self._short_kept(user, size, last)
        self._record(last, key, user, now)
        return last

    def heard_answer(self, last: bytes, key: str, user: str, now: float, short_size: int = 0) -> None:
        """Another LB instance answered an undeclared call whose prompt ends at `last` (a prompt
        of `short_size` bytes, shorter than a block, when not 0): its next call may come here."""
        if short_size:
            self._short_kept(user, short_size, last)
        self._record(last, key, user, now)

    def heard_continued(self, last: bytes, now: float) -> None:
        """Another LB instance recognized a call continuing the prompt that ended at `last`
        (whose user the message does not say: counted only where one user's prompt ended there)."""
        slot = self._ends.get(last)
        end = next(iter(slot.values())) if slot is not None and len(slot) == 1 else None
        if end is not None and end[0] is not None and not end[2]:
            end[2] = True
            self._continued(end[1], now - end[3])

    def _short_kept(self, user: str, size: int, last: bytes) -> None:
        short = self._short.pop(user, None) or deque(maxlen=SHORT_KEPT)
        short.append((size, last))
        self._short[user] = short
        while len(self._short) > MAX_USERS:
            self._short.popitem(last=False)

    def _record(self, last: bytes, key: str, user: str, now: float) -> None:
        ends = self._ends
        slot = ends.pop(last, None) or {}
        known = slot.pop(user, None)
        slot[user] = [key if known is None or known[0] == key else None, user, False, now, last]
        if len(slot) > MAX_USERS_PER_END:
            del slot[next(iter(slot))]
        ends[last] = slot
        while len(ends) > MAX_PROMPT_ENDS:
            ends.popitem(last=False)
        counts = self._users.pop(user, None) or [0.0, 0.0, deque(maxlen=GAPS_KEPT)]
        self._users[user] = counts
        while len(self._users) > MAX_USERS:
            self._users.popitem(last=False)
        for c in (counts, self._all):
            c[0] = c[0] * DECAY + 1.0
            c[1] *= DECAY

    def _continued(self, user: str, gap_s: float) -> None:
        counts = self._users.get(user)
        if counts is not None:
            counts[2].append(max(0.0, gap_s))
        for c in (counts, self._all):
            if c is not None:
                c[1] = min(c[0], c[1] + 1.0)

    def lease_s(self, user: str | None, longest: float) -> float:
        """How long `user`'s next call is worth waiting for: `GAP_MARGIN` times the longest of
        their recent gaps to a continuation, at most `longest` (`longest` until they have a few)."""
        counts = self._users.get(user or "")
        if counts is None or len(counts[2]) < MIN_GAPS:
            return longest
        return min(longest, GAP_MARGIN * max(counts[2]))

    def share(self, user: str | None) -> float:
        """The share of `user`'s answered undeclared calls that a next call continued (everyone's
        while the user has few)."""
        counts = self._users.get(user or "")
        if counts is None or counts[0] < MIN_ANSWERED:
            counts = self._all
        return counts[1] / counts[0] if counts[0] > 0 else 0.0
