"""Engine adapters and the probe loop: every replica's pending/running/KV, every 100 ms.

One task per replica, off the request path (its own connection pool and timeouts). Each
engine has an ordered list of load endpoints (newest shape first, lb.core.engines); the adapter
remembers the one that answered and only falls back when it stops making sense (404, wrong
shape), not when the replica is down. A replica of `engine = "auto"` is told apart by those
endpoints' answers on its first good probe (lb.core.engines.engine_from_answers). A replica
whose load endpoints all fail but which answers its liveness endpoint stays usable with
LB-side outstanding counts only (`reports_pending = False`).

After a push the replica is re-probed early (`probes.early_reprobe_s`), so selective pushing
learns within milliseconds whether the request was admitted or queued.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable

import aiohttp
import orjson

from lb.core.engines import (KEEP_LAST, LIVENESS, LOAD_ENDPOINTS, first_tokens_source, SHAPE_ERRORS, Detected, detection_due, detection_paths,
                             engine_from_answers, queue_order_due)
from lb.core.loadparse import EngineLoad, lora_limit, orders_by_prefix
from lb.core.pushing import early_probe_delay, note_preemptions, probe_gap, settle_probe
from lb.daemon.config import ProbeConfig
from lb.daemon.registry import Registry, Replica
from lb.daemon.tls import upstream_ssl

log = logging.getLogger("lb.probes")

# where SGLang says its server arguments: current releases, then older ones
SERVER_INFO = ("/server_info", "/get_server_info")


class ProbeFailed(Exception):
    pass


class Prober:
    def __init__(self, registry: Registry, cfg: ProbeConfig, metrics=None):
        self.registry = registry
        self.cfg = cfg
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None
        self.tasks: dict[Replica, asyncio.Task] = {}
        # hear every good probe: (replica, its load or None, when the probe started)
        self.on_probe: list[Callable[[Replica, EngineLoad | None, float], None]] = []
        registry.on_add(self._start)
        registry.on_gone(self._stop)

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ssl=upstream_ssl(self.registry.cfg)),
            timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
            skip_auto_headers=("User-Agent",))
        for rep in list(self.registry.replicas.values()):
            self._start(rep)

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()
        if self.session:
            await self.session.close()

    def _start(self, rep: Replica) -> None:
        if self.session is not None and rep not in self.tasks:
            self.tasks[rep] = asyncio.get_running_loop().create_task(self._loop(rep), name=f"probe:{rep.id}")

    def _stop(self, rep: Replica) -> None:
        task = self.tasks.pop(rep, None)
        if task:
            task.cancel()

    async def _loop(self, rep: Replica) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            rep.reprobe.clear()  # pushes from here on ask for another probe
            try:
                await self.probe_once(rep)
            except asyncio.CancelledError:
                raise
            except Exception:  # a probe must never kill its loop
                log.exception("probe of %s crashed", rep.id)
            ended = loop.time()
            # the gap is asked again each interval: an idle replica that gets work is probed
            # at the fast pace from then on, not after the idle gap
            while (remaining := started + self._gap(rep) - loop.time()) > 0:
                if rep.reprobe.is_set():
                    # Give the pushed request time to reach the engine's scheduler first, and
                    # the engine time of its own between probes.
                    await asyncio.sleep(min(remaining, early_probe_delay(
                        self.cfg.early_reprobe_s, ended - started, loop.time() - ended, self.cfg.max_probe_share)))
                    break
                try:
                    await asyncio.wait_for(rep.reprobe.wait(), min(remaining, self.cfg.interval_s))
                except TimeoutError:
                    pass

    def _gap(self, rep: Replica) -> float:
        return probe_gap(rep.view, self.cfg.interval_s, self.cfg.idle_intervals,
                         health_steady=rep.health.steady, models_known=rep.models_known)

    async def _get(self, rep: Replica, path: str) -> bytes:
        assert self.session is not None
        try:
            async with self.session.get(rep.cfg.url + path, headers=_auth(rep)) as r:
                body = await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise ConnectionError(f"{path}: {type(e).__name__}: {e}") from e
        if r.status != 200:
            raise ProbeFailed(f"{path}: HTTP {r.status}")
        return body

    async def probe_once(self, rep: Replica) -> None:
        t0 = time.monotonic()
        view = rep.view
        outstanding_at_start = view.outstanding_samples  # as the engine counts (lb.core.pushing.settle_probe)
        answering_at_start = self.registry.answering(rep.id)
        others_at_start = len(view.remote_log)  # the other instances' pushes not answered (lb.daemon.instances)
        load: EngineLoad | None = None
        ok = False
        found: Detected | None = None
        try:
            engine = view.engine
            if detection_due(rep.cfg.engine, engine, view.reports_pending, rep.detected_at, t0, self.cfg.redetect_s):
                found = await self._detect(rep)
                engine, load = found.engine, found.load
            else:
                load = await self._read_load(rep, LOAD_ENDPOINTS.get(engine, []))
                if load is not None and load.first_tokens is None:
                    load = await self._with_first_tokens(rep, engine, load, t0)
            if load is None:
                await self._get(rep, LIVENESS.get(engine, "/health"))
            ok = True
            if found is not None:  # only an answering replica's engine is taken (not one mid-start-up)
                self._adopt(rep, found, t0)
        except (ConnectionError, ProbeFailed) as e:
            log.debug("probe %s failed: %s", rep.id, e)
        elapsed = time.monotonic() - t0
        if ok:
            view.probe_s = elapsed
        if ok and (not rep.models_known or (not rep.cfg.models and t0 - rep.models_read_at >= self.cfg.models_refresh_s)):
            await self._discover_models(rep, t0)  # before it turns healthy: /v1/models and /ready agree at once
        if ok and queue_order_due(view.engine, rep.policy_known, found is not None, view.healthy):
            await self._discover_policy(rep)
        was_healthy = view.healthy
        view.healthy = rep.health.record(ok)
        if ok:
            view.last_probe_at = t0
            view.reports_pending = load is not None
            if load is not None:
                view.pending = load.pending
                if load.running is not None:
                    view.running = load.running
                if load.kv_usage is not None:
                    view.kv_usage = load.kv_usage
                view.kv_free_tokens, view.max_running = load.kv_free_tokens, load.max_running
                view.kv_total_tokens, view.engine_first_tokens = load.kv_total_tokens, load.first_tokens
                note_preemptions(view, load.preemptions, t0, lately=load.retracted_lately, reserves=load.reserves)
                view.running_adapters = load.running_adapters or frozenset()
                if load.max_loras is not None:  # else what its server arguments said (`_discover_policy`)
                    view.max_loras = load.max_loras
            else:
                view.kv_free_tokens = view.max_running = view.kv_total_tokens = view.engine_first_tokens = None
            pending, running = (load.pending, load.running) if load is not None else (None, None)
            settle_probe(view, t0, outstanding_at_start, pending, running, self.cfg.early_reprobe_s,
                         answering_at_start, others_at_start)
            for fn in self.on_probe:
                fn(rep, load, t0)
        if view.healthy != was_healthy:
            log.warning("replica %s is now %s", rep.id, "healthy" if view.healthy else "UNHEALTHY")
        if self.metrics:
            self.metrics.probe_done(rep.id, elapsed, ok)
        self.registry.changed()

    async def _with_first_tokens(self, rep: Replica, engine: str, load: EngineLoad, now: float) -> EngineLoad:
        """`load` with the first tokens the engine counted where its load endpoint does not say
        (SGLang's /v1/loads), from where `first_tokens_source` says."""
        source = first_tokens_source(engine, self.registry.wants_first_tokens(rep.id),
                                     rep.first_tokens_absent_until, now)
        if source == KEEP_LAST:
            return dataclasses.replace(load, first_tokens=rep.view.engine_first_tokens)
        if source is None:
            return load
        page, parse = source
        try:
            count = parse(await self._get(rep, page)).first_tokens
        except (ConnectionError, ProbeFailed, *SHAPE_ERRORS) as e:  # the load was read: still a probe
            log.debug("probe %s %s: %s", rep.id, page, e)
            count = None
        if count is None:
            rep.first_tokens_absent_until = now + self.cfg.redetect_s
            return load
        return dataclasses.replace(load, first_tokens=count)

    async def _read_load(self, rep: Replica, endpoints: list) -> EngineLoad | None:
        order = list(range(len(endpoints)))
        order.sort(key=lambda i: i != rep.probe_endpoint)  # the one that worked last, first
        for i in order:
            path, parse = endpoints[i]
            try:
                load = parse(await self._get(rep, path))
                rep.probe_endpoint = i
                return load
            except (ProbeFailed, *SHAPE_ERRORS) as e:
                log.debug("probe %s %s: %s", rep.id, path, e)
        return None

    async def _detect(self, rep: Replica) -> Detected:
        """Read every adapter's load endpoints once: the engine is the one whose shape answered."""
        answers: dict[str, bytes | None] = {}
        for path in detection_paths():
            try:
                answers[path] = await self._get(rep, path)
            except ProbeFailed:
                answers[path] = None  # a 404 here is an answer too: not this engine's endpoint
        return engine_from_answers(answers)

    def _adopt(self, rep: Replica, found: Detected, now: float) -> None:
        rep.detected_at = now
        rep.probe_endpoint = found.endpoint
        if found.engine != rep.view.engine:
            log.info("replica %s runs %s (detected; `engine` in its config skips detection)", rep.id, found.engine)
            rep.view.engine = found.engine

    async def _discover_models(self, rep: Replica, now: float) -> None:
        rep.models_read_at = now
        try:
            doc = orjson.loads(await self._get(rep, "/v1/models"))
            cards = [m for m in doc["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (ConnectionError, ProbeFailed, ValueError, KeyError, TypeError):
            return  # not every engine lists models (e.g. /generate-only); serve any model
        rep.view.models = frozenset(m["id"] for m in cards)
        # a LoRA adapter's card names its base model as `parent` (vLLM, SGLang): lb.core.adapters
        rep.parents = {m["id"]: m["parent"] for m in cards if isinstance(m.get("parent"), str) and m["parent"]}
        rep.view.adapters = frozenset(rep.parents)
        rep.models_known = True

    async def _discover_policy(self, rep: Replica) -> None:
        """How the engine orders its waiting queue (`ReplicaView.orders_by_prefix`), from SGLang's
        server arguments (when: `queue_order_due`); other engines admit in arrival order. A
        replica that did not answer is asked again at its next probe."""
        view, ordered, loras = rep.view, False, None
        if view.engine == "sglang":
            for path in SERVER_INFO:
                try:
                    info = await self._get(rep, path)
                    ordered, loras = orders_by_prefix(info), lora_limit(info)
                except ConnectionError:
                    return
                except ProbeFailed:  # a release that serves the other path
                    continue
                except ValueError:  # not JSON: nothing said, arrival order
                    pass
                break
            view.max_loras = loras  # vLLM says its own at every probe (`vllm:lora_requests_info`)
        view.orders_by_prefix, rep.policy_known = ordered, view.engine


def _auth(rep: Replica) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {rep.cfg.api_key}"} if rep.cfg.api_key else None
