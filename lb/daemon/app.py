"""The aiohttp application: routes, admin, startup and graceful shutdown, SIGHUP reload.

`serve(cfg)` runs one region's LB on uvloop until SIGTERM/SIGINT; in-flight requests get
`server.shutdown_grace_s` to finish and whatever still waits in the LB queue is answered 503.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import resource
import signal
import socket
import sys
import time
from dataclasses import fields, replace
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from lb.core import cors
from lb.core.policies import make_policy
from lb.core.urls import denied, parse_deny
from lb.daemon import config as config_mod
from lb.daemon.capacity import Capacity
from lb.daemon.gate import add_response_headers
from lb.daemon.config import Config, ConfigError
from lb.daemon.discovery import Discovery
from lb.daemon.dispatch import Dispatcher
from lb.daemon.errors import LBError, answer_errors, error_body
from lb.daemon.fairness import TenantCollector
from lb.daemon.instances import SharedPushes
from lb.daemon.jobs import add_routes as add_job_routes
from lb.daemon.metrics import Metrics
from lb.daemon.peer_links import STATUS_PATH as PEER_STATUS_PATH, Peers
from lb.daemon.probes import Prober
from lb.daemon.proxy import Proxy
from lb.daemon.registry import Registry
from lb.daemon.surface import add_routes as add_api_routes
from lb.daemon import gctune, loopwatch, tls

log = logging.getLogger("lb")

STATE = web.AppKey("state", object)


class LB:
    """Everything one running LB holds; built inside the event loop."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.registry = Registry(cfg)
        self.policy = make_policy(cfg.routing.policy, seed=cfg.routing.seed, **cfg.routing.options)
        self.dispatcher = Dispatcher(self.registry, cfg, self.policy)
        self.metrics = Metrics(self.registry.views, self.dispatcher.available, self.dispatcher.leased,
                               self.dispatcher.scheduler.adapters.count)
        self.dispatcher.metrics = self.metrics
        self.registry.on_add(lambda rep: self.metrics.remember(rep.id))
        self.registry.on_gone(lambda rep: self.metrics.forget(rep.id))  # its series leave /metrics
        self.metrics.registry.register(TenantCollector(self.dispatcher.fairness))  # bounded tenant labels
        self.dispatcher.fairness.attach_budgets(self.metrics.registry)
        self.dispatcher.on_dispatch.append(self.dispatcher.fairness.queue_waited)
        self.prober = Prober(self.registry, cfg.probes, self.metrics)
        self.server_tls = None  # the listener's ssl.SSLContext once serving HTTPS (re-read on SIGHUP)
        self.proxy = Proxy(cfg, self.registry, self.dispatcher, self.metrics)
        self.prober.on_probe.append(self.proxy.hung.on_probe)  # hung requests, from probe evidence
        self.capacity = Capacity(cfg.scaling, self.registry, self.dispatcher, self.metrics.registry,  # issue 6
                                 deferred=lambda: self.proxy.gate.deferred)
        self.peers = Peers(cfg, self.registry, self.dispatcher, self.metrics)  # cross-region (issue 4)
        self.proxy.peer_links = self.peers
        self.discovery = Discovery(cfg.discovery, self.registry)  # Kubernetes / DNS replica sources
        self.metrics.registry.register(self.discovery)  # lb_discovery_*
        shared = cfg.state.get("backend") == "redis" and cfg.state.get("share_pushes", True)
        # several LBs per region: each one's pushes spend the others' headroom too (lb.daemon.instances)
        self.shared_pushes = SharedPushes(cfg.state, self.registry, self.dispatcher, self.prober) if shared else None

    async def start(self) -> None:
        await self.prober.start()
        if self.shared_pushes is not None:
            await self.shared_pushes.start()
        for rc in self.cfg.replicas:
            self.registry.add(rc)
        self.discovery.start()
        self.dispatcher.start()
        self.capacity.start()
        await self.peers.start()
        self.proxy.gate.start()
        await self.proxy.jobs.start()  # durable batch jobs: replay the journal, queue unfinished ones

    async def stop(self) -> None:
        await self.discovery.close()
        await self.capacity.stop()
        await self.peers.close()
        await self.proxy.jobs.close()  # before the gate: a job cut now stays queued in the journal
        await self.proxy.gate.close()
        await self.dispatcher.close()
        await self.prober.close()
        if self.shared_pushes is not None:
            await self.shared_pushes.close()
        await self.registry.close()

    def reload(self) -> None:
        """SIGHUP: re-read the config file. Applied at once: the replica set (added ones probed,
        removed ones drained) and the keys in `HOT_RELOAD`, which are read per decision. Any
        other change is logged and waits for a restart (the structures it sized are live)."""
        if not self.cfg.source:
            log.warning("SIGHUP ignored: started without --config, nothing to re-read")
            return
        try:
            new = config_mod.load(self.cfg.source)
        except ConfigError as e:
            log.error("reload failed, keeping the running config: %s", e)
            return
        except Exception as e:  # whatever else reading it raised: still one line, still the old config
            log.error("reload failed, keeping the running config: %s: %s: %s", self.cfg.source, type(e).__name__, e)
            return
        self._reload_tls(new)
        added, removed = self.registry.apply(new.replicas)
        cfg, applied = self.cfg, []
        for section, keys in HOT_RELOAD.items():
            old_s, new_s = getattr(cfg, section), getattr(new, section)
            changed = {k: getattr(new_s, k) for k in keys if getattr(new_s, k) != getattr(old_s, k)}
            if changed:
                cfg = replace(cfg, **{section: replace(old_s, **changed)})
                applied += [f"{section}.{k}" for k in changed]
        cfg = replace(cfg, replicas=new.replicas)
        for holder in (self.dispatcher, self.dispatcher.fairness, self.proxy, self.proxy.gate, self.proxy.hung):
            holder.cfg = cfg  # they read these keys at each decision
        self.cfg = cfg
        restart = [f.name for f in fields(Config) if f.name not in ("replicas", "source")
                   and getattr(new, f.name) != getattr(cfg, f.name)]
        if restart:
            log.warning("reload: %s changed; that takes effect on restart (reloadable: replicas, %s)",
                        ", ".join(f"[{s}]" for s in restart),
                        ", ".join(f"{s}.{{{','.join(k)}}}" for s, k in HOT_RELOAD.items()))
        log.info("reloaded %s: replicas added %s, draining %s; applied %s", cfg.source, added or "none",
                 removed or "none", ", ".join(applied) or "no other change")
        self.dispatcher.wake()  # e.g. a larger max_outstanding frees waiting requests now


    def _reload_tls(self, new: Config) -> None:
        """The listener's certificate is re-read on every SIGHUP (a renewal usually rewrites the
        same files): new connections get it, open ones keep theirs."""
        s = new.server
        if self.server_tls is None or not s.tls_cert:
            if bool(self.server_tls) != bool(s.tls_cert):
                log.warning("reload: server.tls_cert turned TLS %s; that takes effect on restart",
                            "on" if s.tls_cert else "off")
            return
        try:
            tls.reload_server(self.server_tls, s.tls_cert, s.tls_key, s.tls_client_ca)
        except ValueError as e:  # config.load checked it a moment ago, but files can change under us
            log.error("reload: keeping the running certificate: %s", e)
            return
        log.info("reload: TLS certificate re-read from %s", s.tls_cert)


# SIGHUP applies these keys live: each is read per decision, nothing was sized by it.
HOT_RELOAD = {
    "server": ("tls_cert", "tls_key", "tls_client_ca",  # re-read by _reload_tls
               "cors_allowed_origins"),  # read per request (_cors, _cors_headers)
    "proxy": ("forward_headers",),
    "pushing": ("mode", "max_outstanding", "push_credit", "max_unseen"),
    "queue": ("max_len", "timeout_s", "retry_after_s"),
    "fairness": ("throttle", "window_s", "user_rpm", "app_rpm", "user_rpm_overrides", "app_rpm_overrides"),
}


@web.middleware
async def _cors(request: web.Request, handler) -> web.StreamResponse:
    """A CORS preflight (OPTIONS with Access-Control-Request-Method) is answered here, before
    routing, when `server.cors_allowed_origins` is set; lb.core.cors decides."""
    origins = request.app[STATE].cfg.server.cors_allowed_origins
    if not origins or not cors.is_preflight(request.method, "Access-Control-Request-Method" in request.headers):
        return await handler(request)
    h = request.headers
    headers, why = cors.preflight(h.get("Origin"), h.get("Access-Control-Request-Method"),
                                  h.get("Access-Control-Request-Headers"), origins)
    if why is not None:
        err = LBError(400, f"CORS preflight refused: {why}", code="cors_refused").response(h.get("X-Request-Id"))
        err.headers.update(headers)
        return err
    return web.Response(status=204, headers=headers)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp `on_response_prepare`: an allowed origin's answers (streamed or not, errors
    too) carry Access-Control-Allow-Origin, or the browser keeps them from the page."""
    origin = request.headers.get("Origin")
    origins = request.app[STATE].cfg.server.cors_allowed_origins
    if origin is None or not origins or cors.is_preflight(request.method,
                                                          "Access-Control-Request-Method" in request.headers):
        return  # a preflight has its own headers (_cors)
    for k in [k for k in response.headers if k.lower().startswith("access-control-")]:
        del response.headers[k]  # lb's setting decides, not an engine's header passed through
    response.headers.update(cors.response_headers(origin, origins, response.headers.get("Vary")))


async def _no_banner(request: web.Request, response: web.StreamResponse) -> None:
    """aiohttp would add `Server: Python/x aiohttp/y` (a version for scanners to match)."""
    response.headers["Server"] = "lb"


async def _check_not_denied(url: str, deny: tuple[str, ...]) -> None:
    """400 for an admin-added replica whose host is (or resolves into) server.admin_replica_deny."""
    host = urlsplit(url).hostname or ""
    rules = parse_deny(deny, "server.admin_replica_deny")
    hit = denied(host, [], rules)  # by name or literal address, before asking DNS anything
    if hit is None:
        try:
            async with asyncio.timeout(2.0):
                infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as e:
            raise LBError(400, f"bad replica: url host {host!r} does not resolve ({e})", code="invalid_replica",
                          param="url")
        hit = denied(host, [i[4][0] for i in infos], rules)
    if hit is not None:
        raise LBError(400, f"bad replica: url host {host!r} is in server.admin_replica_deny ({hit}); "
                      "the admin API does not point lb at link-local or metadata addresses", code="invalid_replica",
                      param="url")


def _json(doc: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def build_app(cfg: Config) -> web.Application:
    app = web.Application(client_max_size=cfg.server.max_body_bytes, middlewares=[_cors, answer_errors])
    app.on_response_prepare.append(add_response_headers)  # e.g. x-lb-degraded
    app.on_response_prepare.append(_cors_headers)
    app.on_response_prepare.append(_no_banner)
    routes = web.RouteTableDef()

    def lb_of(request: web.Request) -> LB:
        return request.app[STATE]

    @routes.get("/v1/models")
    async def models(request: web.Request) -> web.Response:
        registry = lb_of(request).registry
        parents = registry.parents()
        # base models first (a client that takes the first entry gets one), then the LoRA
        # adapters, each naming its base model as `parent` as the engines' own lists do
        ids = sorted(registry.models(), key=lambda m: (m in parents, m))
        return _json({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "lb",
                                                  **({"parent": parents[m]} if m in parents else {})} for m in ids]})

    @routes.get("/health")
    async def health(request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    @routes.get("/ready")
    async def ready(request: web.Request) -> web.Response:
        reg = lb_of(request).registry
        healthy = [r.id for r in reg.active() if r.view.healthy]
        return _json({"ready": bool(healthy), "healthy_replicas": healthy}, 200 if healthy else 503)

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=lb_of(request).metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- admin (bearer token) ----------------------------------------------------------------
    def check_admin(request: web.Request) -> None:
        token = lb_of(request).cfg.server.admin_token
        if not token:
            raise LBError(403, "admin is disabled: set server.admin_token or LB_ADMIN_TOKEN", code="admin_disabled")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise LBError(401, "admin needs Authorization: Bearer <server.admin_token>", code="invalid_api_key")

    def replica_json(rep, lb) -> dict:
        v = rep.view
        return {"id": v.id, "url": v.url, "engine": v.engine, "models": sorted(v.models), "healthy": v.healthy,
                "draining": v.draining, "pending": v.pending, "running": v.running, "outstanding": v.outstanding,
                "kv_usage": v.kv_usage, "kv_free_tokens": v.kv_free_tokens, "kv_total_tokens": v.kv_total_tokens,
                "reports_pending": v.reports_pending,
                # of that KV, what the prefix trie takes its cache to have: the KV less the answers
                # this LB has under way there (lb.core.decoding); None: no KV size, or no trie
                "cache_room_tokens": lb.dispatcher.scheduler.cache_room(v, time.monotonic()),
                # the first tokens its engine counts (vLLM's TTFT histogram): when a push answered
                # whole has finished its prefill (lb.core.backlog); None where it does not say
                "first_tokens": v.engine_first_tokens,
                # ...and the pushes whose first token waits on that count, this LB's and another
                # instance's over the same replicas (a shared Redis)
                "first_tokens_awaited": lb.dispatcher.scheduler.backlog.awaiting_count(v.id),
                # the batch cap SP-P's headroom uses: the engine's own, or learned from probes
                "max_running": v.max_running if v.max_running is not None else v.learned_max_running,
                "max_running_source": ("reported" if v.max_running is not None
                                       else "learned" if v.learned_max_running is not None else None),
                # until a cap is known: the most seen running with none waiting (SP-P's slow start)
                "proven_running": v.proven_running,
                # it has preempted, so it keeps requests in its own queue (a holder's queue opens)
                "requeues": v.requeues,
                # ...and admits past its free KV when it does (vLLM, not SGLang: SP-P's floor)
                "overcommits": v.overcommits,
                # its engine admits what it holds the prefix of first (SGLang lpm): a holder's queue opens
                "orders_by_prefix": v.orders_by_prefix,
                # how long ago a probe last saw it preempt (None: never): no hold for it meanwhile
                "preempted_s_ago": (None if v.preempted_at is None
                                    else round(max(0.0, time.monotonic() - v.preempted_at), 3)),
                # pushes since the last probe that its answer could not include (SP-P's estimate)
                "unseen_pushes": v.pushed_since_probe, "unseen_push_tokens": v.pushed_tokens_since_probe,
                "circuit": rep.breaker.state(time.monotonic()).value, "suspect": rep.suspect,
                "source": rep.source or "static"}

    @routes.get("/admin/replicas")
    async def list_replicas(request: web.Request) -> web.Response:
        check_admin(request)
        return _json({"replicas": [replica_json(r, lb_of(request)) for r in lb_of(request).registry.replicas.values()]})

    @routes.post("/admin/replicas")
    async def add_replica(request: web.Request) -> web.Response:
        lb = lb_of(request)
        check_admin(request)
        try:
            doc = orjson.loads(await request.read())
            rc = config_mod.from_dict({"replicas": [doc]}).replicas[0]
        except (orjson.JSONDecodeError, ConfigError) as e:
            raise LBError(400, f"bad replica: {e}", code="invalid_replica")
        await _check_not_denied(rc.url, lb.cfg.server.admin_replica_deny)
        try:
            rep = lb.registry.add(rc)
        except KeyError as e:
            raise LBError(409, str(e.args[0]), code="replica_exists")
        return _json(replica_json(rep, lb_of(request)), 201)

    @routes.delete("/admin/replicas/{id}")
    async def remove_replica(request: web.Request) -> web.Response:
        lb = lb_of(request)
        check_admin(request)
        rid = request.match_info["id"]
        rep = lb.registry.get(rid)
        if rep is None or not lb.registry.remove(rid):
            raise LBError(404, f"no active replica {rid!r}", code="replica_not_found")
        return _json({**replica_json(rep, lb_of(request)), "status": "draining" if rep.view.outstanding else "removed"}, 202)

    add_job_routes(routes, lambda request: lb_of(request).proxy.jobs)  # /v1/lb/jobs (durable batch)

    @routes.get(PEER_STATUS_PATH)
    async def peer_status(request: web.Request) -> web.Response:
        return await lb_of(request).peers.handle_status(request)

    app.add_routes(routes)
    # the inference surface (lb.core.routes: one declaration per route), then OpenAI-shaped 404/405
    add_api_routes(app, lambda request, route: lb_of(request).proxy.handle(request, route),
                   lambda request, route: lb_of(request).proxy.fanout(request, route))

    async def lifecycle(app: web.Application):
        lb = LB(cfg)
        app[STATE] = lb
        await lb.start()
        yield
        await lb.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


class _JsonFormatter(logging.Formatter):
    """Operational logs as one JSON object per line, like the access log."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc).decode()


def _setup_logging() -> None:
    # the access log writes to stdout itself (lb.daemon.proxy.AccessLog)
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(_JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[err])
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class _Refuse(asyncio.Protocol):
    """A connection over `server.max_connections`: one 503 in plain HTTP/1.1, then closed."""

    ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = error_body("too many open connections to the load balancer; retry later", 503,
                          code="too_many_connections")
        transport.write(self.ANSWER % (len(body), body))  # type: ignore[attr-defined]
        transport.close()


def _limited(server: web.Server, limit: int):
    """The listener's protocol factory: aiohttp's own until `limit` connections are open."""
    def make() -> asyncio.Protocol:
        return _Refuse() if len(server.connections) >= limit else server()
    return make


def _raise_fd_limit(connections: int) -> None:
    """Each client connection holds a descriptor (and an upstream one while it is served)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + 1024
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(hard, need)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("open-file limit %d is below the %d that server.max_connections = %d needs", soft, need,
                    connections)


async def _serve(cfg: Config) -> None:
    _raise_fd_limit(cfg.server.max_connections)
    app = build_app(cfg)
    # keepalive_timeout also runs from a connection's first byte: it closes slowloris heads
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           keepalive_timeout=cfg.server.idle_timeout_s)
    await runner.setup()
    loop = asyncio.get_running_loop()
    s = cfg.server
    app[STATE].server_tls = server_tls = tls.server_context(s.tls_cert, s.tls_key, s.tls_client_ca)
    listener = await loop.create_server(_limited(runner.server, s.max_connections), s.host, s.port, backlog=2048,
                                        reuse_address=True, ssl=server_tls)
    gctune.settle(app[STATE].metrics.gc_pause)  # start-up is done: what it made is never garbage
    lag_watch = loop.create_task(loopwatch.watch(app[STATE].metrics.loop_lag), name="loop-lag")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: app[STATE].reload())
    log.info("lb listening on %s://%s:%d with %d replicas, policy %s, pushing %s", "https" if server_tls else "http",
             cfg.server.host,
             cfg.server.port, len(cfg.replicas), cfg.routing.policy, cfg.pushing.mode)
    await stop.wait()
    listener.close()  # new connections are refused from now on; open ones get 503 shutting_down
    log.info("shutting down: draining in-flight requests (up to %gs)", cfg.server.shutdown_grace_s)
    cut = await app[STATE].proxy.drain(cfg.server.shutdown_grace_s)
    if cut:
        log.warning("%d requests outlived the grace period; each was answered shutting_down", cut)
    lag_watch.cancel()
    await runner.cleanup()
    if app[STATE].proxy.access_log is not None:  # the last iteration's lines
        app[STATE].proxy.access_log.flush()


def serve(cfg: Config) -> None:
    _setup_logging()
    try:
        import uvloop
    except ImportError:  # non-POSIX: asyncio's loop works, only slower
        asyncio.run(_serve(cfg))
    else:
        uvloop.run(_serve(cfg))
