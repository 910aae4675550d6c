"""The routers users would pick instead of `lb`, as policies for the simulator.

Each class models one published algorithm from its documentation and source (read, not
copied), with the defaults of the version the live comparisons run (`bench/systems.py`
pins sglang-router 0.3.2 and vllm-router 0.1.17; nginx is Debian's; llm-d's scheduler and
LiteLLM are modelled from their source, not run here). All of them push blindly: a request
is forwarded the moment it arrives and the engine queues it, so the only load a router
knows is what it counts itself (requests it sent and has not seen finish) or, for one that
polls the engines (`scrape_interval_s`), what its last scrape said.

Interface (`PeerPolicy`): `choose(req, workers, inflight, now) -> worker id` over every
healthy worker in the router's order, with `inflight[id]` the router's own open requests;
`bind(scrape)` once, where `scrape(id)` is the worker's (waiting, KV usage) as of the
router's last poll; `forget(id)` when a worker leaves. `req` is a `PeerRequest`: what the
router can read off the HTTP request (the prompt as tokens, the headers the live client
sends).

Known decisions of the routers installed here are pinned against the live router in
tests/bench/test_peer_policies_live.py; the others' in tests/bench/test_sim_compare.py,
against the rule their docstring quotes.
"""
from __future__ import annotations

import heapq
import random
import zlib
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import mmh3

from lb.core.prefix import known_depth


@dataclass(slots=True)
class PeerRequest:
    """What a router sees of one request (the live client's headers, bench/workloads/base.py)."""

    request_id: str  # X-Request-Id: the live client sends one per request
    tokens: Sequence[int]  # the rendered prompt, standing in for its text
    session: str | None = None  # X-LB-Session
    user: str | None = None  # X-LB-User and the body's `user`
    adapter: str | None = None  # the LoRA adapter its `model` names


Scrape = Callable[[str], tuple[int, float]]  # worker -> (requests waiting in its engine, KV usage 0..1)
# worker -> (LoRA adapters running, adapters waiting, how many one batch runs): vLLM's
# `vllm:lora_requests_info` as last scraped; nothing from an engine whose metrics name none
ScrapeLora = Callable[[str], tuple[frozenset, frozenset, int]]


class PeerPolicy(Protocol):
    name: str
    # how often the router polls each worker's engine metrics; None: it reads none (the front
    # then gives `bind` nothing to use)
    scrape_interval_s: float | None

    def bind(self, scrape: Scrape) -> None: ...

    def choose(self, req: PeerRequest, workers: Sequence[str], inflight: dict[str, int], now: float) -> str: ...

    def forget(self, worker: str) -> None: ...


class Blind:
    """The default of every model below: no engine metrics read, nothing kept per worker."""

    scrape_interval_s: float | None = None

    def bind(self, scrape: Scrape) -> None:
        pass

    def forget(self, worker: str) -> None:
        pass


# -- round robin --------------------------------------------------------------------------
class RoundRobin(Blind):
    """sglang-router 0.3.2 / vllm-router 0.1.17 `round_robin` (`policies/round_robin.rs`):
    an atomic counter taken modulo the number of healthy workers, in the router's worker
    order; load is never looked at."""

    name = "round_robin"

    def __init__(self, **_: object):
        self.counter = 0

    def choose(self, req, workers, inflight, now):
        worker = workers[self.counter % len(workers)]
        self.counter += 1
        return worker



# -- power of two -------------------------------------------------------------------------
class PowerOfTwo(Blind):
    """sglang-router 0.3.2 / vllm-router 0.1.17 `power_of_two` (`policies/power_of_two.rs`):
    two distinct healthy workers drawn uniformly at random, the one with the lower load wins
    (the first of the pair on a tie).

    Load, as each installed version behaves in front of the emulators (measured in
    tests/bench/test_peer_policies_live.py, one worker holding a long request):
    - vllm-router: its own in-flight count per worker (`load_source="inflight"`): it never
      picked the busy worker;
    - sglang-router: the loads its LoadMonitor caches from polling the workers, which win
      over its own counts and never separated the two workers in 20 s (the emulators answer
      `/get_load` in SGLang's list shape), so every pair is a tie and the pick is uniformly
      random (`load_source="polled-flat"`)."""

    name = "power_of_two"

    def __init__(self, *, seed: int = 0, load_source: str = "inflight", **_: object):
        self.rng = random.Random(seed)
        self.flat = load_source == "polled-flat"

    def choose(self, req, workers, inflight, now):
        if len(workers) == 1:
            return workers[0]
        a, b = self.rng.sample(range(len(workers)), 2)
        wa, wb = workers[a], workers[b]
        if self.flat:
            return wa
        return wa if inflight.get(wa, 0) <= inflight.get(wb, 0) else wb



def block_chain(tokens: Sequence[int], block: int, limit: int | None = None) -> list[int]:
    """The prompt's whole blocks of `block` tokens (at most `limit`), each named by a hash
    chained to the one before, so a block matches only after the same prefix."""
    n = len(tokens) // block if limit is None else min(len(tokens) // block, limit)
    out, prev = [], 0
    for i in range(0, n * block, block):
        prev = hash((prev, tuple(tokens[i:i + block])))
        out.append(prev)
    return out


# -- cache aware --------------------------------------------------------------------------
class _Node:
    __slots__ = ("key", "parent", "kids", "access")

    def __init__(self, key, parent):
        self.key, self.parent = key, parent
        self.kids: set[_Node] = set()
        self.access: dict[str, float] = {}  # tenant (worker) -> last access time


class ApproxTree:
    """The router's approximate radix tree (`policies/tree.rs`), multi-tenant: every node
    records which workers were sent a prompt through it and when. Here a node is a block of
    `block` tokens named by the chained hash of the prompt up to it (the router keys on
    characters; a 4-token block is ~16 characters, well under what its 0.3 threshold can
    tell apart). A tenant on a node is on all its ancestors, so the deepest matched node's
    tenants all hold the whole match."""

    def __init__(self, block: int = 4):
        self.block = block
        self.nodes: dict[int, _Node] = {}
        self.size: dict[str, int] = {}  # tenant -> tokens it holds (tenant_char_count / 4)

    def chain(self, tokens: Sequence[int]) -> list[int]:
        return block_chain(tokens, self.block)

    def add_tenant(self, tenant: str) -> None:
        self.size.setdefault(tenant, 0)

    def match(self, chain: list[int]) -> tuple[int, _Node | None]:
        """Blocks matched and the deepest matched node (the chain is prefix-closed)."""
        lo = known_depth(chain, self.nodes)
        return lo, (self.nodes[chain[lo - 1]] if lo else None)

    def insert(self, chain: list[int], tenant: str, now: float) -> None:
        self.add_tenant(tenant)
        parent = None
        for key in chain:
            node = self.nodes.get(key)
            if node is None:
                node = self.nodes[key] = _Node(key, parent)
                if parent is not None:
                    parent.kids.add(node)
            if tenant not in node.access:
                self.size[tenant] += self.block
            node.access[tenant] = now
            parent = node

    def touch(self, node: _Node | None, tenant: str, now: float) -> None:
        while node is not None:
            node.access[tenant] = now
            node = node.parent

    def _release(self, node: _Node, tenant: str) -> None:
        del node.access[tenant]
        self.size[tenant] -= self.block
        if not node.access and not node.kids:
            del self.nodes[node.key]
            if node.parent is not None:
                node.parent.kids.discard(node)

    def remove_tenant(self, tenant: str) -> None:
        for node in sorted((n for n in self.nodes.values() if tenant in n.access),
                           key=lambda n: -len(self._path(n))):
            self._release(node, tenant)
        self.size.pop(tenant, None)

    @staticmethod
    def _path(node: _Node) -> list[_Node]:
        out = []
        while node is not None:
            out.append(node)
            node = node.parent
        return out

    def _is_leaf(self, node: _Node, tenant: str) -> bool:
        return tenant in node.access and not any(tenant in k.access for k in node.kids)

    def evict(self, max_tokens: int) -> None:
        """`evict_tenant_by_size`: per tenant over budget, least recently used leaves first."""
        for tenant, size in list(self.size.items()):
            if size <= max_tokens:
                continue
            heap = [(n.access[tenant], id(n), n) for n in self.nodes.values() if self._is_leaf(n, tenant)]
            heapq.heapify(heap)
            while heap and self.size[tenant] > max_tokens:
                _, _, node = heapq.heappop(heap)
                parent = node.parent
                self._release(node, tenant)
                if parent is not None and self._is_leaf(parent, tenant):
                    heapq.heappush(heap, (parent.access[tenant], id(parent), parent))


class CacheAware(Blind):
    """sglang-router 0.3.2 `cache_aware` (`policies/cache_aware.rs`, `policies/tree.rs`); the
    vllm-router 0.1.17 one is the same algorithm (a fork) with its own eviction default.

    Imbalanced when max load - min load > balance_abs_threshold (64) and max load >
    balance_rel_threshold (1.5) x min load, loads being the router's in-flight counts over
    all workers: then the least loaded worker (first on ties), and the prompt is still
    inserted under it. Otherwise the longest prefix match in the tree: if matched / prompt
    length > cache_threshold (0.3), the deepest matched node's first tenant (hash order,
    not load), else the tenant with the smallest tree; the prompt is inserted under the
    choice. Eviction: every eviction_interval_secs (sglang-router 60, vllm-router 120)
    each worker's tree is cut back to max_tree_size characters (2^25), LRU leaves first.

    As both installed versions behave in front of the emulators (measured in
    tests/bench/test_peer_policies_live.py): workers registered at start-up are not put in
    the tree (they join through a background job, not `init_workers`), so a worker is a
    tenant only once a request was inserted under it. With no tenant at all the smallest
    tenant is none, and the router falls back to its first healthy worker without inserting;
    so while load is balanced every request that matches nothing goes to that one worker,
    and the others join the tree only through the imbalance branch."""

    name = "cache_aware"

    def __init__(self, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval_s: float = 60.0,
                 max_tree_chars: int = 1 << 25, chars_per_token: int = 4, block: int = 4, **_: object):
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs_threshold, balance_rel_threshold
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_tokens = max_tree_chars // chars_per_token
        self.tree = ApproxTree(block)
        self.next_eviction = eviction_interval_s

    def _first_tenant(self, tenants) -> str:
        # DashMap iteration order: fixed per key set, unrelated to load or recency
        return min(tenants, key=lambda t: mmh3.hash(t, signed=False))

    def choose(self, req, workers, inflight, now):
        tree = self.tree
        if now >= self.next_eviction:
            tree.evict(self.max_tree_tokens)
            self.next_eviction = now + self.eviction_interval_s
        chain = tree.chain(req.tokens)
        loads = [inflight.get(w, 0) for w in workers]
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            target = workers[loads.index(lo)]
            tree.insert(chain, target, now)
            return target
        depth, node = tree.match(chain)
        rate = depth * tree.block / len(req.tokens) if req.tokens else 0.0
        if rate > self.cache_threshold and node is not None and node.access:
            target = self._first_tenant(node.access)
            tree.touch(node, target, now)
        elif tree.size:
            target = min(tree.size, key=lambda w: (tree.size[w], mmh3.hash(w, signed=False)))
        else:
            return workers[0]  # no tenant yet: the first healthy worker, nothing inserted
        if target not in workers:
            tree.remove_tenant(target)
            return workers[0]
        tree.insert(chain, target, now)
        return target

    def forget(self, worker):
        self.tree.remove_tenant(worker)


# -- consistent hashing -------------------------------------------------------------------
class _Ring:
    def __init__(self, point: Callable[[str], int], points_per_worker: int, label: Callable[[str, int], str]):
        self.point, self.n, self.label = point, points_per_worker, label
        self.workers: tuple[str, ...] = ()
        self.points: list[int] = []
        self.owners: list[str] = []

    def owner(self, key: str, workers: Sequence[str]) -> str:
        if tuple(workers) != self.workers:  # rebuilt when the worker set changes, as both do
            pairs = sorted((self.point(self.label(w, i)), w) for w in workers for i in range(self.n))
            self.points = [p for p, _ in pairs]
            self.owners = [w for _, w in pairs]
            self.workers = tuple(workers)
        i = bisect_left(self.points, self.point(key))
        return self.owners[i % len(self.owners)]


class VllmConsistentHash(Blind):
    """vllm-router 0.1.17 `consistent_hash` (`policies/consistent_hash.rs`, `hash_key.rs`): a
    ring of 160 virtual nodes per worker; the key is the first header present of
    x-session-id, x-user-id, x-tenant-id, x-correlation-id, x-request-id, x-trace-id, then
    the body's session/user fields. The live client sends X-LB-Session/X-LB-User (not on
    that list) and an X-Request-Id per request, so the key is the request id: every
    request lands on an effectively random worker. Ring hash: mmh3 here (the router uses
    mcrouter's furc+murmur; only the spread matters for the model)."""

    name = "consistent_hash"

    def __init__(self, **_: object):
        self.ring = _Ring(lambda s: mmh3.hash64(s, signed=False)[0], 160, lambda w, i: f"{w}:{i}")

    def choose(self, req, workers, inflight, now):
        return self.ring.owner(f"header:x-request-id:{req.request_id}", workers)



class NginxHashConsistent(Blind):
    """nginx `hash $lb_session_key consistent` (ngx_http_upstream_hash_module, ketama): each
    server gets 160 points (weight 1) on a CRC32 ring, the key's CRC32 picks the first point
    at or after it, wrapping. The key is X-LB-Session, else the request id (the map in
    bench/systems.py), so a conversation or a tree stays on one replica whatever its load."""

    name = "hash-session"

    def __init__(self, **_: object):
        self.ring = _Ring(lambda s: zlib.crc32(s.encode()), 160, lambda w, i: f"{w}\0{i}")

    def choose(self, req, workers, inflight, now):
        return self.ring.owner(req.session or req.request_id, workers)



# -- least connections --------------------------------------------------------------------
class NginxLeastConn(Blind):
    """nginx `least_conn` (ngx_http_upstream_least_conn_module): the server with the fewest
    active connections (weights equal); among ties, weighted round robin, which for equal
    weights takes the tied servers in turn."""

    name = "least_conn"

    def __init__(self, **_: object):
        self.turn = 0

    def choose(self, req, workers, inflight, now):
        best = min(inflight.get(w, 0) for w in workers)
        tied = [w for w in workers if inflight.get(w, 0) == best]
        worker = tied[self.turn % len(tied)]
        self.turn += 1
        return worker



# -- llm-d ----------------------------------------------------------------------------------
class LlmdScorers(Blind):
    """llm-d's inference scheduler, the Gateway API Inference Extension endpoint picker (EPP),
    with its default scheduling profile (`defaultPluginsConfig` of GIE v1 and llm-d's
    "intelligent inference scheduling" well-lit path; read in the llm-d-inference-scheduler and
    gateway-api-inference-extension sources, 2025-2026):

    - `prefix-cache-scorer` (weight 3): the prompt in blocks of 16 tokens (vLLM's block; at
      most 256 blocks), each hash chained to the one before; the longest run of blocks from
      the start that the EPP's own index has for each server (`matchLongestPrefix`: walk the
      blocks until one no server has, counting each server's hits), over the blocks. The index
      is what the EPP itself sent where (`PreRequest` adds the chosen server under every block
      of the prompt), an LRU of 31,250 blocks per server; it never sees the engines' caches.
    - `queue-scorer` (weight 2): the engine's waiting requests, min-max normalised over the
      candidates ((max − q) / (max − min); 1 for all when they are equal).
    - `kv-cache-utilization-scorer` (weight 2): 1 − the engine's KV usage.

    The weighted sum's maximum wins (`max-score-picker`, which shuffles first, so ties are
    random). The metrics are what the EPP scraped from each engine's `/metrics`, every 50 ms by
    default (`--refresh-metrics-interval`): between two scrapes every pick sees the same
    queues, so a burst of siblings sees one picture. It pushes blindly: the EPP's flow control
    (holding requests while every pod is saturated) is off by default and sheds only requests
    marked sheddable, which the workloads here do not send."""

    name = "default-scorers"
    scrape_interval_s = 0.05

    def __init__(self, *, seed: int = 0, block: int = 16, max_blocks: int = 256, lru_blocks: int = 31_250,
                 prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0,
                 lora_weight: float = 1.0, **_: object):
        self.rng = random.Random(seed)
        self.block, self.max_blocks, self.lru_blocks = block, max_blocks, lru_blocks
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.lora_weight = lora_weight
        self.holders: dict[int, set[str]] = {}  # block hash -> servers the index has it for
        self.lru: dict[str, OrderedDict[int, None]] = {}  # server -> its block hashes, oldest first
        self.scrape: Scrape | None = None
        self.scrape_lora: ScrapeLora | None = None

    def bind(self, scrape: Scrape) -> None:
        self.scrape = scrape

    def bind_lora(self, scrape_lora: ScrapeLora) -> None:
        self.scrape_lora = scrape_lora

    def lora_score(self, adapter: str, worker: str) -> float:
        """`lora-affinity-scorer` (the profile a pool serving LoRA adapters enables it in, as
        KServe does for one; weight `lora_weight`): 1 where the adapter runs, 0.8 where a slot is
        free (running and waiting adapters together below the engine's `max_lora`), 0.6 where it
        waits, else 0."""
        running, waiting, limit = self.scrape_lora(worker)
        if adapter in running:
            return 1.0
        if len(running | waiting) < limit:
            return 0.8
        return 0.6 if adapter in waiting else 0.0

    def chain(self, tokens: Sequence[int]) -> list[int]:
        return block_chain(tokens, self.block, self.max_blocks)

    def matched(self, chain: list[int]) -> dict[str, int]:
        hits: dict[str, int] = {}
        for key in chain:
            servers = self.holders.get(key)
            if not servers:
                break
            for s in servers:
                hits[s] = hits.get(s, 0) + 1
        return hits

    def scores(self, chain: list[int], workers: Sequence[str]) -> dict[str, float]:
        """Each worker's weighted sum, as the profile adds the three scorers."""
        assert self.scrape is not None, "bind() the front's scrape before choosing"
        hits, total = self.matched(chain), len(chain)
        metrics = {w: self.scrape(w) for w in workers}
        queues = [q for q, _ in metrics.values()]
        lo, hi = min(queues), max(queues)
        wp, wq, wk = self.weights
        out = {}
        for w, (q, kv) in metrics.items():
            prefix = hits.get(w, 0) / total if total else 0.0
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            out[w] = wp * prefix + wq * queue + wk * (1.0 - min(1.0, max(0.0, kv)))
        return out

    def choose(self, req, workers, inflight, now):
        chain = self.chain(req.tokens)
        scores = self.scores(chain, workers)
        if req.adapter is not None and self.scrape_lora is not None:
            for w in workers:
                scores[w] += self.lora_weight * self.lora_score(req.adapter, w)
        order = list(workers)
        self.rng.shuffle(order)
        target = max(order, key=scores.__getitem__)  # the first of the shuffled maxima
        self._add(chain, target)
        return target

    def _add(self, chain: list[int], server: str) -> None:
        lru = self.lru.setdefault(server, OrderedDict())
        for key in chain:
            if key in lru:
                lru.move_to_end(key)
                continue
            lru[key] = None
            self.holders.setdefault(key, set()).add(server)
            if len(lru) > self.lru_blocks:
                old, _ = lru.popitem(last=False)
                self._drop(old, server)

    def _drop(self, key: int, server: str) -> None:
        servers = self.holders.get(key)
        if servers is not None:
            servers.discard(server)
            if not servers:
                del self.holders[key]

    def forget(self, worker):
        for key in self.lru.pop(worker, ()):
            self._drop(key, worker)


# -- LiteLLM --------------------------------------------------------------------------------
class LitellmShuffle(Blind):
    """LiteLLM Router `simple-shuffle`, its default `routing_strategy`
    (`router_strategy/simple_shuffle.py`): with no `weight`, `rpm` or `tpm` on the deployments
    (self-hosted replicas have none), `random.choice` over the healthy ones."""

    name = "simple-shuffle"

    def __init__(self, *, seed: int = 0, **_: object):
        self.rng = random.Random(seed)

    def choose(self, req, workers, inflight, now):
        return self.rng.choice(list(workers))


class LitellmLeastBusy(Blind):
    """LiteLLM Router `least-busy` (`router_strategy/least_busy.py`): a count per deployment, +1
    just before the call and −1 when it succeeds or fails (a stream: when it ends); the first
    deployment, in the order the counts were first recorded (the healthy list's order), with
    the strictly smallest count."""

    name = "least-busy"

    def __init__(self, **_: object):
        pass

    def choose(self, req, workers, inflight, now):
        return min(workers, key=lambda w: inflight.get(w, 0))


@dataclass(frozen=True)
class PeerSpec:
    """One peer system: its report name, the policy model, and that model's options."""

    name: str
    factory: Callable[..., PeerPolicy]
    options: dict = field(default_factory=dict)

    def build(self, seed: int) -> PeerPolicy:
        return self.factory(seed=seed, **self.options)


PEERS: dict[str, PeerSpec] = {s.name: s for s in (
    PeerSpec("sglang-router cache_aware", CacheAware, {"eviction_interval_s": 60.0}),
    PeerSpec("sglang-router power_of_two", PowerOfTwo, {"load_source": "polled-flat"}),
    PeerSpec("sglang-router round_robin", RoundRobin),
    PeerSpec("vllm-router cache_aware", CacheAware, {"eviction_interval_s": 120.0}),
    PeerSpec("vllm-router power_of_two", PowerOfTwo),
    PeerSpec("vllm-router round_robin", RoundRobin),
    PeerSpec("vllm-router consistent_hash", VllmConsistentHash),
    PeerSpec("nginx least_conn", NginxLeastConn),
    PeerSpec("nginx hash-session", NginxHashConsistent),
    PeerSpec("llm-d default-scorers", LlmdScorers),
    PeerSpec("litellm simple-shuffle", LitellmShuffle),
    PeerSpec("litellm least-busy", LitellmLeastBusy),
)}
