"""The API surface on the wire: routes from `lb.core.routes` mounted on the app, the headers
that cross lb each way, multipart uploads streamed through, FANOUT calls, and OpenAI-shaped
404/405 for everything else.

Headers: upstream gets Content-Type (the route's), Accept, Authorization (unless lb owns the
credential: `[identity] api_keys` or a replica `api_key`), lb's X-Request-Id and the
`[proxy] forward_headers` allowlist; never `x-lb-*` or hop-by-hop ones. The client gets the
engine's headers back (e.g. `openai-processing-ms`, `x-ratelimit-*`) less hop-by-hop, framing
and lb's own (`x-lb-*`, X-Request-Id, Server, Date, Set-Cookie).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from lb.core.facts import H_REQUEST_ID
from lb.core.routes import FANOUT, NONE, ROUTES, FanoutFailure, Route, combine, multipart_field
from lb.daemon.config import NEVER_FORWARDED, Config
from lb.daemon.errors import LBError, error_body

log = logging.getLogger("lb.surface")

# response headers an engine sends that the client does not get from lb as they are
# (content-encoding: lb decodes what a replica compresses, lb.daemon.registry, so it is not true any more)
_NOT_RETURNED = NEVER_FORWARDED | {"content-type", "x-request-id", "server", "date", "set-cookie", "content-encoding"}
_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.I)


# -- headers -------------------------------------------------------------------------------------
def upstream_headers(request, rid: str, cfg: Config, route: Route) -> dict:
    """Only what an engine needs and the allowlist names; identity and internal headers stay here."""
    h = {H_REQUEST_ID: rid}
    src = request.headers
    if route.body != NONE:
        ctype = src.get("Content-Type") if route.body != "json" else None
        h["Content-Type"] = ctype or "application/json"
    for name in ("Accept", "Authorization"):
        value = src.get(name)
        if value:
            h[name] = value
    if cfg.identity.api_keys:  # then the client's key is the LB's credential: never leak it upstream
        h.pop("Authorization", None)
    names, prefixes = _allowlist(cfg.proxy.forward_headers)
    for name in names:
        value = src.get(name)
        if value is not None:
            h[name] = value
    if prefixes:
        h.update((k, v) for k, v in src.items() if k.lower().startswith(prefixes) and not k.lower().startswith("x-lb-"))
    return h


@functools.lru_cache(maxsize=16)
def _allowlist(entries: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`[proxy] forward_headers` split once per config: exact names, lower-case prefixes."""
    return (tuple(e for e in entries if not e.endswith("*")),
            tuple(e[:-1].lower() for e in entries if e.endswith("*")))


def reply_headers(upstream: aiohttp.ClientResponse | None, rid: str, replica: str) -> dict:
    """The client's response headers: the engine's useful ones, then lb's own."""
    out = {}
    if upstream is not None:
        src = upstream.headers
        connection = src.get("Connection")
        drop = _NOT_RETURNED | {t.strip().lower() for t in connection.split(",")} if connection else _NOT_RETURNED
        for k, v in src.items():
            low = k.lower()
            if low not in drop and not low.startswith("x-lb-"):
                out[k] = v
    out["X-Request-Id"] = rid
    out["X-LB-Replica"] = replica
    return out


# -- multipart uploads ---------------------------------------------------------------------------
class MultipartBody:
    """A multipart upload (audio) read only up to its `model` field, the rest streamed upstream
    as it arrives. With a Content-Length the HTTP framing bounds it (checked against
    `server.max_body_bytes` before a byte is read); without one it is read whole, up to that
    limit. It can be replayed on another replica while the rest has not started to stream."""

    def __init__(self, head: bytes, rest: aiohttp.StreamReader | None, length: int | None, deadline: float):
        self.head, self.rest, self.length, self.deadline = head, rest, length, deadline
        self.started = False
        self.error: LBError | None = None  # why streaming the rest to the engine stopped on our side

    @property
    def replayable(self) -> bool:
        return self.rest is None or not self.started

    def payload(self) -> bytes | AsyncIterator[bytes]:
        return self.head if self.rest is None else self._stream()

    async def _stream(self) -> AsyncIterator[bytes]:
        yield self.head
        self.started = True
        while True:
            try:
                async with asyncio.timeout(max(0.0, self.deadline - time.monotonic())):
                    chunk = await self.rest.readany()
            except TimeoutError:
                self.error = LBError(408, "the upload did not arrive within server.body_timeout_s", code="body_timeout")
                raise
            if not chunk:
                return
            yield chunk


async def read_multipart(request: web.Request, cfg: Config) -> tuple[MultipartBody, str]:
    """The upload up to its `model` field, and that model ("" when it has none)."""
    limit = cfg.server.max_body_bytes
    m = _BOUNDARY.search(request.headers.get("Content-Type", ""))
    if not request.content_type.startswith("multipart/form-data") or not m:
        raise LBError(400, "this route takes multipart/form-data with a boundary", code="invalid_request")
    boundary = m.group(1).encode()
    deadline = time.monotonic() + cfg.server.body_timeout_s
    length = request.content_length
    buf = bytearray()
    try:
        async with asyncio.timeout(cfg.server.body_timeout_s):
            if length is None:  # chunked upload: whole, bounded by the limit
                try:
                    buf += await request.read()
                except web.HTTPRequestEntityTooLarge:
                    raise LBError(413, f"request body exceeds {limit} bytes", code="body_too_large") from None
                done, model = multipart_field(bytes(buf), boundary, b"model")
                return MultipartBody(bytes(buf), None, None, deadline), model or ""
            while True:
                chunk = await request.content.readany()
                buf += chunk
                done, model = multipart_field(bytes(buf), boundary, b"model")
                if done or not chunk:
                    break
    except TimeoutError:
        raise LBError(408, f"the request body did not arrive within {cfg.server.body_timeout_s:g}s",
                      code="body_timeout") from None
    rest = None if request.content.at_eof() or len(buf) >= length else request.content
    return MultipartBody(bytes(buf), rest, length, deadline), model or ""


# -- FANOUT routes -------------------------------------------------------------------------------
async def fanout(request: web.Request, route: Route, registry, cfg: Config, rid: str) -> web.Response:
    """Send the call to every healthy replica the route accepts; one combined answer."""
    reps = [r for r in registry.active() if r.view.healthy and route.accepts(r.view)]
    if not reps:
        return web.Response(status=503, content_type="application/json", headers={"Retry-After": "1"},
                            body=error_body(f"no healthy replica serves {request.path}", 503, code="no_replica"))
    try:
        body = await request.read() if request.can_read_body else None
    except web.HTTPRequestEntityTooLarge:
        return web.Response(status=413, content_type="application/json",
                            body=error_body(f"request body exceeds {cfg.server.max_body_bytes} bytes", 413,
                                            code="body_too_large"))
    sent = upstream_headers(request, rid, cfg, route)
    if body:
        sent["Content-Type"] = request.headers.get("Content-Type", "application/json")

    async def one(rep) -> tuple[str, int, object]:
        headers = {**sent, "Authorization": f"Bearer {rep.cfg.api_key}"} if rep.cfg.api_key else sent
        try:
            async with asyncio.timeout(cfg.upstream.first_byte_timeout_s):
                async with rep.session.request(request.method, request.path_qs, data=body, headers=headers) as r:
                    raw = await r.read()
                    status = r.status
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            log.warning("%s on %s failed: %s: %s", request.path, rep.id, type(e).__name__, e)
            return rep.id, 0, f"{type(e).__name__}: {e}"
        try:
            return rep.id, status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return rep.id, status, raw.decode("utf-8", "replace").strip()[:2000]

    outcome = combine(route.name, await asyncio.gather(*(one(r) for r in reps)))
    if isinstance(outcome, FanoutFailure):
        status = outcome.replica_status or (404 if outcome.code == "response_not_found" else 502)
        doc = orjson.loads(error_body(outcome.message, status, param=outcome.param, code=outcome.code))
        if outcome.replicas:
            doc["lb_replicas"] = list(outcome.replicas)
    else:
        status, doc = outcome
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


# -- mounting ------------------------------------------------------------------------------------
def add_routes(app: web.Application, handle: Callable[[web.Request, Route], Awaitable[web.StreamResponse]],
               fan: Callable[[web.Request, Route], Awaitable[web.StreamResponse]]) -> None:
    """Every route of the table, then a catch-all that answers OpenAI-shaped 404/405."""
    for route in ROUTES:
        serve = fan if route.dispatch == FANOUT else handle

        async def handler(request: web.Request, route: Route = route, serve=serve) -> web.StreamResponse:
            return await serve(request, route)

        for path in route.paths:
            for method in route.methods:
                app.router.add_route(method, path, handler)
    app.router.add_route("*", "/{tail:.*}", unknown)


async def unknown(request: web.Request) -> web.Response:
    """No route has this path (404), or none takes this method on it (405 with Allow)."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.canonical == "/{tail}":
            continue
        match, methods = await resource.resolve(request)
        allowed |= methods
    if allowed:
        allow = ", ".join(sorted(allowed))
        return web.Response(status=405, content_type="application/json", headers={"Allow": allow},
                            body=error_body(f"{request.method} is not allowed on {request.path}; use {allow}", 405,
                                            type="invalid_request_error", code="method_not_allowed"))
    return web.Response(status=404, content_type="application/json",
                        body=error_body(f"no route {request.method} {request.path}; docs/api.md lists lb's routes",
                                        404, code="unknown_route"))
