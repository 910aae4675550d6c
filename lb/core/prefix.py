"""Prompt block hashing and the prefix trie that remembers which target served which prefix.

Block hashing: the prompt's UTF-8 bytes are cut into fixed blocks (128 by default, about 32
tokens) and each block's hash is mmh3 over (previous hash + block), so hash *i* names the
whole prefix up to block *i*. UTF-8 keeps this prefix-stable (the bytes of a prefix are a
prefix of the bytes), a trailing partial block is dropped (it would never match a longer
prompt), and the same text gives the same chain in every process: peers can exchange them.

Prefix-cache isolation (SkyWalker §7): when a salt is given (the tenant), the chain starts
from a hash of the salt instead of empty bytes, so two tenants' identical prompts share no
trie node. One tenant's routing, and the cache hits it earns, then reveal nothing of
another tenant's prompts.

Why the trie is a dict of chain hashes and not a pygtrie.Trie: because hash *i* already
names the entire path to node *i*, a flat dict keyed by chain hash *is* a trie (a "hash
trie"; node i's parent is chain[i-1]). That makes a longest-prefix walk a binary search over
dict lookups (pygtrie's `walk_towards` costs ~50 µs for a 128-block prompt, this ~8 µs) and
oldest-first eviction of a node O(1) instead of O(depth) to rebuild its key path. The
`trie-micro` scenario runs pygtrie as the store side by side with this one.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Collection, Sequence

import mmh3

from lb.core.types import RequestFacts

# 128 rather than 64: in `trie-micro` (8 kB prompts) it matched the same share of prompts
# (0.529 vs 0.530) at 0.65x the time per request and half the memory for the same text;
# 32 tokens of match granularity is noise next to the prompts routing cares about.
DEFAULT_BLOCK_CHARS = 128
DEFAULT_MAX_NODES = 100_000
# Answers remembered where they ended (`PrefixTrie.answered`): a bounded record, oldest dropped.
MAX_ANSWERS = 65_536
# Characters per token where the LB has no tokenizer (its prompt size estimate, and the
# blocks an engine's KV capacity in tokens amounts to): about 4 in English text.
CHARS_PER_TOKEN = 4

Chain = tuple[bytes, ...]


def block_hashes(text: str, block_chars: int = DEFAULT_BLOCK_CHARS, salt: str | None = None) -> Chain:
    """Chain of 16-byte block hashes of `text`; element i depends on blocks 0..i."""
    return _chain_of(text.encode("utf-8", "surrogatepass"), block_chars, salt)


def _chain_of(data: bytes, block_chars: int, salt: str | None) -> Chain:
    prev = mmh3.hash_bytes(b"lb-tenant:" + salt.encode("utf-8", "surrogatepass")) if salt is not None else b""
    chain = []
    hash_bytes = mmh3.hash_bytes
    for start in range(0, len(data) - block_chars + 1, block_chars):
        prev = hash_bytes(prev + data[start : start + block_chars])
        chain.append(prev)
    return tuple(chain)


_PROMPT_BYTES = "lb.prefix.prompt_bytes"


def chain_salt(req: RequestFacts, isolate_tenants: bool) -> str | None:
    """What a request's chain starts from: its tenant where tenants are isolated, and its LoRA
    adapter, whose KV no other adapter's request shares (lb.core.adapters); None for neither."""
    tenant = (req.user or "") if isolate_tenants else None
    if req.adapter is None:
        return tenant
    return f"lora:{req.adapter}" if tenant is None else f"lora:{req.adapter}\x00{tenant}"


def request_chain(req: RequestFacts, block_chars: int = DEFAULT_BLOCK_CHARS, isolate_tenants: bool = False) -> Chain:
    """The request's chain, hashed once and cached on the facts for every later caller (with
    the prompt's size in bytes, which `prompt_bytes` then reads without encoding it again)."""
    salt = chain_salt(req, isolate_tenants)
    key = ("lb.prefix.chain", block_chars, salt)
    chain = req.extra.get(key)
    if chain is None:
        data = req.prompt.encode("utf-8", "surrogatepass")
        req.extra[_PROMPT_BYTES] = len(data)
        chain = req.extra[key] = _chain_of(data, block_chars, salt)
    return chain


def prompt_bytes(req: RequestFacts) -> int:
    """The prompt's UTF-8 size (cached by `request_chain` when the request was hashed)."""
    size = req.extra.get(_PROMPT_BYTES)
    if size is None:
        size = req.extra[_PROMPT_BYTES] = len(req.prompt.encode("utf-8", "surrogatepass"))
    return size


# facts.extra: (the prompt's size, a function hashing its first n bytes) where the prompt is not
# text (the simulator's token prompts); `prompt_prefix_hash` and `prompt_size` read it first.
PREFIX_HASHER = "lb.prefix.hasher"


def prompt_size(req: RequestFacts) -> int:
    """The prompt's size in the units `prompt_prefix_hash` cuts (UTF-8 bytes)."""
    hasher = req.extra.get(PREFIX_HASHER)
    return hasher[0] if hasher is not None else prompt_bytes(req)


def prompt_prefix_hash(req: RequestFacts, n: int) -> bytes:
    """A hash naming the prompt's first `n` bytes, whatever the blocks: a prompt shorter than a
    block has no chain, yet a longer one may start with it (a chat's first turn, its next)."""
    hasher = req.extra.get(PREFIX_HASHER)
    if hasher is not None:
        return hasher[1](n)
    return mmh3.hash_bytes(b"lb-prefix:" + req.prompt[:n].encode("utf-8", "surrogatepass")[:n])


def uncached_tokens(prompt_tokens: float, depth: int, blocks: int) -> float:
    """The prompt tokens a target holding `depth` of the prompt's `blocks` chain blocks still
    computes (all of them when the prompt has no whole block)."""
    return prompt_tokens * (1.0 - depth / blocks) if blocks else float(prompt_tokens)


def known_depth(chain: Sequence, nodes: Collection) -> int:
    """How many leading blocks of `chain` are in `nodes`, by binary search: a trie holding a
    block holds every block before it, so membership is prefix-closed."""
    lo, hi = 0, len(chain)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chain[mid - 1] in nodes:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTrie:
    """Block-hash prefixes → the targets that served them, with last-use times.

    Target-agnostic: a target is any string (a replica id here, a peer region's name in a
    remote snapshot trie).

    Invariants: the nodes present are prefix-closed, and a target held by a node is held by
    all its ancestors, because `insert` writes the whole path and eviction only ever removes
    leaves (see `insert`). So "node i exists and holds a wanted target" is true down to some
    depth and false below it, and `match` finds that depth by binary search: 7 lookups for
    an 8 kB prompt's 128 blocks instead of 128 (8 µs instead of 22, measured).
    """

    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES):
        if max_nodes < 1:
            raise ValueError("max_nodes must be >= 1")
        self.max_nodes = max_nodes
        # chain hash → {target: last use}; iteration order is least recently used first
        self._nodes: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        self._held = Counter()  # target → number of nodes that hold it
        self.evictions = 0
        # A target whose cache size is known (`bound`) holds at most that many nodes: its own
        # least recently used first go, as the engine evicts them (chain hashes in use order).
        self._cap: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[bytes, None]] = {}
        # (target, the last block of a prompt it answered) → [the answer's tokens, the request that
        # claimed it]: the engine holds that answer after the prompt, which the blocks above
        # (prompts only) do not show
        self._answers: OrderedDict[tuple[str, bytes], list] = OrderedDict()

    def __len__(self) -> int:
        return len(self._nodes)

    def targets(self) -> set[str]:
        return set(self._held)

    def size_of(self, target: str) -> int:
        """Nodes that `target` holds: its share of the remembered cache."""
        return self._held.get(target, 0)

    def holders(self, prefix_hash: bytes) -> dict[str, float]:
        """Targets holding the prefix named by `prefix_hash`, with their last-use times."""
        return dict(self._nodes.get(prefix_hash) or {})

    def match(self, chain: Chain, wanted: Collection[str] | None = None) -> tuple[int, list[str]]:
        """Longest prefix of `chain` held by a target in `wanted` (any target when None).

        Returns (matched blocks, the wanted targets holding that whole prefix).
        """
        get = self._nodes.get
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            holders = get(chain[mid - 1])
            if holders is not None and (wanted is None or not wanted.isdisjoint(holders)):
                lo = mid
            else:
                hi = mid - 1
        if not lo:
            return 0, []
        return lo, [t for t in self._nodes[chain[lo - 1]] if wanted is None or t in wanted]

    def holders(self, block: bytes) -> Collection[str]:
        """The targets holding `block` (and every block before it in its chain)."""
        return self._nodes.get(block, ())

    def depths(self, chain: Chain, targets: Collection[str]) -> dict[str, int]:
        """Each target's own matched blocks of `chain` (0 for a target holding none of it):
        one `match` per distinct depth among the targets, deepest first, not one per target."""
        out = dict.fromkeys(targets, 0)
        left = set(out)
        while left and chain:
            depth, holders = self.match(chain, left)
            if not depth:
                break
            for t in holders:
                out[t] = depth
            left.difference_update(holders)
        return out

    def _known_depth(self, chain: Chain) -> int:
        """How many leading blocks of `chain` are nodes already."""
        return known_depth(chain, self._nodes)

    def insert(self, chain: Chain, target: str, now: float) -> None:
        """Record that `target` now holds every prefix of `chain`; evict oldest past the bound.

        The path is touched leaf first, so an ancestor is always used more recently than its
        descendants and least-recently-used eviction only ever removes leaves. (Touching only
        the deepest node and giving inner nodes a second chance at eviction was measured
        slower: its per-node bookkeeping costs more than the touches it saves.)
        """
        # Hot path (every dispatch): locals, one counter update instead of one per node, and
        # the new suffix found by binary search.
        nodes, touch = self._nodes, self._nodes.move_to_end
        known = self._known_depth(chain)
        for h in reversed(chain[known:]):
            nodes[h] = {target: now}
        gained = len(chain) - known
        for h in reversed(chain[:known]):
            holders = nodes[h]
            if target not in holders:
                gained += 1
            holders[target] = now
            touch(h)
        if gained:
            self._held[target] += gained
        lru = self._lru.get(target)
        if lru is not None:
            self._use(lru, chain)
            self._shrink(target, lru)
        excess = len(nodes) - self.max_nodes
        if excess > 0:
            held, pop, lrus = self._held, nodes.popitem, self._lru
            for _ in range(excess):
                h, holders = pop(False)
                for t in holders:
                    held[t] -= 1
                    if t in lrus:
                        lrus[t].pop(h, None)
            self.evictions += excess
            for t in [t for t, n in held.items() if n <= 0]:
                del held[t]

    def bound(self, target: str, max_nodes: int) -> None:
        """`target`'s cache holds about `max_nodes` blocks (its KV capacity, from its probes):
        remember at most that many for it, dropping its least recently used first. Without a
        bound the trie (100,000 nodes for all) believes a replica still holds prefixes its
        engine evicted long ago, and requests wait for a holder that recomputes them anyway."""
        max_nodes = max(1, max_nodes)
        if self._cap.get(target) == max_nodes:
            return
        self._cap[target] = max_nodes
        lru = self._lru.get(target)
        if lru is None:  # the global order is a use order too: leaves before their ancestors
            lru = self._lru[target] = OrderedDict((h, None) for h, holders in self._nodes.items() if target in holders)
        self._shrink(target, lru)

    @staticmethod
    def _use(lru: OrderedDict, chain: Chain) -> None:
        """Touch the path leaf first, as `insert` does, so a target's least recently used node
        is always one of its leaves."""
        touch = lru.move_to_end
        for h in reversed(chain):
            lru[h] = None
            touch(h)

    def _shrink(self, target: str, lru: OrderedDict) -> None:
        nodes, cap = self._nodes, self._cap[target]
        dropped = 0
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            holders = nodes.get(h)
            if holders is not None and holders.pop(target, None) is not None:
                dropped += 1
                if not holders:  # no other target holds it, so none holds a block below it either
                    del nodes[h]
        if dropped:
            self._held[target] -= dropped
            if self._held[target] <= 0:
                del self._held[target]

    def answered(self, target: str, end: bytes, tokens: int) -> None:
        """`target` answered, with `tokens` tokens, a prompt whose last block is `end`."""
        key = (target, end)
        self._answers[key] = [tokens, None]
        self._answers.move_to_end(key)
        while len(self._answers) > MAX_ANSWERS:
            self._answers.popitem(last=False)

    def answer_after(self, target: str, end: bytes, by: str, *, claim: bool = True, take: bool = False) -> int:
        """The tokens of the answer `target` gave after the prompt ending in block `end`, for
        request `by`: 0 when none is recorded or another request claimed it. One request
        continues an answer: a conversation's next turn, or the first of a tree's children to
        claim it (its siblings weigh the holder by its prompts alone, so a fan-out still
        spreads). `claim`: an unclaimed record becomes `by`'s (without it, only a record `by`
        already claimed counts). `take`: `by` was placed there, the record is spent."""
        key = (target, end)
        record = self._answers.get(key)
        if record is None:
            return 0
        if record[1] is None and claim:
            record[1] = by
        if record[1] != by:
            return 0
        if take:
            del self._answers[key]
        return record[0]

    def forget(self, target: str) -> None:
        """Remove `target` everywhere (O(nodes): targets leave rarely). Empty nodes go too."""
        for key in [k for k in self._answers if k[0] == target]:
            del self._answers[key]
        self._lru.pop(target, None)
        self._cap.pop(target, None)
        if target not in self._held:
            return
        emptied = []
        for h, holders in self._nodes.items():
            if holders.pop(target, None) is not None and not holders:
                emptied.append(h)
        for h in emptied:  # their descendants held only `target` too, so they go with them
            del self._nodes[h]
        del self._held[target]


class BytesPerToken:
    """The prompt bytes one token takes in this traffic, learned from the token counts the
    engines report (`usage.prompt_tokens`): a ratio of running sums, so long prompts count for
    more than the chat template's own tokens do in short ones. It turns an engine's KV size
    in tokens into the trie's 128-byte blocks: English prose is ~4 bytes a token, source code
    ~3, the emulator's short words 5-6, so a fixed guess bounds the trie up to half again too
    loose or too tight."""

    def __init__(self, alpha: float = 0.05):
        self.alpha = alpha
        self._bytes: float | None = None
        self._tokens: float | None = None

    def value(self) -> float:
        if not self._tokens:
            return float(CHARS_PER_TOKEN)  # ASCII text until an engine has said
        return self._bytes / self._tokens

    def observe(self, prompt_bytes: int, prompt_tokens: int) -> None:
        if prompt_bytes <= 0 or prompt_tokens <= 0:
            return
        if self._tokens is None:
            self._bytes, self._tokens = float(prompt_bytes), float(prompt_tokens)
            return
        self._bytes += self.alpha * (prompt_bytes - self._bytes)
        self._tokens += self.alpha * (prompt_tokens - self._tokens)


class TrieMemory:
    """The prefix memory cache-affine scheduling asks (`lb.core.types.PrefixMemory`), over a
    policy's trie; the policies that remember prefixes mix it in."""

    trie: PrefixTrie
    block_chars: int
    isolate_tenants: bool

    def affinity(self, req: RequestFacts, targets: Collection[str]) -> tuple[int, int, list[str]]:
        """(matched blocks, prompt blocks, holders): the longest prefix a target in `targets` holds."""
        chain = request_chain(req, self.block_chars, self.isolate_tenants)
        depth, holders = self.trie.match(chain, targets)
        return depth, len(chain), holders

    def opening_holders(self, req: RequestFacts) -> Collection[str]:
        """The targets holding the first block of `req`'s prompt: every match starts there."""
        chain = request_chain(req, self.block_chars, self.isolate_tenants)
        return self.trie.holders(chain[0]) if chain else ()

    def answered(self, req: RequestFacts, target_id: str, output_tokens: int) -> None:
        """`target_id` answered `req` with `output_tokens` tokens: its engine now holds them after
        the prompt, where a conversation's next turn (or a tree's child) continues."""
        end = self.prompt_end(req)
        if end and output_tokens > 0:
            self.trie.answered(target_id, end, output_tokens)

    def prompt_end(self, req: RequestFacts) -> bytes:
        """The last whole block of `req`'s prompt, where its answer is recorded (b"": none)."""
        chain = request_chain(req, self.block_chars, self.isolate_tenants)
        return chain[-1] if chain else b""

    def answer_after(self, req: RequestFacts, target_id: str, depth: int, *, claim: bool = True,
                     take: bool = False) -> int:
        """Tokens of an answer `target_id` gave right where `req`'s match there ends (`depth`
        blocks): `req` continues that answer, which the engine holds beyond the matched blocks
        (0 when another request claimed it first; `claim` and `take` as `PrefixTrie.answer_after`)."""
        if depth <= 0:
            return 0
        chain = request_chain(req, self.block_chars, self.isolate_tenants)
        return self.trie.answer_after(target_id, chain[depth - 1], req.request_id, claim=claim, take=take) if depth <= len(chain) else 0

    def cache_size(self, target_id: str, kv_tokens: int, bytes_per_token: float) -> None:
        """`target_id`'s engine holds `kv_tokens` of KV in all (its probes say): remember no
        more of its prefixes than fit there."""
        self.trie.bound(target_id, int(kv_tokens * bytes_per_token) // self.block_chars)

    def decode_step_s(self, target_id: str | None = None) -> float | None:
        """A trie learns no rates (`lb.core.predicted` does)."""
        return None

    def prefill_token_s(self) -> float | None:
        return None
