"""The streaming proxy: one request from the client, through the LB queue, to a replica.

Bytes are forwarded as they arrive (no per-token re-encoding); only the last few kB are kept
to read the usage object at the end. Before the first byte reaches the client a failed or
refusing replica (connection error, 502/503/504) is retried on another one with backoff;
after it, a broken stream ends with an SSE error event and `[DONE]`. A client that goes away
cancels the handler, which closes the upstream connection (the engine aborts the request)
and, for SGLang requests that carry a `rid`, also posts `/abort_request`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import select
import sys
import time
import itertools
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from lb.core.continuations import continues
from lb.core.facts import H_REQUEST_ID, BadRequest, build_facts
from lb.core.health import RETRYABLE_STATUSES, backoff_delay
from lb.core.loadparse import usage_from_tail
from lb.core.pushing import record_direct
from lb.core.routes import BY_NAME, DIRECT, JSON, MULTIPART, PATH, Route, direct_target
from lb.core.types import ReplicaView, RequestFacts
from lb.daemon.gate import Gate
from lb.daemon.config import Config
from lb.daemon.dispatch import DIRECT_CHOICE, Dispatcher
from lb.daemon.errors import LBError, normalize_upstream_error, sse_error_event
from lb.daemon.flights import Flight, SharedFlights
from lb.daemon.hung import Attempt, HungWatch
from lb.daemon.jobs import Jobs
from lb.daemon.registry import Registry, Replica
from lb.daemon.surface import MultipartBody, fanout, read_multipart, reply_headers, upstream_headers
from lb.daemon.tracing import make_tracing

log = logging.getLogger("lb.proxy")

TAIL_BYTES = 4096  # the usage chunk of an SSE stream fits comfortably
# Progress listeners (dispatcher.on_progress) hear of a stream after its first event (it has
# left prefill) and then every this many events: the load tracker refines a prediction only
# when a request outgrows it, so a few tokens' lag changes nothing, and a chunk costs one
# bytes.count and a comparison instead of a call per listener.
PROGRESS_EVERY = 16
# Whatever a replica can make the client library raise: refused or broken connections,
# timeouts, and broken HTTP (a bad chunk size, a CR inside a header: ClientResponseError or
# ClientPayloadError; a line past its limit: LineTooLong, an HttpProcessingError).
_UPSTREAM_ERRORS = (aiohttp.ClientError, HttpProcessingError, asyncio.TimeoutError, ConnectionError)


# What the first line of a server-sent event stream can be (a field, a comment, a blank line).
_SSE_FIRST = (b"data:", b"event:", b"id:", b"retry:", b":", b"\n", b"\r\n")


class _Detached(dict):
    """Stands in for the client request of work nobody waits on over HTTP (`Proxy.call`)."""

    headers: dict = {}
    method = "POST"

    def __init__(self, path: str):
        super().__init__()
        self.path_qs = path


class ClientGone(Exception):
    """A write to the client failed: it left before aiohttp's cancellation reached the handler."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("client disconnected")
        self.response = response


class _LineTooLong(Exception):
    """An SSE line past upstream.max_sse_line_bytes after the first byte."""


class _Retry(Exception):
    """The replica failed before the client saw a byte: try another one."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


async def _send(client: web.StreamResponse, data: bytes) -> None:
    try:
        await client.write(data)
    except ConnectionError:
        raise ClientGone(client) from None


@dataclass
class Outcome:
    """What the access log and the metrics say about one request."""

    request_id: str
    route: str
    status: int = 0
    reason: str = ""
    model: str = ""
    target: str = ""
    attempts: int = 0
    stream: bool = False
    queue_wait_s: float | None = None
    # why the scheduler chose this target (lb.core.scheduler.Placement.reason: prefix, load,
    # ring, ..., peer; "direct" for a route that skips the queue) and the prefix blocks it
    # believed the target held, of the prompt's
    decision: str = ""
    matched_blocks: int = 0
    prompt_blocks: int = 0
    best_blocks: int = 0  # the longest prefix any candidate held: above matched_blocks when it left the holder
    ttft_s: float | None = None
    e2e_s: float | None = None
    user: str | None = None
    usage: dict = field(default_factory=dict)
    events: int = 0  # SSE data events relayed (about one per token), for the load anticipator
    ts: float = 0.0  # wall-clock time the request ended (set by the access log)

    def answer_tokens(self) -> int:
        """The tokens of the answer the replica gave whole (0: it gave none)."""
        if self.status != 200 or self.e2e_s is None:
            return 0
        return int(self.usage.get("completion_tokens") or self.events or 0)


class AccessLog:
    """One JSON line per request on stdout: orjson over the whole Outcome (every field, so
    every line has the same keys; never prompt text). No logging record, formatter or handler
    lock on the request path. The lines of one loop iteration go out in one write(2) at its
    end (a syscall per request was 2 % of the proxy's CPU at concurrency 32, profiled), at
    most PIPE_BUF bytes each, so writers sharing the file never interleave inside a line and
    a crash loses at most one iteration's lines."""

    def __init__(self, fd: int | None = None):
        self.fd = sys.stdout.fileno() if fd is None else fd
        self._lines: list[bytes] = []
        self._size = 0

    def write(self, out: Outcome) -> None:
        out.ts = round(time.time(), 3)
        line = orjson.dumps(out, option=orjson.OPT_APPEND_NEWLINE)
        if self._size + len(line) > select.PIPE_BUF:
            self.flush()
        if not self._lines:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a caller outside the server): write it now
                self._write(line)
                return
        self._lines.append(line)
        self._size += len(line)

    def flush(self) -> None:
        if self._lines:
            data = b"".join(self._lines)
            self._lines.clear()
            self._size = 0
            self._write(data)

    def _write(self, data: bytes) -> None:
        try:
            os.write(self.fd, data)
        except OSError:  # stdout closed or full: the log must never fail a request
            pass


class Proxy:
    def __init__(self, cfg: Config, registry: Registry, dispatcher: Dispatcher, metrics):
        self.cfg = cfg
        self.registry = registry
        self.dispatcher = dispatcher
        self.metrics = metrics
        # SIGTERM drain (`drain`): handlers running now, and those it had to cut short
        self.inflight: set[asyncio.Task] = set()
        self.draining = False
        self._cut: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self.peer_links = None  # lb/daemon/peer_links.py: peer auth, forwarding headers, forward outcomes
        self.gate = Gate(cfg, registry, dispatcher, metrics)  # admission, NIW hold, priority
        self.jobs = Jobs(cfg, self, metrics)  # durable batch jobs (x-lb-durable, /v1/lb/jobs)
        self.flights = SharedFlights(cfg.coalesce, metrics)  # identical temperature-0 requests share one
        self.hung = HungWatch(cfg, registry, metrics)  # requests a replica holds while its probes show it idle
        self.access_log = AccessLog() if cfg.server.access_log else None
        self.tracing = make_tracing(cfg)  # OpenTelemetry spans, or empty hooks when off (lb.daemon.tracing)

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        t0 = time.monotonic()
        rid = request.headers.get(H_REQUEST_ID) or new_request_id()
        out = Outcome(request_id=rid, route=route.name)
        span = self.tracing.start_request(request, route.name)
        task = asyncio.current_task()
        self.inflight.add(task)
        try:
            try:
                if self.draining:
                    raise LBError(503, "the load balancer is shutting down", code="shutting_down", retry_after=1)
                return await self._handle(request, route, rid, t0, out)
            except LBError as e:
                out.status, out.reason = e.status, e.reason
                return e.response(rid)
            except ClientGone as gone:
                out.status, out.reason = 499, "client_disconnected"
                self.metrics.cancelled.labels("upstream").inc()
                return gone.response
            except Exception as e:  # a bug here must still give the client an answer and a log line
                log.exception("request %s failed inside the LB", rid)
                out.status, out.reason = 500, "internal_error"
                return LBError(500, f"lb: internal error ({type(e).__name__})", code="internal_error").response(rid)
        except asyncio.CancelledError:
            if task in self._cut and task.uncancel() == 0:  # cut by the SIGTERM drain, not by the client
                out.status, out.reason = 503, "shutting_down"
                return LBError(503, "the load balancer shut down before this request was served",
                               code="shutting_down", retry_after=1).response(rid)
            # after the first byte the reason said "ok": the client leaving is what happened
            out.status, out.reason = 499, ("client_disconnected" if out.reason in ("", "ok") else out.reason)
            self.metrics.cancelled.labels("upstream" if out.target else "queue").inc()
            raise
        finally:
            self.inflight.discard(task)
            self._cut.discard(task)
            if self.draining and not self.inflight:
                self._idle.set()
            out.e2e_s = time.monotonic() - t0
            self._account(out)
            self.tracing.end_request(span, out)

    async def drain(self, grace_s: float) -> int:
        """SIGTERM: new requests get 503; running ones have `grace_s` to finish; the rest are
        cut with a clear error (503 before their first byte, an SSE error event after it).
        Returns how many were cut.
        """
        self.draining = True
        if self.inflight:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except TimeoutError:
                pass
        cut = list(self.inflight)
        self._cut.update(cut)
        for task in cut:
            task.cancel()
        if self.inflight:
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except TimeoutError:
                log.warning("%d requests did not end after being cut", len(self.inflight))
        return len(cut)

    async def _body(self, request: web.Request, route: Route) -> tuple[bytes | MultipartBody, dict]:
        """The request body as forwarded, and the document routing reads (its model at least)."""
        limit = self.cfg.server.max_body_bytes
        if request.content_length is not None and request.content_length > limit:  # refused unread
            raise LBError(413, f"request body exceeds {limit} bytes", code="body_too_large")
        if route.body == MULTIPART:  # streamed on after its `model` field
            upload, model = await read_multipart(request, self.cfg)
            return upload, {"model": model}
        if route.body != JSON:
            return b"", {"model": request.match_info["model"]} if route.model == PATH else {}
        try:
            if request.content.is_eof():  # all of it arrived with the headers: no timer to arm (profiled)
                body = await request.read()
            else:
                async with asyncio.timeout(self.cfg.server.body_timeout_s):  # a trickled body holds a connection
                    body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise LBError(413, f"request body exceeds {limit} bytes", code="body_too_large")
        except TimeoutError:
            raise LBError(408, f"the request body did not arrive within {self.cfg.server.body_timeout_s:g}s",
                          code="body_timeout")
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise LBError(400, f"request body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(doc, dict):
            raise LBError(400, "request body must be a JSON object", code="invalid_json")
        return body, doc

    async def _handle(self, request: web.Request, route: Route, rid: str, t0: float, out: Outcome) -> web.StreamResponse:
        body, doc = await self._body(request, route)
        try:
            facts = build_facts(route.name, doc, request.headers, rid, t0, self.registry.is_adapter)
        except BadRequest as e:
            raise LBError(400, str(e), code="invalid_request", param=e.param)
        if self.peer_links is not None:  # 401 for a bad peer signature; hops=1 for a peer's forward
            facts = self.peer_links.inbound(request, facts, body)
        fairness = self.dispatcher.fairness
        facts = fairness.identify(request.headers, doc, facts)  # 400/401 on bad identity
        out.model, out.stream, out.user = facts.model, facts.stream, facts.user
        accepts = route.accepts
        peers_serve = self.peer_links is not None and self.peer_links.serves(facts, accepts)
        if facts.model and not self.registry.knows_model(facts.model) and not peers_serve:
            raise LBError(404, f"The model `{facts.model}` does not exist; GET /v1/models lists the served ones",
                          code="model_not_found", param="model")
        if not peers_serve and not any(r.view.healthy and r.view.serves(facts.model) and accepts(r.view)
                                       for r in self.registry.active()):
            raise LBError(503, "no healthy replica serves this request right now", code="no_replica", retry_after=1)
        if route.dispatch != DIRECT:  # a tokenize call spends no engine time: not a request RPM/OIT counts
            self.dispatcher.scheduler.recognize(facts, t0)  # OIT never cuts an interaction its prompt continues
            known = continues(facts)
            if known is not None:
                self.metrics.child(self.metrics.undeclared, "yes" if known else "no").inc()
            await fairness.check_throttle(facts, t0, len(self.dispatcher.queue),  # 429 under OIT/RPM
                                          lambda: any(self.dispatcher.available(r.view) for r in self.registry.active()))
        if self.jobs.durable(request):  # 202 and a job id: served later, survives a restart
            return await self.jobs.accept(request, request.path, doc, facts)
        if route.dispatch != DIRECT:  # a tokenize call is not judged against an SLO
            facts = await self.gate.admit(request, facts, doc)  # 429/503 early, degrade, NIW held
        if self.flights.enabled and route.body == JSON:
            return await self.flights.serve(
                request, route.name, doc, facts.user, rid, out, lambda: Outcome(request_id=rid, route=route.name),
                lambda req, o: self._forward(req, route, body, doc, facts, accepts, rid, t0, o),
                _send, lambda: asyncio.current_task() in self._cut)
        return await self._forward(request, route, body, doc, facts, accepts, rid, t0, out)

    async def call(self, route: str, doc: dict, facts: RequestFacts) -> web.StreamResponse:
        """Serve one request that has no client connection (a durable job) through the LB
        queue, retries included; returns the answer a client would have got."""
        t0 = time.monotonic()
        out = Outcome(request_id=facts.request_id, route=route, model=facts.model, user=facts.user)
        spec = BY_NAME[route]
        try:
            return await self._forward(_Detached(spec.paths[0]), spec, orjson.dumps(doc), doc, facts, spec.accepts,
                                       facts.request_id, t0, out)
        except LBError as e:
            out.status, out.reason = e.status, e.reason
            return e.response(facts.request_id)
        except asyncio.CancelledError:  # lb is stopping: the job stays queued in its journal
            out.status, out.reason = 503, "shutting_down"
            raise
        finally:
            out.e2e_s = time.monotonic() - t0
            self._account(out)

    async def _forward(self, request, route: Route, body, doc, facts, accepts, rid, t0, out) -> web.StreamResponse:
        up = self.cfg.upstream
        tried: set[str] = set()
        headers = upstream_headers(request, rid, self.cfg, route)
        ticket = self.dispatcher.ticket()  # a retry keeps the queue place the request arrived with
        while True:
            if route.dispatch == DIRECT:
                rep, waited, why = self._direct(facts, accepts, tried), 0.0, DIRECT_CHOICE
            else:
                rep, waited, why = await self.dispatcher.acquire(facts, accepts, frozenset(tried), ticket)
                self.tracing.queue_wait(waited)
            out.attempts += 1
            out.target = rep.id
            out.decision, out.matched_blocks, out.prompt_blocks = why.reason, why.matched_blocks, why.total_blocks
            out.best_blocks = why.best_blocks
            out.queue_wait_s = (out.queue_wait_s or 0.0) + waited
            attempt = self.hung.start(rep)
            span = self.tracing.start_attempt(rep, out.attempts)
            try:
                last_try = out.attempts > up.retries
                payload, sent = body, doc
                if route.generates and route.body == JSON:  # the tier's priority, an SGLang rid
                    payload = self.gate.body_for(request, rep.view.engine, facts, doc, body)
                    sent, payload = _with_sglang_rid(rep.view.engine, route.name, doc, payload)
                try:
                    resp, retry_reason = await self._open(rep, request, payload, self.tracing.headers(span, headers),
                                                          last_try, facts.stream, attempt)
                except asyncio.CancelledError:  # the client left while the engine held the request
                    self._abort_sglang(rep, sent)
                    raise
                if resp is not None:
                    try:
                        return await self._relay(request, rep, resp, sent, rid, t0, out, attempt)
                    except _Retry as r:
                        retry_reason = r.reason
            finally:
                self.tracing.end_attempt(span, out)
                self.hung.finish(attempt)
                self.registry.completed(rep, None if route.dispatch == DIRECT else facts)
                if route.dispatch != DIRECT:  # a DIRECT call was neither charged nor forecast
                    # every attempt was charged at dispatch: correct it with the real token counts
                    self.dispatcher.fairness.completed(facts, time.monotonic(), out.usage)
                    out.e2e_s = time.monotonic() - t0  # so far (the final figure is set when the answer ends)
                    for fn in self.dispatcher.on_complete:  # capacity: forecast, length model, anticipator
                        fn(facts, rep, out, time.monotonic())
            if rep.view.engine == "peer" and self.peer_links is not None:
                self.peer_links.forward_failed(rep, retry_reason)  # not chosen again until its status is good
            if isinstance(body, MultipartBody) and (body.error or not body.replayable):
                raise body.error or LBError(502, f"upstream {rep.id} failed while the upload streamed to it "
                                                 f"({retry_reason}); a streamed upload cannot be replayed",
                                            code="upstream_unavailable", retry_after=1)
            if out.attempts > up.retries:
                if retry_reason in ("timeout", "hung"):
                    raise LBError(504, f"upstream replicas did not answer in time ({retry_reason})",
                                  code="upstream_timeout", retry_after=1)
                raise LBError(502, f"upstream replicas failed before answering ({retry_reason})",
                              code="upstream_unavailable", retry_after=1)
            tried.add(rep.id)
            self.metrics.retries.labels(retry_reason).inc()
            await asyncio.sleep(backoff_delay(out.attempts, up.backoff_base_s, up.backoff_cap_s))

    def _direct(self, facts: RequestFacts, accepts, tried: set[str]) -> Replica:
        """A DIRECT route's replica, now: no queue, no pushing accounting (lb.core.routes)."""
        rep = direct_target(self.registry.active(), facts.model, accepts, tried, time.monotonic())
        if rep is None:
            raise LBError(503, "no healthy replica serves this request right now", code="no_replica", retry_after=1)
        record_direct(rep.view)  # so a drain waits for it; `completed` gives it back
        return rep

    async def _open(self, rep: Replica, request, body, headers: dict,
                    last_try: bool, stream: bool, attempt: Attempt) -> tuple[aiohttp.ClientResponse | None, str]:
        """Send upstream until its headers arrive; (None, reason) when another replica should try.

        A refusal (502/503/504, e.g. an engine's "queue full") is passed on only on the last try,
        or when the body was an upload already streamed (it cannot be sent again).
        """
        path = request.path_qs
        if rep.cfg.api_key:  # the replica's own key replaces the client's
            headers = {**headers, "Authorization": f"Bearer {rep.cfg.api_key}"}
        if isinstance(body, MultipartBody):
            headers = {**headers, **({"Content-Length": str(body.length)} if body.length is not None else {})}
            data = body.payload()
        else:
            data = body or None
        if rep.view.engine == "peer" and self.peer_links is not None:  # signed, hop-marked, identity carried
            headers = self.peer_links.outbound_headers(headers, request.method, path, body)
        try:
            # Engines send a stream's headers at once; a replica silent this long is stuck.
            async with asyncio.timeout(self.cfg.upstream.first_byte_timeout_s if stream else None) as deadline:
                attempt.deadline = deadline  # moved to now if the replica is seen to hang (lb.daemon.hung)
                resp = await rep.session.request(request.method, path, data=data, headers=headers)
            attempt.resp, attempt.deadline = resp, None
        except _UPSTREAM_ERRORS as e:
            if isinstance(body, MultipartBody) and body.error:  # the client's upload stalled, not the engine
                return None, body.error.code
            kind = ("hung" if attempt.hung  # the watch counted it already
                    else "connect" if isinstance(e, (aiohttp.ClientConnectorError, ConnectionRefusedError))
                    else "timeout" if isinstance(e, TimeoutError)
                    else "bad_http" if isinstance(e, (aiohttp.ClientResponseError, aiohttp.ClientPayloadError,
                                                      HttpProcessingError))
                    else "disconnect")
            if kind != "hung":
                self.metrics.upstream_errors.labels(rep.id, kind).inc()
                self.registry.outcome(rep, False, kind)
            if kind == "connect":
                self.registry.failed_hard(rep)
            log.warning("upstream %s failed before the first byte: %s: %s", rep.id, type(e).__name__, e)
            return None, kind
        if not 100 <= resp.status <= 599:  # not an HTTP status: the replica is broken, never pass it on
            resp.close()
            self.metrics.upstream_errors.labels(rep.id, "bad_status").inc()
            self.registry.outcome(rep, False, "bad_status")
            log.warning("upstream %s answered HTTP status %d", rep.id, resp.status)
            if last_try or not getattr(body, "replayable", True):
                raise LBError(502, f"upstream {rep.id} answered an invalid HTTP status {resp.status}",
                              code="upstream_bad_status", retry_after=1)
            return None, "bad_status"
        if resp.status >= 500 and resp.status != 503:  # 503 is an engine's back-pressure, not a fault
            self.registry.outcome(rep, False, f"http_{resp.status}")
        if resp.status in RETRYABLE_STATUSES:
            self.metrics.upstream_errors.labels(rep.id, f"http_{resp.status}").inc()
            if not last_try and getattr(body, "replayable", True):
                resp.release()
                return None, f"http_{resp.status}"
        return resp, ""

    async def _relay(self, request: web.Request, rep: Replica, resp: aiohttp.ClientResponse, doc: dict,
                     rid: str, t0: float, out: Outcome, attempt: Attempt) -> web.StreamResponse:
        finished = False
        up = self.cfg.upstream
        unwatch = _fail_body_on_close(resp)
        try:
            if resp.status >= 400:
                # only a prefix: the message is in it, and a replica cannot make us hold more
                prefix, whole = await _read_bounded(resp, up.max_error_body_bytes)
                err = normalize_upstream_error(resp.status, prefix)
                out.status, out.reason = resp.status, "upstream_error"
                finished = whole
                return web.Response(status=resp.status, body=err, content_type="application/json",
                                    headers=reply_headers(resp, rid, rep.id))
            # the header as sent, not aiohttp's `content_type` (it parses the header anew on each
            # read, with the email package: profiled on the request path)
            ctype = resp.headers.get("Content-Type", "")
            if ctype.partition(";")[0].strip().lower() == "text/event-stream":
                result = await self._stream(request, rep, resp, rid, t0, out, attempt)
            else:
                data, whole = await _read_bounded(resp, up.max_response_bytes)
                if not whole:
                    self.metrics.upstream_errors.labels(rep.id, "too_large").inc()
                    self.registry.outcome(rep, False, "too_large")
                    raise LBError(502, f"upstream {rep.id} answered more than upstream.max_response_bytes = "
                                  f"{up.max_response_bytes} bytes", code="upstream_too_large")
                out.usage = _usage_dict(data[-TAIL_BYTES:])
                out.status, out.reason = resp.status, "ok"
                self.registry.outcome(rep, True)
                headers = reply_headers(resp, rid, rep.id)
                headers["Content-Type"] = ctype or "application/json"
                result = web.Response(status=resp.status, body=data, headers=headers)
            finished = True
            return result
        except _UPSTREAM_ERRORS as e:
            if attempt.hung:  # the replica is not working on it: nothing done, nothing lost
                raise _Retry("hung") from None
            # Non-streamed body broke after the headers: the engine already did the work.
            self.metrics.upstream_errors.labels(rep.id, "broken_body").inc()
            self.registry.outcome(rep, False, "broken_body")
            raise LBError(502, f"upstream {rep.id} broke off its response: {type(e).__name__}",
                          code="upstream_broken") from None
        finally:
            unwatch()
            if finished:
                resp.release()  # back to the keep-alive pool
            else:
                resp.close()  # the engine sees the disconnect and aborts the request
                self._abort_sglang(rep, doc)

    async def _stream(self, request: web.Request, rep: Replica, resp: aiohttp.ClientResponse,
                      rid: str, t0: float, out: Outcome, attempt: Attempt) -> web.StreamResponse:
        first = await self._first_line(rep, resp, attempt)  # nothing has reached the client yet: may retry
        headers = {**reply_headers(resp, rid, rep.id),
                   "Content-Type": resp.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache"}
        # a coalesced flight records the stream for its listeners instead of writing to one client
        client = (request.response(resp.status, headers) if isinstance(request, Flight)
                  else web.StreamResponse(status=resp.status, headers=headers))
        await client.prepare(request)
        out.status, out.reason = resp.status, "ok"
        out.ttft_s = time.monotonic() - t0
        tail = first[-TAIL_BYTES:]
        listeners = self.dispatcher.on_progress
        report_at = 1 if listeners else -1  # events count at which listeners next hear; -1: never

        def report(events: int) -> int:
            now = time.monotonic()
            for fn in listeners:
                fn(rid, events, now)
            return events + PROGRESS_EVERY

        max_line, line = self.cfg.upstream.max_sse_line_bytes, 0  # bytes since the last newline
        try:
            await _send(client, first)
            out.events = first.count(b"data:")  # the first event carries the first token: prefill is done
            if 0 < report_at <= out.events:
                report_at = report(out.events)
            async for chunk in resp.content.iter_any():
                nl = chunk.rfind(b"\n")
                line = line + len(chunk) if nl < 0 else len(chunk) - nl - 1
                if line > max_line:  # an event that never ends: cut, the client is told below
                    raise _LineTooLong()
                await _send(client, chunk)
                attempt.chunks += 1
                out.events += chunk.count(b"data:")
                if 0 < report_at <= out.events:
                    report_at = report(out.events)
                tail = chunk[-TAIL_BYTES:] if len(chunk) >= TAIL_BYTES else tail[len(chunk) - TAIL_BYTES:] + chunk
        except _UPSTREAM_ERRORS + (_LineTooLong,) as e:
            # After the first byte there is no retry: say so in the stream the client reads.
            resp.close()
            prefix = b"\n\n" if line else b""  # end the half-written event first
            if attempt.hung:
                out.reason = "upstream_hung"
                await _send(client, prefix + sse_error_event(
                    f"upstream {rep.id} stopped working on this stream (its probes show nothing running)",
                    code="upstream_hung"))
            else:
                self.metrics.upstream_errors.labels(rep.id, "broken_stream").inc()
                self.registry.outcome(rep, False, "broken_stream")
                out.reason = "upstream_broken_stream"
                log.warning("stream from %s broke: %s: %s", rep.id, type(e).__name__, e)
                await _send(client, prefix + sse_error_event(
                    f"upstream {rep.id} broke off the stream ({type(e).__name__})"))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task not in self._cut:
                raise
            task.uncancel()  # SIGTERM's grace ran out: end the stream with a reason, not a cut
            resp.close()
            out.reason = "shutting_down"
            await _send(client, sse_error_event("the load balancer shut down before the stream ended",
                                                code="shutting_down"))
        else:
            self.registry.outcome(rep, True)
        out.usage = _usage_dict(tail)
        await client.write_eof()
        return client

    async def _first_line(self, rep: Replica, resp: aiohttp.ClientResponse, attempt: Attempt) -> bytes:
        """A stream's first line, if it is server-sent events; else _Retry (a malformed or
        broken start counts against the replica's circuit breaker)."""
        try:
            line = await resp.content.readline(max_line_length=self.cfg.upstream.max_sse_line_bytes)
        except (ValueError, LineTooLong):  # longer than upstream.max_sse_line_bytes
            line = b"?"
        except _UPSTREAM_ERRORS as e:
            if attempt.hung:
                raise _Retry("hung") from None
            self.metrics.upstream_errors.labels(rep.id, "broken_stream").inc()
            self.registry.outcome(rep, False, "broken_stream")
            raise _Retry(f"broke before the first byte: {type(e).__name__}") from None
        if line.startswith(_SSE_FIRST):
            return line
        self.metrics.upstream_errors.labels(rep.id, "malformed_sse").inc()
        self.registry.outcome(rep, False, "malformed_sse")
        log.warning("stream from %s is not server-sent events: %r", rep.id, line[:80])
        raise _Retry("malformed_sse")

    def _abort_sglang(self, rep: Replica, doc: dict) -> None:
        rid = doc.get("rid")
        if rep.view.engine != "sglang" or not isinstance(rid, str):
            return

        async def abort() -> None:
            try:
                async with rep.session.post("/abort_request", json={"rid": rid}) as r:
                    await r.read()
            except Exception as e:  # best effort: closing the connection aborts too
                log.debug("abort_request %s on %s: %s", rid, rep.id, e)

        asyncio.get_running_loop().create_task(abort())

    async def fanout(self, request: web.Request, route: Route) -> web.Response:
        """A FANOUT route (lb.daemon.surface.fanout), in the metrics and the access log as one
        request whose target is `all`."""
        t0 = time.monotonic()
        rid = request.headers.get(H_REQUEST_ID) or new_request_id()
        resp = await fanout(request, route, self.registry, self.cfg, rid)
        resp.headers["X-Request-Id"] = rid
        self._account(Outcome(request_id=rid, route=route.name, status=resp.status, target="all",
                              reason="ok" if resp.status < 400 else "fanout_failed", e2e_s=time.monotonic() - t0))
        return resp

    def _account(self, out: Outcome) -> None:
        m = self.metrics
        if self.peer_links is not None:
            self.peer_links.account(out)
        target = m.target(out.target) if out.target else "none"
        m.child(m.requests, out.route, m.model(out.model, self.registry.lists_model), str(out.status),
                self.dispatcher.policy.name, target).inc()
        if out.ttft_s is not None:
            m.child(m.ttft, out.route).observe(out.ttft_s)
        if 200 <= out.status < 300:
            m.child(m.e2e, out.route).observe(out.e2e_s)
        if out.usage:
            m.child(m.prompt_tokens, target).inc(out.usage["prompt_tokens"])
            m.child(m.cached_tokens, target).inc(out.usage["cached_tokens"])
            m.child(m.output_tokens, target).inc(out.usage["completion_tokens"])
        if self.access_log is not None:
            self.access_log.write(out)


# Request ids: 64 random bits per process, then a counter: unique across LBs and restarts
# without uuid4's urandom call and UUID object per request (profiled on the request path).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


_RID_ROUTES = ("chat", "completions", "generate")  # SGLang's requests that take a `rid`


def _with_sglang_rid(engine: str, route: str, doc: dict, body: bytes) -> tuple[dict, bytes]:
    """Give a request to an SGLang replica a `rid` of ours when it has none, so that a client
    leaving can be aborted by `/abort_request` as well as by the closed connection (SGLang
    notices a closed non-streamed request only at its next disconnect check). Batches and
    `n > 1` keep their own request ids (SGLang derives one per sequence from them).
    Returns the document as sent (for the abort) and its bytes, spliced, not re-encoded."""
    if engine != "sglang" or route not in _RID_ROUTES or "rid" in doc or not isinstance(doc.get("n", 1), int) or doc.get("n", 1) > 1:
        return doc, body
    batch = doc.get("text") if route == "generate" else doc.get("prompt")
    ids = doc.get("input_ids")
    if isinstance(batch, list) and not all(isinstance(t, int) for t in batch) or (
            isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return doc, body
    rid = f"lb-{new_request_id()}"
    start = body.find(b"{") + 1
    if not doc or start <= 0:
        return {**doc, "rid": rid}, orjson.dumps({**doc, "rid": rid})
    return {**doc, "rid": rid}, body[:start] + b'"rid":' + orjson.dumps(rid) + b"," + body[start:]


def _fail_body_on_close(resp: aiohttp.ClientResponse):
    """aiohttp (3.14) leaves a body read waiting forever when the replica's bytes break HTTP
    mid-body (a bad chunk size after the first chunk): its parser closes the connection but
    never tells the body's stream. Tell it here when the connection closes first. Returns
    the undo (a keep-alive connection outlives this response)."""
    protocol = resp.connection.protocol if resp.connection is not None else None
    closed = protocol.closed if protocol is not None else None
    if closed is None:
        return lambda: None
    content = resp.content

    def on_close(f: asyncio.Future) -> None:
        if not f.cancelled():
            f.exception()  # retrieved: no "never retrieved" warning
        if content.exception() is None and not content.is_eof():
            content.set_exception(aiohttp.ClientPayloadError("the replica's connection closed mid-body"))

    closed.add_done_callback(on_close)
    return lambda: closed.remove_done_callback(on_close)


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """A response body up to `limit` bytes: (the bytes, True) when that is all of it, else
    (the first `limit` bytes, False), without reading (or holding) the rest."""
    if resp.content_length is not None and resp.content_length <= limit and not resp.headers.get("Content-Encoding"):
        return await resp.read(), True
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await resp.content.read(limit + 1 - len(buf))
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf[:limit]), False


def _usage_dict(tail: bytes) -> dict:
    u = usage_from_tail(tail)
    return {} if u is None else {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                                 "completion_tokens": u.completion_tokens}
