"""Several LBs per region over the same replicas: what one instance makes of the pushes the
others made (they arrive through the shared store, lb.daemon.instances). Pure.

SP-P's headroom runs on the engine's last probed queue plus the pushes that probe cannot
have seen (lb.core.pushing). Another instance's pushes are seen by the engine like ours, so
the same rule applies to them: a push made after our last probe started is unseen by it and
spends headroom until a later probe counts it in the engine's own queue. Without this, each
instance would hand out the whole headroom, and the replica would get it twice.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from lb.core.leases import Answered, KvLeases
from lb.core.prefix import PrefixTrie, uncached_tokens
from lb.core.types import ReplicaView

MAX_REMOTE_LOG = 1024  # the others' pushes remembered per replica (only recent ones matter)


def note_remote_push(view: ReplicaView, log: deque, pushed_at: float, tokens: int, probe_started_at: float | None,
                     key: str = "", prefill: float = 0.0) -> None:
    """Another instance pushed request `key` to this replica at `pushed_at` (wall clock, as
    every instance stamps it), needing `tokens` of KV and `prefill` uncached prompt tokens:
    remembered, and unseen by our last probe (started at `probe_started_at`, wall) when it
    came after that probe started."""
    log.append((pushed_at, tokens, key, prefill))
    while len(log) > MAX_REMOTE_LOG:
        log.popleft()
    if probe_started_at is None or pushed_at > probe_started_at:
        _count(view, 1, tokens, prefill)


def note_remote_end(view: ReplicaView, log: deque, key: str, probe_started_at: float | None) -> bool:
    """The other instance's push `key` was answered: the replica holds it no more, so it
    neither spends headroom nor stands ahead of a new request, though our next probe has not
    said so yet (a conversation's next turn often comes within one probe interval of the last
    answer, and at another instance). False when the push is not remembered."""
    for i in range(len(log) - 1, -1, -1):  # recent pushes end first; at most MAX_REMOTE_LOG
        pushed_at, tokens, k, prefill = log[i]
        if k == key:
            del log[i]
            if probe_started_at is None or pushed_at > probe_started_at:
                _count(view, -1, -tokens, -prefill)
            return True
    return False


def _count(view: ReplicaView, n: int, tokens: int, prefill: float) -> None:
    view.pushed_since_probe = max(0, view.pushed_since_probe + n)
    view.pushed_tokens_since_probe = max(0, view.pushed_tokens_since_probe + tokens)
    view.remote_since_probe = max(0, view.remote_since_probe + n)
    view.remote_prefill_since_probe = max(0.0, view.remote_prefill_since_probe + prefill)


def remote_unseen(log: deque, probe_started_at: float, keep_s: float = 60.0) -> tuple[int, int, float]:
    """After a probe that started at `probe_started_at` answered: how many of the others' pushes
    (their KV tokens, their uncached prompt tokens) it cannot include, i.e. the ones made after
    it started. Entries older than `keep_s` before it are dropped."""
    while log and log[0][0] < probe_started_at - keep_s:
        log.popleft()
    # instances' clocks and messages need not arrive in order: look at every entry (at most MAX_REMOTE_LOG)
    after = [(k, p) for t, k, _, p in log if t > probe_started_at]
    return len(after), sum(k for k, _ in after), sum(p for _, p in after)


# -- prefix affinity across instances ----------------------------------------------------------
# Each push carries the request's prefix chain (its first MAX_SHARED_BLOCKS block hashes), and
# every other instance records it in its own prefix trie for the same replica: all instances
# route by one prefix history, as one LB would, without a lookup on the request path.
MAX_SHARED_BLOCKS = 256  # a longer prompt shares its first 256 blocks (affinity needs the prefix)
HASH_BYTES = 16  # lb.core.prefix.block_hashes


def encode_chain(chain, max_blocks: int = MAX_SHARED_BLOCKS) -> str:
    return b"".join(chain[:max_blocks]).hex()


def decode_chain(text: str) -> tuple[bytes, ...]:
    """The chain `encode_chain` wrote; ValueError when it is not one."""
    raw = bytes.fromhex(text)
    if len(raw) % HASH_BYTES or len(raw) > MAX_SHARED_BLOCKS * HASH_BYTES:
        raise ValueError("not a prefix chain")
    return tuple(raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES))


# -- the messages on the shared channel (lb.daemon.instances publishes and hears them) ----------
END = "end"
LEASE = "lease"
MAX_KEY_CHARS = 256  # an interaction id or user in a message, at most (longer ones are not shared)


@dataclass(frozen=True)
class HeardPush:
    sender: str
    replica: str
    at: float  # wall clock of the push, as the sender stamped it
    tokens: int  # KV tokens it may take
    chain: tuple[bytes, ...]  # its prefix chain (may be empty)
    key: str  # its request id ("" from an instance of an earlier release)
    prompt_tokens: int
    # Its interaction (declared, or recognized by its prompt): the lease of the interaction's
    # last answer ends, as on arrival here; and the answered prompt end it was recognized to
    # continue (lb.core.continuations). Empty from an instance of an earlier release.
    interaction: str = ""
    continued: bytes = b""
    adapter: str = ""  # the LoRA adapter it runs with (lb.core.adapters); empty: none, or an earlier release


@dataclass(frozen=True)
class HeardEnd:
    sender: str
    replica: str
    key: str
    # Where the replica's answer sits: the last block of the prompt it answered (empty: no
    # whole block, or not answered) and the answer's tokens, which a conversation's next turn
    # continues (`PrefixTrie.answered`). An instance of an earlier release sends neither.
    prompt_end: bytes = b""
    answer_tokens: int = 0


@dataclass(frozen=True)
class HeardLease:
    """Another instance's answered call: its lease on the replica (lb.core.leases.Answered) and
    the rank its interaction keeps in the fair queue (`anchor`, None where none is kept)."""

    sender: str
    replica: str
    answered: Answered
    anchor: float | None = None


def push_message(sender: str, replica: str, at: float, tokens: int, chain: str, key: str, prompt_tokens: int,
                 interaction: str = "", continued: bytes = b"", adapter: str = "") -> list:
    if len(interaction) > MAX_KEY_CHARS:
        interaction = ""
    message = [sender, replica, at, tokens, chain, key, prompt_tokens, interaction, continued.hex()]
    return message + [adapter] if adapter and len(adapter) <= MAX_KEY_CHARS else message


def lease_message(sender: str, replica: str, a: Answered, anchor: float | None = None) -> list | None:
    """None when there is nothing to share (an id too long to send). `anchor`: the rank the
    fair queue keeps for the interaction `a.key`, where it keeps one."""
    if len(a.key) > MAX_KEY_CHARS or len(a.user) > MAX_KEY_CHARS:
        return None
    message = [LEASE, sender, replica, a.key, a.tokens, a.ttl_s, a.end.hex(), a.short_size, a.user]
    return message if anchor is None else message + [anchor]


def end_message(sender: str, replica: str, key: str, prompt_end: bytes = b"", answer_tokens: int = 0) -> list:
    return [END, sender, replica, key, prompt_end.hex(), answer_tokens]


def parse_message(doc: object) -> HeardPush | HeardEnd | HeardLease | None:
    """What another instance published, or None for anything that is not a well-formed message
    (a peer of an earlier release sends a push's first five fields only)."""
    try:
        if not isinstance(doc, list):
            return None
        if doc and doc[0] == END:
            _, sender, replica, key, *answer = doc
            if not answer:  # an instance of an earlier release
                return HeardEnd(str(sender), str(replica), str(key))
            end, tokens = answer
            end, tokens = bytes.fromhex(end), int(tokens)
            if len(end) not in (0, HASH_BYTES) or tokens < 0:
                return None
            return HeardEnd(str(sender), str(replica), str(key), end, tokens)
        if doc and doc[0] == LEASE:
            _, sender, replica, key, tokens, ttl_s, end, short, user = doc[:9]
            tokens, ttl_s, end, short = int(tokens), float(ttl_s), bytes.fromhex(end), int(short)
            if (tokens < 0 or not (math.isfinite(ttl_s) and ttl_s >= 0) or len(end) not in (0, HASH_BYTES)
                    or short < 0 or not isinstance(key, str) or not isinstance(user, str)
                    or len(key) > MAX_KEY_CHARS or len(user) > MAX_KEY_CHARS):
                return None
            anchor = float(doc[9]) if len(doc) >= 10 else None
            if anchor is not None and not math.isfinite(anchor):
                return None
            return HeardLease(str(sender), str(replica), Answered(key, tokens, ttl_s, end, short, user), anchor)
        sender, replica, at, tokens, chain = doc[:5]
        key, prompt = (str(doc[5]), int(doc[6])) if len(doc) >= 7 else ("", 0)
        interaction, continued = (str(doc[7]), bytes.fromhex(doc[8])) if len(doc) >= 9 else ("", b"")
        at, tokens = float(at), int(tokens)
        if not (math.isfinite(at) and tokens >= 0 and prompt >= 0) or len(continued) not in (0, HASH_BYTES):
            return None
        adapter = doc[9] if len(doc) >= 10 and isinstance(doc[9], str) and len(doc[9]) <= MAX_KEY_CHARS else ""
        return HeardPush(str(sender), str(replica), at, tokens, decode_chain(chain), key, prompt,
                         interaction if len(interaction) <= MAX_KEY_CHARS else "", continued, adapter)
    except (ValueError, TypeError, OverflowError):
        return None


def heard_answer(trie: PrefixTrie, end: HeardEnd) -> None:
    """The other instance's replica answered: record where its answer sits, as that instance
    did, so that the conversation's next turn finds its history here too."""
    if end.prompt_end and end.answer_tokens > 0:
        trie.answered(end.replica, end.prompt_end, end.answer_tokens)


def heard_lease(leases: KvLeases, queue, heard: HeardLease, now: float) -> None:
    """The other instance's answered call: its lease holds here too, a next call arriving here
    that extends its prompt continues its interaction, and that call keeps the rank the
    interaction was let in at in the fair queue (`queue`), as if this instance had answered."""
    a = heard.answered
    leases.heard(heard.replica, a.key, a.tokens, a.ttl_s, now)
    if a.end:
        leases.continuations.heard_answer(a.end, a.key, a.user, now, a.short_size)
    if heard.anchor is not None:
        queue.heard_anchor(a.key, heard.anchor)


def heard_interaction(leases: KvLeases, push: HeardPush, now: float) -> None:
    """The other instance placed a call of an interaction: the lease its last answer held ends
    (the next call is here), and the answered prompt it continued counts as continued here too."""
    if push.interaction:
        leases.end(push.interaction)
    if push.continued:
        leases.continuations.heard_continued(push.continued, now)


def heard_prefill(trie: PrefixTrie, push: HeardPush, now: float) -> float:
    """The prompt tokens the other instance's push will prefill on its replica (the prompt past
    the prefix our trie says the replica holds; over the shared blocks, a fraction of a longer
    prompt's chain), after which our trie records that the replica holds its prefix too."""
    if not push.chain:
        return float(push.prompt_tokens)
    depth, _ = trie.match(push.chain, {push.replica})
    trie.insert(push.chain, push.replica, now)
    return uncached_tokens(push.prompt_tokens, depth, len(push.chain))
