"""Peer load balancers: status endpoint, 100 ms peer probes (timeouts follow each link's
RTT: lb.core.peering.probe_timeout), forwarding hooks, failover.

Each peer is a `Replica` whose view has `engine="peer"`: the dispatcher hands it to the
proxy like any replica when no local one can take a request (SkyWalker
Algorithm 1 in `lb.core.peering.local_or_peer`, called by `lb.core.scheduler`), so forwarding reuses the streaming proxy as is —
bytes flow replica → remote LB → this LB → client as they come, a failure before the first
byte retries locally or on another peer, and a client that leaves closes both hops.

Peer calls carry `x-lb-peer-region`, `x-lb-peer-ts`, `x-lb-peer-nonce` and `x-lb-peer-sig` =
HMAC-SHA256 under the shared secret (`peering.secret` or env `LB_PEER_SECRET`) of region,
timestamp, nonce, method, path, body hash and the identity headers (lb.core.peer_auth); a
nonce is accepted once inside the skew window (docs/security.md: the threat model). A request that carries `x-lb-peer-sig` and fails the check is refused
(401); without it, `x-lb-hop` and any other `x-lb-peer-*` header are ignored (and never
forwarded), so a client cannot pose as a peer and make an LB skip its forwarding rules. An authenticated forward (`x-lb-hop: 1`) is only ever
placed on local replicas.
"""
from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from lb.core.facts import H_APP, H_FINAL_CALL, H_HOP, H_INTERACTION_ID, H_INTERACTION_STAGE, H_RESIDENCY, H_SESSION, H_TIER, H_USER
from lb.core.health import HealthTracker
from lb.core.peer_auth import STREAMED, Nonces, PeerAuthError, body_hash, check_timestamp, signature
from lb.core.peering import (PeerConfig, PeerRouter, PeerStatus, adoption_action, fresh_for, peer_available,
                             probe_timeout)
from lb.core.scheduler import PeerSet, PeerTarget
from lb.core.types import ReplicaView, RequestFacts
from lb.daemon.config import Config, ReplicaConfig
from lb.daemon.errors import LBError
from lb.daemon.registry import Registry, Replica
from lb.daemon.tls import peer_ssl

log = logging.getLogger("lb.peers")

STATUS_PATH = "/lb/peer/status"
H_PEER_REGION = "x-lb-peer-region"
H_PEER_TS = "x-lb-peer-ts"
H_PEER_SIG = "x-lb-peer-sig"
H_PEER_NONCE = "x-lb-peer-nonce"
PEER_PREFIX = "peer:"
# The client's identity headers travel with a forward so the remote LB's fairness, tiers and
# consistent hashing see the same request.
CARRIED = (H_USER, H_SESSION, H_APP, H_INTERACTION_ID, H_INTERACTION_STAGE, H_FINAL_CALL, H_TIER, H_RESIDENCY)
_carried: contextvars.ContextVar[dict] = contextvars.ContextVar("lb_peer_carried", default={})
SIGNED_IDENTITY = CARRIED + (H_HOP,)  # a forward's identity headers: signed, so not re-labelled


def _identity(headers) -> dict[str, str]:
    return {h: headers.get(h) for h in SIGNED_IDENTITY if headers.get(h) is not None}


def _body_sha256(body) -> str:
    return body_hash(body) if isinstance(body, (bytes, bytearray)) or body is None else STREAMED


def auth_headers(secret: str, region: str, method: str, path: str, now_wall: float | None = None, *,
                 body=b"", identity: dict[str, str] | None = None) -> dict[str, str]:
    """The signing headers of one peer call; `identity`: the identity headers it carries."""
    ts = f"{time.time() if now_wall is None else now_wall:.3f}"
    nonce = secrets.token_hex(16)
    sig = signature(secret, region=region, ts=ts, nonce=nonce, method=method, path=path,
                    body_sha256=_body_sha256(body), identity=identity or {})
    return {H_PEER_REGION: region, H_PEER_TS: ts, H_PEER_NONCE: nonce, H_PEER_SIG: sig}


def verify(secret: str, headers, method: str, path: str, max_skew_s: float, nonces: Nonces, *, body=b"",
           now_wall: float | None = None) -> str:
    """The calling peer's region, or LBError 401 (lb.core.peer_auth says what is checked)."""
    if not secret:
        raise LBError(401, "peer calls are disabled here: set peering.secret or LB_PEER_SECRET", code="peer_auth_disabled")
    region, ts, sig, nonce = (headers.get(h) for h in (H_PEER_REGION, H_PEER_TS, H_PEER_SIG, H_PEER_NONCE))
    if not (region and ts and sig and nonce):
        raise LBError(401, f"peer call without {H_PEER_REGION}, {H_PEER_TS}, {H_PEER_NONCE} and {H_PEER_SIG}",
                      code="invalid_peer_auth")
    now = time.time() if now_wall is None else now_wall
    try:
        signed_at = check_timestamp(ts, now, max_skew_s)
        want = signature(secret, region=region, ts=ts, nonce=nonce, method=method, path=path,
                         body_sha256=_body_sha256(body), identity=_identity(headers))
        if not hmac.compare_digest(sig.encode(), want.encode()):
            raise PeerAuthError("signature does not match the shared secret, this body and these headers")
        nonces.use(nonce, signed_at, now)  # only a verified call spends room in the window
    except PeerAuthError as e:
        raise LBError(401, f"peer call refused: {e}", code="invalid_peer_auth") from None
    return region


@dataclass(eq=False)
class PeerLink:
    cfg: PeerConfig
    status: PeerStatus
    target: Replica  # what the proxy streams through
    replicas: list[dict] = field(default_factory=list)  # its own replicas, as last reported
    adopted: list[str] = field(default_factory=list)  # their ids in our registry while adopted


class Peers:
    def __init__(self, cfg: Config, registry: Registry, dispatcher, metrics):
        self.cfg = cfg
        self.pc = cfg.peering
        self.registry = registry
        self.dispatcher = dispatcher
        self.router = PeerRouter(self.pc.policy, seed=self.pc.seed)
        self.links: dict[str, PeerLink] = {}
        self.nonces = Nonces(self.pc.max_clock_skew_s, self.pc.max_nonces)  # replays refused
        # what the scheduler offers work to (lb.core.scheduler.PeerSet), filled at start()
        self.peer_set = PeerSet([], self.router, tau=self.pc.tau,
                                stale_s=self.pc.stale_intervals * self.pc.probe_interval_s,
                                forward=self.pc.forward, margin_s=self.pc.forward_margin_s,
                                lighter_share=self.pc.lighter_share)
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        self._blocked_seen: OrderedDict[str, None] = OrderedDict()  # count a blocked request once
        r = metrics.registry
        self.forwards = Counter("lb_peer_forwards", "Requests forwarded to a peer LB, by peer and outcome",
                                ["peer", "outcome"], registry=r)
        self.received = Counter("lb_peer_received", "Forwarded requests received from a peer LB", ["peer"], registry=r)
        self.residency_blocked = Counter("lb_peer_residency_blocked",
                                         "Requests not forwarded to an available peer because their residency tag forbids it",
                                         ["peer", "residency"], registry=r)
        self.auth_failures = Counter("lb_peer_auth_failures", "Peer calls refused: bad or missing signature",
                                     ["endpoint"], registry=r)
        r.register(_PeerCollector(self))
        if cfg.peers and not self.pc.secret:
            log.warning("peers configured but no shared secret (peering.secret / LB_PEER_SECRET): peers will refuse us")
        dispatcher.overflow = self

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ssl=peer_ssl(self.cfg)),
            timeout=aiohttp.ClientTimeout(total=self.pc.probe_timeout_max_s), skip_auto_headers=("User-Agent",))
        for pcfg in self.cfg.peers:
            link = PeerLink(pcfg, PeerStatus(pcfg.region), self._target(pcfg))
            self.links[pcfg.region] = link
            self.peer_set.targets = [*self.peer_set.targets, PeerTarget(pcfg, link.status, link.target.view, link.target)]
            self.router.register(pcfg.region)
            self.tasks.append(asyncio.get_running_loop().create_task(self._probe_loop(link), name=f"peer:{pcfg.region}"))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for link in self.links.values():
            await link.target.session.close()
        if self.session:
            await self.session.close()

    def _target(self, pcfg: PeerConfig) -> Replica:
        up = self.cfg.upstream
        session = aiohttp.ClientSession(
            base_url=pcfg.url,
            connector=aiohttp.TCPConnector(limit=up.max_connections_per_replica, keepalive_timeout=75,
                                           ssl=peer_ssl(self.cfg)),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=up.connect_timeout_s, sock_read=up.read_timeout_s),
            auto_decompress=False, skip_auto_headers=("Accept-Encoding", "User-Agent"),
            cookie_jar=aiohttp.DummyCookieJar())  # one client's cookies are never sent with another's request
        rid = PEER_PREFIX + pcfg.region
        view = ReplicaView(id=rid, url=pcfg.url, engine="peer", region=pcfg.region, healthy=False)
        health = HealthTracker(1, 1, healthy=False)  # peers' freshness is judged by PeerStatus
        return Replica(cfg=ReplicaConfig(url=pcfg.url, id=rid), view=view, health=health, session=session)

    # -- the dispatcher's side ---------------------------------------------------------------
    def residency_refused(self, facts: RequestFacts, regions: tuple[str, ...]) -> None:
        """An available peer was ruled out by the request's residency tag (counted once a request)."""
        if facts.request_id in self._blocked_seen:
            return
        self._blocked_seen[facts.request_id] = None
        if len(self._blocked_seen) > 10_000:
            self._blocked_seen.popitem(last=False)
        for region in regions:
            self.residency_blocked.labels(region, facts.residency or "").inc()

    # -- the proxy's side ------------------------------------------------------------------
    def inbound(self, request: web.Request, facts: RequestFacts, body=b"") -> RequestFacts:
        """Authenticate a forward from a peer (signed over `body` too); everything else is a
        client's request (hops 0)."""
        given = request.headers  # case-insensitive: no lower-cased copy for a client's request
        _carried.set({h: given[h] for h in CARRIED if h in given})
        if H_PEER_SIG not in given:
            return facts  # a client: its own x-lb-hop or other x-lb-peer-* headers mean nothing
        headers = {k.lower(): v for k, v in given.items()}
        try:
            region = verify(self.pc.secret, headers, request.method, request.path_qs, self.pc.max_clock_skew_s,
                            self.nonces, body=body)
        except LBError:
            self.auth_failures.labels("forward").inc()
            raise
        self.received.labels(region).inc()
        try:
            hops = max(1, int(headers.get(H_HOP, "1")))
        except ValueError:
            hops = 1
        return replace(facts, hops=hops)

    def serves(self, facts: RequestFacts, accepts) -> bool:
        """Could a peer take this request (so no local healthy replica is not the end)?"""
        return facts.hops == 0 and any(link.target.view.healthy and link.status.serves(facts.model)
                                       and accepts(link.target.view) for link in self.links.values())

    def outbound_headers(self, headers: dict, method: str, path: str, body) -> dict:
        """A forward's headers: the identity it carries, the hop mark, and the signature over
        them, the method, the path (query included) and `body` (bytes; else a streamed upload)."""
        identity = {**_carried.get(), H_HOP: "1"}
        return {**headers, **identity, **auth_headers(self.pc.secret, self.pc.region, method, path, body=body,
                                                      identity=_identity(identity))}

    def forward_failed(self, target: Replica, reason: str) -> None:
        """A forward failed before the first byte (the proxy retries it locally or on another
        peer): that peer takes nothing more until its next good status."""
        link = self.links.get(target.view.region)
        if link is None or link.target is not target:
            return
        link.status.record_forward_failure()
        target.view.healthy = False
        log.warning("peer %s failed a forward before the first byte (%s): unavailable until its next good status",
                    link.cfg.region, reason)

    def account(self, out) -> None:
        if not out.target.startswith(PEER_PREFIX):
            return
        outcome = "ok" if 200 <= out.status < 300 else "cancelled" if out.status == 499 else f"http_{out.status}"
        self.forwards.labels(out.target[len(PEER_PREFIX):], outcome).inc()

    # -- the status endpoint -----------------------------------------------------------------
    def status_doc(self) -> dict:
        adopted = {rid for link in self.links.values() for rid in link.adopted}
        free: dict[str, int] = {}
        running, healthy = 0, False
        for rep in self.registry.active():
            v = rep.view
            healthy = healthy or v.healthy
            running += v.running
            if self.dispatcher.available(v):
                for m in v.models:
                    free[m] = free.get(m, 0) + 1
        own = [{"id": r.id, "url": r.cfg.url, "engine": r.view.engine, "models": sorted(r.view.models)}
               for r in self.registry.active() if r.id not in adopted]
        return {"region": self.pc.region, "healthy": healthy, "queue_len": len(self.dispatcher.queue),
                "free": free, "models": sorted(self.registry.models()), "running": running,
                "ttft": self.dispatcher.scheduler.advertise(self.registry.active(), time.monotonic()),
                "replicas": own, "ts": round(time.time(), 3)}

    async def handle_status(self, request: web.Request) -> web.Response:
        try:
            verify(self.pc.secret, request.headers, request.method, request.path_qs, self.pc.max_clock_skew_s,
                   self.nonces)
        except LBError:
            self.auth_failures.labels("status").inc()
            raise  # answered by lb.daemon.errors.answer_errors
        return web.Response(body=orjson.dumps(self.status_doc()), content_type="application/json")

    # -- probes and failover -------------------------------------------------------------------
    async def _probe_loop(self, link: PeerLink) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.probe_once(link)
            except asyncio.CancelledError:
                raise
            except Exception:  # a probe must never kill its loop
                log.exception("peer probe of %s crashed", link.cfg.region)
            await asyncio.sleep(max(0.0, started + self.pc.probe_interval_s - loop.time()))

    async def probe_once(self, link: PeerLink) -> None:
        assert self.session is not None
        t0 = time.monotonic()
        doc = None
        timeout = aiohttp.ClientTimeout(total=probe_timeout(self.pc, link.status.rtt_s, link.status.failures))
        try:
            async with self.session.get(link.cfg.url + STATUS_PATH, timeout=timeout, headers=auth_headers(
                    self.pc.secret, self.pc.region, "GET", STATUS_PATH)) as r:
                body = await r.read()
                if r.status == 200:
                    doc = orjson.loads(body)
                else:
                    log.debug("peer %s status: HTTP %d %s", link.cfg.region, r.status, body[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.debug("peer %s probe failed: %s: %s", link.cfg.region, type(e).__name__, e)
        now = time.monotonic()
        st, view = link.status, link.target.view
        was = st.healthy
        if isinstance(doc, dict):
            st.record_status(doc, now - t0, now, sent_at=t0)
            st.fresh_s = fresh_for(self.pc, st.rtt_s)
            link.replicas = [r for r in doc.get("replicas") or () if isinstance(r, dict) and r.get("url")]
            view.models, view.pending, view.running = st.models, st.queue_len, st.running
            view.pushed_since_probe = 0
            view.last_probe_at = t0
        else:
            st.record_failure(now)
        view.healthy = st.healthy
        link.target.health.record(st.healthy)
        if was != st.healthy:
            log.warning("peer %s is now %s", link.cfg.region, "available" if st.healthy else "UNAVAILABLE")
        self._failover(link, now)
        self.dispatcher.wake()

    def _failover(self, link: PeerLink, now: float) -> None:
        action = adoption_action(link.cfg, link.status, bool(link.adopted), now=now, grace_s=self.pc.adopt_after_s)
        if action == "adopt":
            for r in link.replicas:
                rc = ReplicaConfig(url=r["url"], engine=r.get("engine", "auto"), models=tuple(r.get("models") or ()),
                                   id=f"{link.cfg.region}@{r.get('id') or r['url']}")
                try:
                    self.registry.add(rc)
                except KeyError:
                    continue
                link.adopted.append(rc.key)
            log.warning("peer %s down for %.1fs: adopted its replicas %s", link.cfg.region,
                        now - (link.status.down_since or now), link.adopted or "(none known)")
        elif action == "give-back":
            log.warning("peer %s is back: giving back %s", link.cfg.region, link.adopted)
            for rid in link.adopted:
                self.registry.remove(rid)
            link.adopted = []


class _PeerCollector:
    def __init__(self, peers: Peers):
        self.peers = peers

    def describe(self):
        return []

    def collect(self):
        p = self.peers
        fams = {
            "available": GaugeMetricFamily("lb_peer_available", "1 if the peer would take a forward now", labels=["peer"]),
            "healthy": GaugeMetricFamily("lb_peer_healthy", "1 if the peer's last status answered healthy", labels=["peer"]),
            "queue": GaugeMetricFamily("lb_peer_queue_length", "The peer's LB queue at its last status", labels=["peer"]),
            "rtt": GaugeMetricFamily("lb_peer_rtt_seconds", "Smoothed status round trip", labels=["peer"]),
            "adopted": GaugeMetricFamily("lb_peer_adopted_replicas", "The peer's replicas we serve while it is down",
                                         labels=["peer"]),
            "age": GaugeMetricFamily("lb_peer_status_age_seconds", "Time since the peer's last good status",
                                     labels=["peer"]),
        }
        now = time.monotonic()
        for region, link in p.links.items():
            st = link.status
            ok = link.target.view.healthy and peer_available(st, "", tau=p.pc.tau, now=now, stale_s=p.peer_set.stale_s)
            fams["available"].add_metric([region], 1.0 if ok else 0.0)
            fams["healthy"].add_metric([region], 1.0 if st.healthy else 0.0)
            fams["queue"].add_metric([region], st.queue_len)
            fams["rtt"].add_metric([region], st.rtt_s if st.rtt_s is not None else float("nan"))
            fams["adopted"].add_metric([region], len(link.adopted))
            fams["age"].add_metric([region], now - st.last_ok_at if st.last_ok_at is not None else float("inf"))
        return list(fams.values())
