"""Coalescing on the request path (`[coalesce] enabled`, off by default): identical in-flight
temperature-0 requests of one tenant (`lb.core.coalesce.coalesce_key`) share one upstream
request.

The upstream request is a *flight*: a task of its own, not any client's handler, that runs
the proxy's normal forward (LB queue, retries before the first byte) and records what comes
back. Every client — the first one too — is a listener that replays the flight's bytes from
the start and then as they arrive, so a streamed answer reaches every listener chunk by chunk.
A listener that disconnects just stops listening; the flight is cancelled (and the engine
aborts) only when nobody listens any more.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from aiohttp import web
from prometheus_client import Counter, Gauge

from lb.core.coalesce import Coalescer, coalesce_key
from lb.daemon.errors import LBError, error_body, sse_error_event

log = logging.getLogger("lb.coalesce")

_NOT_COPIED = {"content-length", "content-type", "x-request-id", "transfer-encoding"}


class Flight(dict):
    """One shared upstream request, standing in for the client request in `Proxy._forward`
    (same headers, same rewrite flags) and recording its answer as it arrives."""

    def __init__(self, request: web.Request, outcome):
        super().__init__((k, v) for k, v in request.items() if isinstance(k, str))
        self.headers = request.headers
        self.method, self.path_qs = request.method, request.path_qs  # what goes upstream
        self.out = outcome  # the proxy's Outcome of the one upstream request
        self.status: int | None = None
        self.reply_headers: dict = {}
        self.content_type = "application/json"
        self.streaming = False
        self.chunks: list[bytes] = []
        self.done = False
        self.listeners = 0
        self.task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    # -- the writing side: what `Proxy._stream` writes a streamed answer to ---------------------
    def response(self, status: int, headers: dict) -> "Flight":
        self.status, self.streaming = status, True
        self.reply_headers = {k: v for k, v in headers.items() if k.lower() not in _NOT_COPIED}
        self.content_type = headers.get("Content-Type", "text/event-stream")
        return self

    async def prepare(self, request) -> None:
        self._notify()

    async def write(self, data: bytes) -> None:
        self.chunks.append(bytes(data))
        self._notify()

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self.write(data)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _finish(self, result: web.StreamResponse | None) -> None:
        if isinstance(result, web.Response):  # a whole answer (non-streamed, or an error)
            self.status = result.status
            self.reply_headers = {k: v for k, v in result.headers.items() if k.lower() not in _NOT_COPIED}
            self.content_type = result.content_type
            self.chunks = [bytes(result.body or b"")]
        self.done = True
        self._notify()

    async def fly(self, forward: Callable[["Flight"], Awaitable[web.StreamResponse]]) -> None:
        try:
            result = await forward(self)
        except LBError as e:
            result = e.response()
        except asyncio.CancelledError:
            self._finish(None)
            raise
        except Exception as e:  # listeners must hear an ending, whatever happened
            log.exception("coalesced upstream request failed")
            result = web.Response(status=502, content_type="application/json",
                                  body=error_body(f"upstream request failed: {type(e).__name__}", 502,
                                                  code="upstream_unavailable"))
        if self.streaming and isinstance(result, web.Response):  # broke after the stream began
            self.chunks.append(sse_error_event("the shared upstream stream failed"))
            result = None
        self._finish(result)

    # -- the reading side: one per client ---------------------------------------------------------
    async def replay(self, request: web.Request, rid: str, send, cut: Callable[[], bool]) -> web.StreamResponse:
        """Everything the flight got so far, then the rest as it comes, to this client."""
        while not self.done and not self.streaming:
            await self._changed.wait()
        headers = {**self.reply_headers, "X-Request-Id": rid, "X-LB-Coalesced": self.out.request_id}
        if not self.streaming:
            body = b"".join(self.chunks)
            if self.status is None:  # cancelled before any answer: nobody else listened
                raise LBError(502, "the shared upstream request was cancelled", code="upstream_unavailable")
            return web.Response(status=self.status, body=body, headers=headers, content_type=self.content_type)
        client = web.StreamResponse(status=self.status, headers={**headers, "Content-Type": self.content_type,
                                                                  "Cache-Control": "no-cache"})
        await client.prepare(request)
        sent = 0
        try:
            while True:
                while sent < len(self.chunks):
                    await send(client, self.chunks[sent])
                    sent += 1
                if self.done:
                    break
                await self._changed.wait()
        except asyncio.CancelledError:
            if not cut():  # the client left
                raise
            asyncio.current_task().uncancel()  # SIGTERM's grace ran out: end the stream with a reason
            await send(client, sse_error_event("the load balancer shut down before the stream ended",
                                               code="shutting_down"))
        await client.write_eof()
        return client


class SharedFlights:
    def __init__(self, cfg: dict, metrics):
        self.coalescer: Coalescer[Flight] = Coalescer(bool(cfg.get("enabled", False)))
        r = metrics.registry
        self.flights = Counter("lb_coalesce_flights", "Upstream requests that identical requests could share",
                               registry=r)
        self.followers = Counter("lb_coalesced_requests", "Requests answered from another request's upstream "
                                 "request (not sent upstream themselves)", registry=r)
        Gauge("lb_coalesce_inflight", "Shared upstream requests in flight",
              registry=r).set_function(lambda: len(self.coalescer))

    @property
    def enabled(self) -> bool:
        return self.coalescer.enabled

    async def serve(self, request: web.Request, route: str, doc: dict, user: str | None, rid: str, out,
                    new_outcome: Callable[[], object], forward, send, cut: Callable[[], bool]) -> web.StreamResponse:
        """Answer `request` from the flight for its key (leading a new one if none runs).
        `forward(flight, outcome)` is the proxy's normal upstream path."""
        key = coalesce_key(user, route, doc)
        flight, leads = self.coalescer.join(key, lambda: Flight(request, new_outcome()))
        if flight is None:
            return await forward(request, out)
        if leads:
            self.flights.inc()
            flight.task = asyncio.get_running_loop().create_task(flight.fly(lambda f: forward(f, f.out)),
                                                                 name=f"coalesced-{rid}")
            flight.task.add_done_callback(lambda _t: self.coalescer.finish(key, flight))  # later ones fly anew
        else:
            self.followers.inc()
        flight.listeners += 1
        try:
            return await flight.replay(request, rid, send, cut)
        finally:
            flight.listeners -= 1
            if flight.listeners == 0 and not flight.task.done():
                self.coalescer.finish(key, flight)  # nobody joins a flight about to be cancelled
                flight.task.cancel()  # nobody listens any more: free the engine
            up = flight.out
            out.target, out.attempts, out.queue_wait_s = up.target, up.attempts, up.queue_wait_s
            out.status, out.reason = flight.status or out.status, up.reason or out.reason
            if leads:  # the engine's timing and tokens, counted once
                out.ttft_s, out.usage = up.ttft_s, up.usage
