"""Cross-region peering decisions (SkyWalker §4): which peer LB, if any, takes a request.

Pure: the daemon's peer probes fill `PeerStatus`, the dispatcher asks `local_or_peer` when a
request has no local replica, and `adoption_action` says when to take over (and give back)
a dead peer's replicas. Nothing here does I/O or reads a clock.

A peer is *available* for a model when its last status is fresh (younger than
`stale_intervals` probe intervals), it is healthy, it has at least one non-full replica for
the model that we have not already used up with forwards since that status, and its queue is
at most τ. Dispatch is SkyWalker's Algorithm 1: local replica if any is available, else an
available peer, else wait in the local queue. A request that already crossed one LB
(`hops >= 1`) is only ever placed locally: no loops, no ping-pong.

On top of it (`forward = "predicted"`, the default), `predicted_peer` forwards a request that
*has* a local replica when a peer's predicted TTFT plus the round trip beats the local one
by a margin (`lb.core.backlog`: the prediction; docs/peering.md: why and the margin).
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Iterable, Iterator, Sequence

from lb.core.backlog import forward_cost, land_on_least, parse_advert, remote_ttft
from lb.core.policies import ConsistentHash, load, pick_best, prefix_trie
from lb.core.prefix import request_chain, uncached_tokens
from lb.core.types import ReplicaView, RequestFacts

PEER_POLICIES = ("prefix-trie", "consistent-hash", "nearest")
# overflow: SkyWalker's Algorithm 1 only (forward what no local replica can take);
# predicted: also forward when a peer's predicted TTFT plus the round trip beats the local one
FORWARD_MODES = ("predicted", "overflow")
# Peer queue length at which it stops taking overflow (SkyWalker: "small"). 8, not 2: where
# every region is busy, a bound of 2 kept the busiest region's overflow home while its peers'
# queues held a few requests each (three regions at 1.3x, 5 seeds x 600 s, with lighter_peer:
# 92.1 [83.8, 93.3] -> 95.3 [89.0, 95.9] req/s, TTFT p90 1.9 s -> 641 ms; 1.1x 454 -> 441 ms;
# 2 seeds x 300 s at 1.3x: 4 gave 94.9/95.4 req/s, 8 95.8/95.5, 16 95.8/95.4; docs/results.md).
# Requests with a local replica free never overflow, so below capacity it rarely matters.
DEFAULT_TAU = 8
# lighter_peer: a request new here moves to a peer replica carrying at most this share of the
# local choice's load, and at least this many requests fewer (below it a batch decodes at
# about the same pace, and the round trip is all the move adds)
LIGHTER_SHARE = 0.5
MIN_LIGHTER_GAP = 4
MAX_UNSEEN = 256  # our forwards remembered per peer until a status has seen them


@dataclass(frozen=True)
class PeerConfig:
    """One `[[peers]]` entry."""

    region: str
    url: str
    # Residency tags this peer may receive. Untagged requests may go to any peer; a request
    # tagged T only to peers listing T (or "*").
    allowed_residency: tuple[str, ...] = ()
    adopt: bool = False  # take over its replicas when it stays down for `adopt_after_s`


@dataclass(frozen=True)
class PeeringConfig:
    """The `[peering]` section."""

    region: str = "local"
    secret: str = ""  # shared by all peers (or env LB_PEER_SECRET); empty disables peering
    probe_interval_s: float = 0.1
    probe_timeout_s: float = 0.1  # floor of the RTT-derived probe timeout (probe_timeout): a hung LAN peer fails in ~one interval
    probe_timeout_rtts: float = 3.0  # a probe times out after this many smoothed round trips (at least probe_timeout_s)
    probe_timeout_max_s: float = 2.0  # cap of the RTT-derived timeout, and the first probe's (no RTT measured yet)
    stale_intervals: int = 3  # a status older than this many probe cycles (interval, or the RTT if longer): unavailable
    tau: int = DEFAULT_TAU  # a peer whose LB queue (plus our forwards it has not counted) holds more than this takes no overflow; holder follows ignore it
    policy: str = "prefix-trie"  # prefix-trie | consistent-hash | nearest
    forward: str = "predicted"  # predicted | overflow (Algorithm 1 only): when a request with a local replica goes to a peer
    forward_margin_s: float = 0.0  # seconds a peer must win by beyond the predictions' own measured error
    lighter_share: float = LIGHTER_SHARE  # a request new here goes to a peer whose least-loaded replica carries at most this share of the local choice's load (lighter_peer); 0: off
    adopt_after_s: float = 5.0  # grace period before adopting a dead peer's replicas
    max_clock_skew_s: float = 30.0  # signed peer requests older/newer than this are refused
    max_nonces: int = 100_000  # peer-call nonces remembered inside the skew window (replays refused); beyond: 401 until some expire
    seed: int = 0
    tls_ca_file: str = ""  # CA bundle trusted for https:// peers (empty: the system's)
    tls_client_cert: str = ""  # client certificate presented to peers (mTLS: their server.tls_client_ca)
    tls_client_key: str = ""  # its private key; empty: in tls_client_cert

    @classmethod
    def from_dict(cls, data: dict, path: str = "peering") -> "PeeringConfig":
        names = {f.name: f for f in fields(cls)}
        kwargs = {}
        for key, value in data.items():
            if key not in names:
                raise ValueError(f"{path}.{key}: unknown key; known keys: {', '.join(sorted(names))}")
            default = names[key].default
            number_ok = isinstance(default, float) and isinstance(value, int)
            if isinstance(value, bool) or not (isinstance(value, type(default)) or number_ok):
                raise ValueError(f"{path}.{key}: expected {type(default).__name__}, got {value!r}")
            kwargs[key] = float(value) if isinstance(default, float) else value
        cfg = cls(**kwargs)
        cfg.check(path)
        return cfg

    def check(self, path: str = "peering") -> None:
        for key in ("probe_interval_s", "probe_timeout_s", "probe_timeout_rtts", "probe_timeout_max_s", "stale_intervals", "adopt_after_s", "max_clock_skew_s",
                    "max_nonces"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{path}.{key}: must be > 0, got {getattr(self, key)}")
        if self.probe_timeout_max_s < self.probe_timeout_s:
            raise ValueError(f"{path}.probe_timeout_max_s: {self.probe_timeout_max_s} is below probe_timeout_s "
                             f"({self.probe_timeout_s}); raise it to at least that")
        if self.tau < 0:
            raise ValueError(f"{path}.tau: must be >= 0, got {self.tau}")
        if self.forward not in FORWARD_MODES:
            raise ValueError(f"{path}.forward: {self.forward!r} is not allowed; use one of: {', '.join(FORWARD_MODES)}")
        if not 0 <= self.lighter_share < 1:
            raise ValueError(f"{path}.lighter_share: must be >= 0 and < 1 (0 turns it off), got {self.lighter_share}")
        if not self.forward_margin_s >= 0:
            raise ValueError(f"{path}.forward_margin_s: must be >= 0, got {self.forward_margin_s}")
        if self.policy not in PEER_POLICIES:
            raise ValueError(f"{path}.policy: {self.policy!r} is not allowed; use one of: {', '.join(PEER_POLICIES)}")
        if not self.region:
            raise ValueError(f"{path}.region: must not be empty")


def peers_from_list(value: object, path: str = "peers") -> tuple[PeerConfig, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{path}: write each peer as a [[peers]] table with region and url")
    out: list[PeerConfig] = []
    for i, item in enumerate(value):
        p = f"{path}[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{p}: expected a table, got {item!r}")
        unknown = set(item) - {f.name for f in fields(PeerConfig)}
        if unknown:
            raise ValueError(f"{p}.{sorted(unknown)[0]}: unknown key; known keys: region, url, allowed_residency, adopt")
        for key in ("region", "url"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise ValueError(f"{p}.{key}: required, a non-empty string")
        if not item["url"].startswith(("http://", "https://")):
            raise ValueError(f"{p}.url: {item['url']!r} is not an http(s) URL")
        allowed = item.get("allowed_residency", [])
        if isinstance(allowed, str):
            allowed = [allowed]
        if not isinstance(allowed, list) or not all(isinstance(t, str) for t in allowed):
            raise ValueError(f"{p}.allowed_residency: expected a list of strings, got {allowed!r}")
        adopt = item.get("adopt", False)
        if not isinstance(adopt, bool):
            raise ValueError(f"{p}.adopt: expected true or false, got {adopt!r}")
        if any(o.region == item["region"] for o in out):
            raise ValueError(f"{p}.region: duplicate peer region {item['region']!r}")
        out.append(PeerConfig(item["region"], item["url"].rstrip("/"), tuple(allowed), adopt))
    return tuple(out)


def parse_peer_arg(text: str) -> tuple[str, str]:
    """`--peer NAME=URL` → (NAME, URL)."""
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--peer wants NAME=URL (e.g. eu=http://10.1.0.5:8080), got {text!r}")
    return name, url.rstrip("/")


@dataclass
class PeerStatus:
    """What we know of one peer LB, from its last status answer and our own forwards."""

    region: str
    healthy: bool = False  # its last status answered and said it has a healthy replica
    queue_len: int = 0
    free: dict[str, int] = field(default_factory=dict)  # model → replicas that would take one more
    models: frozenset[str] = frozenset()
    running: int = 0
    rtt_s: float | None = None  # smoothed probe round trip
    failures: int = 0  # consecutive failed probes (each doubles the next probe's timeout)
    fresh_s: float | None = None  # how long its status stays fresh over this link (`fresh_for`); None: the caller's
    last_ok_at: float | None = None
    down_since: float | None = None  # first failed probe of the current outage
    forwarded_since_status: int = 0  # our forwards its last status cannot have counted
    in_flight: int = 0  # our forwards to it not finished yet
    ttft: dict[str, dict] = field(default_factory=dict)  # model → its TTFT advert (lb.core.backlog)
    # (sent at, model, uncached tokens) of our forwards its last status cannot have counted
    unseen: deque = field(default_factory=lambda: deque(maxlen=MAX_UNSEEN))

    def record_status(self, doc: dict, rtt_s: float, now: float, alpha: float = 0.3,
                      sent_at: float | None = None) -> None:
        """A status answer (the peer's `/lb/peer/status` JSON) arrived after `rtt_s`; the
        probe left at `sent_at` (None: now), so our forwards sent before then are in it."""
        self.healthy = bool(doc.get("healthy"))
        self.queue_len = int(doc.get("queue_len", 0))
        free = doc.get("free") or {}
        self.free = {str(m): int(n) for m, n in free.items()} if isinstance(free, dict) else {}
        self.models = frozenset(str(m) for m in doc.get("models") or ())
        self.running = int(doc.get("running", 0))
        self.rtt_s = rtt_s if self.rtt_s is None else (1 - alpha) * self.rtt_s + alpha * rtt_s
        self.last_ok_at = now
        self.down_since = None
        self.failures = 0
        self.forwarded_since_status = 0
        adverts = doc.get("ttft")
        self.ttft = {}
        if isinstance(adverts, dict):
            for m, a in list(adverts.items())[:64]:  # bounded: a peer cannot make us hold more
                parsed = parse_advert(a)
                if parsed is not None:
                    self.ttft[str(m)] = parsed
        cut = now if sent_at is None else sent_at
        while self.unseen and self.unseen[0][0] <= cut:
            self.unseen.popleft()

    def forwarded(self, now: float, model: str, tokens: float) -> None:
        """We forwarded a request of `tokens` prompt tokens to it now."""
        self.forwarded_since_status += 1
        self.unseen.append((now, model, tokens))

    def predict_ttft(self, model: str, tokens: float) -> tuple[float, float] | None:
        """(Its predicted TTFT for a forward of `tokens` prompt tokens, that prediction's
        error) from its last advert and our forwards it has not seen; None when it offers
        no replica for `model` (or has no fitted prediction yet). Excludes the round trip."""
        advert = self.ttft.get(model) if model else min(
            self.ttft.values(), key=lambda a: min(a["ahead"] or [math.inf]), default=None)
        if advert is None:
            return None
        ttft = remote_ttft(advert, tokens, [t for _, m, t in self.unseen if m == model or not model])
        return None if ttft is None else (ttft, advert["error_s"])

    def least_load(self, model: str) -> float | None:
        """The load (`lb.core.policies.load`) of its least-loaded replica that takes `model` now,
        from its last advert plus our forwards it has not seen (each landed on the least-loaded
        one, as its own routing would); None when its advert offers none or carries no loads."""
        adverts = [self.ttft[model]] if model in self.ttft else [] if model else list(self.ttft.values())
        loads = min((list(a["load"]) for a in adverts if a.get("load")), key=min, default=None)
        if not loads:
            return None
        return min(land_on_least(loads, [1 for _, m, _ in self.unseen if m == model or not model]))

    def record_failure(self, now: float) -> None:
        self.healthy = False
        self.failures += 1
        if self.down_since is None:
            self.down_since = now

    def record_forward_failure(self) -> None:
        """A forward to it failed before the first byte (refused, reset, 502/503/504): it is
        not available until a status answers good again (`record_status`). Not an outage:
        its replicas are not adopted for this."""
        self.healthy = False

    def serves(self, model: str) -> bool:
        """A request naming no model (SGLang's /generate) takes any replica's own model."""
        return not model or not self.models or model in self.models


def residency_allows(tag: str | None, allowed: Sequence[str]) -> bool:
    """Untagged traffic may go anywhere; tagged traffic only where its tag is allowed."""
    return tag is None or tag in allowed or "*" in allowed


def probe_timeout(pc: PeeringConfig, rtt_s: float | None, failures: int = 0) -> float:
    """The next status probe's timeout over a link whose smoothed round trip is `rtt_s`.

    A fixed timeout below the link's RTT would fail every probe, so the peer would never be
    seen (100-200 ms one way is common between continents). `probe_timeout_rtts` RTTs leave room
    for jitter and the peer's own work; the floor keeps LAN timeouts from chasing a sub-ms RTT;
    doubling per consecutive failure lets a link that got slower be measured again (as TCP's
    RTO backs off) instead of timing out forever; the cap bounds how long a hung peer holds a
    probe. With no measurement yet the first probe waits up to the cap."""
    if rtt_s is None:
        return pc.probe_timeout_max_s
    base = max(pc.probe_timeout_s, pc.probe_timeout_rtts * rtt_s)
    return min(pc.probe_timeout_max_s, base * 2 ** min(failures, 16))


def fresh_for(pc: PeeringConfig, rtt_s: float | None) -> float:
    """How long a status stays fresh: `stale_intervals` probe cycles, where a cycle is the probe
    interval or, over a link slower than it, one round trip (the next probe starts when the
    last one answers)."""
    return pc.stale_intervals * max(pc.probe_interval_s, rtt_s or 0.0)


def peer_fresh(st: PeerStatus, *, now: float, stale_s: float) -> bool:
    """Healthy at a status young enough to act on. `stale_s`: the staleness limit at
    interval-long probe cycles; a slow link's own (`st.fresh_s`) may be longer."""
    return st.healthy and st.last_ok_at is not None and now - st.last_ok_at <= max(stale_s, st.fresh_s or 0.0)


def peer_queue_open(st: PeerStatus, *, tau: int, now: float, stale_s: float) -> bool:
    """Fresh, and its queue plus our forwards its status has not counted at most τ."""
    return peer_fresh(st, now=now, stale_s=stale_s) and st.queue_len + st.forwarded_since_status <= tau


def peer_available(st: PeerStatus, model: str, *, tau: int, now: float, stale_s: float) -> bool:
    """Algorithm 1's available peer: its queue is open and it has a replica free for `model`."""
    if not peer_queue_open(st, tau=tau, now=now, stale_s=stale_s):
        return False
    free = st.free.get(model, 0) if model else sum(st.free.values())
    return free - st.forwarded_since_status >= 1


class PeerRouter:
    """Chooses among available peers with the same policy family as local routing.

    `prefix-trie` runs over the *remote snapshot trie*: the prefixes this LB forwarded to
    each region (keyed on region names), so a conversation keeps going to the region whose
    replicas hold its KV cache. `consistent-hash` walks a ring of LB regions. `nearest`
    takes the lowest measured RTT. Load breaks ties in each.
    """

    def __init__(self, policy: str = "prefix-trie", *, seed: int = 0):
        if policy not in PEER_POLICIES:
            raise ValueError(f"unknown peer policy {policy!r}; choose one of {', '.join(PEER_POLICIES)}")
        self.name = policy
        self.rng = random.Random(seed)
        self.inner = (prefix_trie(rng=self.rng) if policy == "prefix-trie"
                      else ConsistentHash(rng=self.rng) if policy == "consistent-hash" else None)
        self.regions: list[str] = []

    @staticmethod
    def view(st: PeerStatus) -> ReplicaView:
        """A peer as a routing target: its queue counts as pending, our forwards as outstanding."""
        return ReplicaView(id=st.region, url="", engine="peer", models=st.models, region=st.region,
                           healthy=st.healthy, pending=st.queue_len, running=st.running,
                           outstanding=st.in_flight, pushed_since_probe=st.forwarded_since_status)

    def register(self, region: str) -> None:
        if region not in self.regions:
            self.regions.append(region)
        if self.inner is not None:
            self.inner.register(region)

    def uncached(self, req: RequestFacts) -> dict[str, float]:
        """The prompt tokens each peer region would compute for `req`: the prompt less the
        prefix this LB already forwarded there (the snapshot trie), so a tree or conversation
        whose earlier calls went to a region is predicted as the cache hit it is there. The
        whole prompt where nothing is remembered (consistent-hash, nearest)."""
        prompt = float(max(1, req.prompt_tokens))
        memory = self.inner.prefix_memory if self.inner is not None else None
        chain = request_chain(req, memory.block_chars, memory.isolate_tenants) if memory is not None else None
        if not chain:
            return dict.fromkeys(self.regions, prompt)
        depths = memory.trie.depths(chain, self.regions)
        return {r: uncached_tokens(prompt, depths[r], len(chain)) for r in self.regions}

    def choose(self, req: RequestFacts, candidates: Sequence[PeerStatus], now: float) -> str | None:
        if not candidates:
            return None
        if self.inner is None:  # nearest
            rtt = {st.region: st.rtt_s if st.rtt_s is not None else float("inf") for st in candidates}
            best = pick_best([self.view(st) for st in candidates], lambda v: (-rtt[v.id], -load(v)), self.rng)
            return best.id if best else None
        return self.inner.choose(req, [self.view(st) for st in candidates], now)

    def observe(self, req: RequestFacts, region: str, now: float) -> None:
        """We forwarded `req` to `region`: the snapshot trie learns its prefix is there now."""
        if self.inner is not None:
            self.inner.observe(req, region, now)


@dataclass
class PeerDecision:
    kind: str  # local | peer | wait
    region: str | None = None
    residency_blocked: tuple[str, ...] = ()  # available peers the request's tag ruled out


def local_or_peer(req: RequestFacts, *, local_available: bool, peers: Sequence[tuple[PeerConfig, PeerStatus]],
           router: PeerRouter, tau: int, now: float, stale_s: float,
           exclude: frozenset[str] = frozenset()) -> PeerDecision:
    """SkyWalker Algorithm 1: local if possible, else an available peer, else wait."""
    if local_available:
        return PeerDecision("local")
    if req.hops >= 1:  # forwarded to us: our replicas only
        return PeerDecision("wait")
    available = ((pc, st) for pc, st in peers
                 if st.region not in exclude and st.serves(req.model)
                 and peer_available(st, req.model, tau=tau, now=now, stale_s=stale_s))
    return _routed(req, available, router, now, otherwise="wait")


def _routed(req: RequestFacts, passing: Iterable[tuple[PeerConfig, PeerStatus]], router: PeerRouter,
            now: float, *, otherwise: str) -> PeerDecision:
    """The router's pick among the peers that passed a caller's tests and whose residency rules
    allow the request (those they rule out are reported); `otherwise` where none is left."""
    candidates, blocked = [], []
    for pc, st in passing:
        if residency_allows(req.residency, pc.allowed_residency):
            candidates.append(st)
        else:
            blocked.append(pc.region)
    region = router.choose(req, candidates, now)
    return PeerDecision("peer" if region else otherwise, region, tuple(blocked))


def holder_peer(req: RequestFacts, region: str, *, peers: Sequence[tuple[PeerConfig, PeerStatus]],
                now: float, stale_s: float, exclude: frozenset[str] = frozenset()) -> PeerDecision:
    """Follow a prefix: `region` holds much more of the request's prompt than any local
    replica (`AffinityScheduler.across_regions`). It goes there if that peer is fresh, serves
    the model and the residency tag allows it, however long its queue: queued beside its
    cache it computes the rest of the prompt, not all of it, and keeps its tree in one region.
    τ does not apply: it keeps overflow (requests with nothing cached anywhere) off a busy
    peer, and bounding the follow by it too sent the later calls of forwarded trees back home
    to recompute their context (three regions at 1.3x, 2 seeds x 300 s: 89.3/86.4 req/s with
    τ = 2, 93.5/88.1 with 8, 94.4/90.7 with 16, 94.7/90.4 with 64 and with none). The peer's
    own admission (its queue bound) still applies. Else "wait" (Algorithm 1 decides)."""
    if req.hops >= 1 or region in exclude:
        return PeerDecision("wait")
    for pc, st in peers:
        if (st.region == region and st.serves(req.model) and peer_fresh(st, now=now, stale_s=stale_s)
                and residency_allows(req.residency, pc.allowed_residency)):
            return PeerDecision("peer", region)
    return PeerDecision("wait")


def open_peers(req: RequestFacts, peers: Sequence[tuple[PeerConfig, PeerStatus]], *, tau: int, now: float,
               stale_s: float, exclude: frozenset[str]) -> Iterator[tuple[PeerConfig, PeerStatus]]:
    """The peers that may take a request a local replica would take (`predicted_peer`,
    `lighter_peer`): not already failed on, serving its model, queue at most τ, fresh. The
    residency tag is each caller's last check, so it reports only the peers it ruled out."""
    for pc, st in peers:
        if (st.region not in exclude and st.serves(req.model) and st.queue_len <= tau
                and peer_fresh(st, now=now, stale_s=stale_s)):
            yield pc, st


def predicted_peer(req: RequestFacts, *, local_ttft: float, local_error: float,
                   peers: Sequence[tuple[PeerConfig, PeerStatus]], router: PeerRouter, tau: int, now: float,
                   stale_s: float, margin_s: float = 0.0, exclude: frozenset[str] = frozenset(),
                   remote_tokens: dict[str, float] | None = None) -> PeerDecision:
    """Forward by predicted TTFT: a request a local replica would take (predicted `local_ttft`
    there, with that prediction's typical error `local_error`) goes to a peer whose predicted
    TTFT plus the round trip is lower by more than the margin: the two predictions' combined
    error (a smaller gain cannot be told from noise) plus `margin_s`. Else "local".
    A peer's prediction is for the tokens it would compute (`remote_tokens`, by region:
    `PeerRouter.uncached`), else for the whole prompt.

    Only a fresh, healthy peer with its own queue at most τ, that serves the model, offers a
    replica in its advert and that the request's residency tag allows; the router picks among
    those that win, so a conversation keeps going to the region that holds its prefix."""
    if req.hops >= 1:
        return PeerDecision("local")
    tokens = max(1, req.prompt_tokens)

    def faster(st: PeerStatus) -> bool:
        if st.rtt_s is None:
            return False
        remote = st.predict_ttft(req.model, remote_tokens.get(st.region, tokens) if remote_tokens else tokens)
        return remote is not None and forward_cost(st.rtt_s, remote[0], local_error, remote[1]) + margin_s < local_ttft

    winners = ((pc, st) for pc, st in open_peers(req, peers, tau=tau, now=now, stale_s=stale_s, exclude=exclude)
               if faster(st))
    return _routed(req, winners, router, now, otherwise="local")


def may_lighten(local_load: float, share: float) -> bool:
    """Could `lighter_peer` move anything off a local replica carrying `local_load`? (A cheap
    precondition: a caller skips reading its peers when not.)"""
    return share > 0 and local_load >= MIN_LIGHTER_GAP


def lighter_peer(req: RequestFacts, local_load: float, *, peers: Sequence[tuple[PeerConfig, PeerStatus]],
                 tau: int, now: float, stale_s: float, share: float,
                 exclude: frozenset[str] = frozenset()) -> PeerDecision:
    """Balance new work across regions: a request a local replica carrying `local_load` would
    take, with little of its prompt cached here (the caller's test), goes to a peer whose
    least-loaded replica carries at most `share` of that load and `MIN_LIGHTER_GAP` requests
    fewer. Else "local".

    Why: selective pushing fills the busy region's replicas to their KV room before anything
    leaves it, and the predicted-TTFT forward weighs first tokens only. A full batch decodes
    slower and evicts more cached prefixes: three regions at 1.1x (arrivals 2:1:1) ran 164/149
    requests at once on us's replicas and 79 on asia's, 168 against 114 ms per output token.
    A request with nothing cached here loses only the round trip by starting its tree where
    there is room (its later calls follow it: `Scheduler._follow`). Measured (three regions, 5
    seeds x 600 s, with τ 8, docs/results.md): TTFT p90 at 0.9x 417 -> 369 ms, 1.1x 548 -> 441
    ms, 1.3x 3.9 s -> 641 ms and 88.5 -> 95.3 req/s. Swept over 2 seeds x 300 s: a share of
    0.9 moved more and cost light loads the round trip (0.5x 292/297 -> 370/361 ms, at 0.5
    316/327); 0.25 moved too little to help at 1.3x; moving requests whose context is cached
    here as well split trees (1.1x 695/693 ms, cache hit 0.91 -> 0.86).

    Only a fresh, healthy peer with its queue at most τ, serving the model, whose advert
    carries its replicas' loads, and that the request's residency tag allows; the lightest of
    those takes it (the peer router's prefix and region-wide load say nothing for a request
    new to every region)."""
    if req.hops >= 1 or not may_lighten(local_load, share):
        return PeerDecision("local")
    candidates: dict[str, float] = {}  # region → its least load
    blocked = []
    for pc, st in open_peers(req, peers, tau=tau, now=now, stale_s=stale_s, exclude=exclude):
        least = st.least_load(req.model)
        if least is None or least > share * local_load or least > local_load - MIN_LIGHTER_GAP:
            continue
        if not residency_allows(req.residency, pc.allowed_residency):
            blocked.append(pc.region)
            continue
        candidates[st.region] = least
    region = min(candidates, key=candidates.__getitem__, default=None)
    return PeerDecision("peer" if region else "local", region, tuple(blocked))


def adoption_action(pc: PeerConfig, st: PeerStatus, adopted: bool, *, now: float, grace_s: float) -> str | None:
    """`adopt` once a peer marked `adopt` has been down for the grace period; `give-back`
    once it answers again. None: nothing to change."""
    if not adopted and pc.adopt and st.down_since is not None and now - st.down_since >= grace_s:
        return "adopt"
    if adopted and st.down_since is None and st.last_ok_at is not None:
        return "give-back"
    return None


def apply_peer_args(peering: PeeringConfig, peers: tuple[PeerConfig, ...], region: str | None,
                    peer_args: Sequence[str] | None) -> tuple[PeeringConfig, tuple[PeerConfig, ...]]:
    """`--region NAME --peer NAME=URL ...` over the file: `--peer` replaces the file's peers of
    the same region (keeping their residency/adopt settings) and adds new ones."""
    from dataclasses import replace
    if region:
        peering = replace(peering, region=region)
    if peer_args:
        by_region = {p.region: p for p in peers}
        for text in peer_args:
            name, url = parse_peer_arg(text)
            by_region[name] = replace(by_region[name], url=url) if name in by_region else PeerConfig(name, url)
        peers = tuple(by_region.values())
    return peering, peers
