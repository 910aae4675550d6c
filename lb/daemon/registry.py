"""The one place replica state lives: views the core decides on, plus what the shell needs.

Dispatch, probes, the proxy, admin and reload all read and change replicas through this
registry, and it tells listeners (the dispatcher) whenever something that could make a
waiting request placeable has changed.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import aiohttp

from lb.core.breaker import Breaker, State
from lb.core.health import HealthTracker
from lb.core.pushing import pushed_samples, settle_completion, settle_end
from lb.core.types import ReplicaView, RequestFacts
from lb.daemon.config import Config, ReplicaConfig
from lb.daemon.tls import upstream_ssl

log = logging.getLogger("lb.registry")


@dataclass(eq=False)
class Replica:
    cfg: ReplicaConfig
    view: ReplicaView
    health: HealthTracker
    session: aiohttp.ClientSession  # keep-alive pool for requests (probes use their own)
    probe_endpoint: int = 0  # index of the load endpoint that last worked (adapters fall back)
    reprobe: asyncio.Event = field(default_factory=asyncio.Event)
    models_known: bool = False
    models_read_at: float = float("-inf")  # when /v1/models was last read (discovered models only)
    parents: dict = field(default_factory=dict)  # LoRA adapter -> its base model, as /v1/models says
    breaker: Breaker = field(default_factory=Breaker)  # request-path failures (lb.core.breaker)
    suspect: bool = False  # a request hung on it (lb.daemon.hung) and it has served none since
    source: str = ""  # a discovery source that owns it (e.g. "discovery[0]"); "": config file or admin API
    detected_at: float = 0.0  # when its engine was last detected (engine "auto"; lb.core.engines)
    first_tokens_absent_until: float = 0.0  # its metrics page had no first-token count (lb.daemon.probes)
    policy_known: str | None = None  # the engine whose queue order was last read (lb.daemon.probes._discover_policy)

    @property
    def id(self) -> str:
        return self.view.id


class Registry:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.replicas: dict[str, Replica] = {}
        self._listeners: list[Callable[[], None]] = []
        self._on_add: list[Callable[[Replica], None]] = []
        self._on_gone: list[Callable[[Replica], None]] = []
        # does an answer that just ended call for an early probe? (the scheduler's
        # `wants_probe`, set by the dispatcher; without one, always)
        self.wants_probe: Callable[[ReplicaView], bool] = lambda view: True
        # how many of a replica's requests have their first token back and have not ended (the
        # scheduler's `answering`, set by the dispatcher): none of them is on its way there
        self.answering: Callable[[str], int] = lambda replica_id: 0
        # pushes answered whole wait on it (the scheduler's `wants_first_tokens`): the probe reads
        # a first-token count its load endpoint lacks (lb.core.engines.first_tokens_source)
        self.wants_first_tokens: Callable[[str], bool] = lambda replica_id: False

    # -- listeners -------------------------------------------------------------------------
    def on_change(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def on_add(self, fn: Callable[[Replica], None]) -> None:
        self._on_add.append(fn)

    def on_gone(self, fn: Callable[[Replica], None]) -> None:
        self._on_gone.append(fn)

    def changed(self) -> None:
        for fn in self._listeners:
            fn()

    # -- queries ---------------------------------------------------------------------------
    def views(self) -> list[ReplicaView]:
        return [r.view for r in self.replicas.values()]

    def get(self, replica_id: str) -> Replica | None:
        return self.replicas.get(replica_id)

    def active(self) -> Iterable[Replica]:
        return (r for r in self.replicas.values() if not r.view.draining)

    def models(self) -> set[str]:
        return {m for r in self.active() for m in r.view.models}

    def parents(self) -> dict[str, str]:
        """Each LoRA adapter an active replica serves -> its base model."""
        return {a: p for r in self.active() for a, p in r.parents.items()}

    def is_adapter(self, model: str) -> bool:
        """True if some active replica serves `model` as a LoRA adapter (lb.core.adapters)."""
        return any(model in r.view.adapters for r in self.active())

    def lists_model(self, model: str) -> bool:
        """True if some active replica names `model` among the models it serves."""
        return any(model in r.view.models for r in self.active())

    def knows_model(self, model: str) -> bool:
        """True if some active replica serves `model` (or has not told us its models yet)."""
        return any(r.view.serves(model) for r in self.active())

    # -- changes ---------------------------------------------------------------------------
    def add(self, rc: ReplicaConfig, source: str = "") -> Replica:
        if rc.key in self.replicas and not self.replicas[rc.key].view.draining:
            raise KeyError(f"replica {rc.key!r} already exists")
        old = self.replicas.pop(rc.key, None)
        if old is not None:  # re-added while draining: the old entry finishes on its own
            self._finish(old)
        up = self.cfg.upstream
        session = aiohttp.ClientSession(
            base_url=rc.url,
            connector=aiohttp.TCPConnector(limit=up.max_connections_per_replica, keepalive_timeout=75,
                                           enable_cleanup_closed=True, ssl=upstream_ssl(self.cfg)),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=up.connect_timeout_s,
                                          sock_read=up.read_timeout_s),
            # We never ask for compression; a replica that compresses anyway is decoded (the
            # client gets plain bytes without the Content-Encoding, as it asked), bounded by aiohttp.
            auto_decompress=True, skip_auto_headers=("Accept-Encoding", "User-Agent"),
            # A proxy keeps no cookies: one set on one client's answer would go out with every
            # later client's request to that replica (and the jar's filtering costs each request).
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        view = ReplicaView(id=rc.key, url=rc.url, engine=rc.engine, models=frozenset(rc.models),
                           reports_pending=rc.engine != "openai",
                           healthy=False)  # until its first probe answers
        # Down until it answers, but its first good probe is enough: nothing to distrust yet.
        health = HealthTracker(self.cfg.probes.unhealthy_after, self.cfg.probes.healthy_after, healthy=False,
                               _oks=self.cfg.probes.healthy_after - 1)
        rep = Replica(cfg=rc, view=view, health=health, session=session, models_known=bool(rc.models),
                      breaker=Breaker(self.cfg.breaker), source=source)
        self.replicas[rc.key] = rep
        for fn in self._on_add:
            fn(rep)
        log.info("replica added: %s %s %s", rc.key, rc.engine, rc.url)
        self.changed()
        return rep

    def remove(self, replica_id: str) -> bool:
        """Drain: take nothing new, finish what is in flight, then forget it."""
        rep = self.replicas.get(replica_id)
        if rep is None or rep.view.draining:
            return False
        rep.view.draining = True
        log.info("replica draining: %s (%d in flight)", replica_id, rep.view.outstanding)
        if rep.view.outstanding == 0:
            self._finish(rep)
        self.changed()
        return True

    def apply(self, replicas: tuple[ReplicaConfig, ...]) -> tuple[list[str], list[str]]:
        """Make the replica set equal to `replicas` (config reload). Returns (added, removed).
        Replicas a discovery source owns are its own business: left as they are."""
        wanted = {rc.key: rc for rc in replicas}
        removed = [rid for rid, r in self.replicas.items() if not r.view.draining and not r.source
                   and (rid not in wanted or wanted[rid] != r.cfg)]
        for rid in removed:
            self.remove(rid)
        added = [rc.key for rc in replicas if rc.key not in self.replicas or self.replicas[rc.key].view.draining]
        for key in added:
            self.add(wanted[key])
        return added, [r for r in removed if r not in added]

    # -- request accounting (pushes are counted by the scheduler: lb.core.pushing.record_push) --
    def completed(self, rep: Replica, facts: RequestFacts | None = None) -> None:
        """Our request `facts` on `rep` ended (None: one counted without its samples, a DIRECT
        call): it is given back as its push counted it (`lb.core.pushing.pushed_samples`)."""
        samples = 1 if facts is None else pushed_samples(rep.view, facts.samples)
        settle_end(rep.view, samples)
        if rep.view.draining and rep.view.outstanding == 0:
            self._finish(rep)
        self.ended(rep, samples)

    def ended(self, rep: Replica, samples: int = 1) -> None:
        """A request on `rep` ended, ours or another LB instance's (lb.daemon.instances), with
        `samples` answers (the API's `n`): the engine admits as many it kept waiting, and its
        freed KV may take more."""
        settle_completion(rep.view, samples)
        if self.wants_probe(rep.view):  # a finished request frees KV: its waiting ones may be admitted now
            rep.reprobe.set()
        self.changed()

    def outcome(self, rep: Replica, ok: bool, why: str = "") -> None:
        """One request's fate on `rep` for its circuit breaker: failed (5xx, timeout, broken
        or malformed stream) or served."""
        changed = rep.breaker.record(ok, time.monotonic())
        if ok:
            rep.suspect = False
        if changed is State.OPEN:
            log.warning("replica %s circuit OPEN after %s: no requests for a while", rep.id, why or "failures")
        elif changed is State.CLOSED:
            log.info("replica %s circuit closed: it served a request again", rep.id)
            self.changed()

    def failed_hard(self, rep: Replica) -> None:
        """The request path could not even connect: out of rotation until probes say so."""
        if rep.view.healthy:
            log.warning("replica %s marked down: connection failed", rep.id)
        rep.health.mark_down()
        rep.view.healthy = False
        self.changed()

    def _finish(self, rep: Replica) -> None:
        if self.replicas.get(rep.id) is rep:
            del self.replicas[rep.id]
        for fn in self._on_gone:
            fn(rep)
        asyncio.get_running_loop().create_task(rep.session.close())
        log.info("replica removed: %s", rep.id)

    async def close(self) -> None:
        for rep in list(self.replicas.values()):
            for fn in self._on_gone:
                fn(rep)
            await rep.session.close()
        self.replicas.clear()
