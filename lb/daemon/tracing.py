"""OpenTelemetry spans (the `otel` extra): one per request (`lb.request`, a child of the
client's `traceparent`), its queue wait (`lb.queue_wait`), and each upstream attempt
(`lb.upstream`, or `lb.peer_forward` to a peer LB) whose context goes to the replica or peer
as `traceparent`/`tracestate`.

On when `[server] tracing = true`, or when the standard environment asks for it
(`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_TRACES_EXPORTER`
set, and neither `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none`). The exporter is
configured the standard way: OTLP over HTTP/protobuf reads `OTEL_EXPORTER_OTLP_*` itself,
`OTEL_SERVICE_NAME`/`OTEL_RESOURCE_ATTRIBUTES` name the service (default `lb`). A process that
already installed a tracer provider (a test's in-memory exporter, an embedding app) keeps it.

Off, `NoTracing` is used: opentelemetry is never imported and each hook is an empty call.
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("lb.tracing")


def wanted(cfg, env=os.environ) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    return bool(cfg.server.tracing or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_TRACES_EXPORTER"))


class NoTracing:
    """Tracing off: every hook does nothing (and nothing was imported)."""

    enabled = False

    def start_request(self, request, route: str):
        return None

    def end_request(self, handle, out) -> None:
        pass

    def queue_wait(self, waited_s: float) -> None:
        pass

    def start_attempt(self, rep, n: int):
        return None

    def headers(self, span, headers: dict) -> dict:
        return headers

    def end_attempt(self, span, out) -> None:
        pass


class Tracing:
    enabled = True

    def __init__(self):
        from opentelemetry import context, propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self._context, self._propagate, self._trace = context, propagate, trace
        self._kinds, self._status, self._code = SpanKind, Status, StatusCode
        _install_provider(trace)
        self.tracer = trace.get_tracer("lb")

    def start_request(self, request, route: str):
        parent = self._propagate.extract(request.headers)  # the client's traceparent, if any
        span = self.tracer.start_span("lb.request", context=parent, kind=self._kinds.SERVER,
                                      attributes={"http.request.method": request.method, "http.route": route})
        return span, self._context.attach(self._trace.set_span_in_context(span, parent))

    def end_request(self, handle, out) -> None:
        span, token = handle
        span.set_attribute("http.response.status_code", out.status)
        for key, value in (("lb.model", out.model), ("lb.replica", out.target), ("lb.reason", out.reason),
                           ("lb.attempts", out.attempts)):
            if value:
                span.set_attribute(key, value)
        if out.status >= 500:
            span.set_status(self._status(self._code.ERROR, out.reason or None))
        span.end()
        try:
            self._context.detach(token)
        except Exception:  # detached in another task (a coalesced follower): the span still ended
            pass

    def queue_wait(self, waited_s: float) -> None:
        end = time.time_ns()
        self.tracer.start_span("lb.queue_wait", start_time=end - int(waited_s * 1e9)).end(end_time=end)

    def start_attempt(self, rep, n: int):
        peer = rep.view.engine == "peer"
        return self.tracer.start_span("lb.peer_forward" if peer else "lb.upstream", kind=self._kinds.CLIENT,
                                      attributes={"lb.replica": rep.id, "lb.attempt": n,
                                                  "server.address": rep.cfg.url, "lb.engine": rep.view.engine})

    def headers(self, span, headers: dict) -> dict:
        """The attempt's context as `traceparent` (replacing the client's: the replica's spans
        become children of this attempt, itself a child of the client's)."""
        carrier = {k: v for k, v in headers.items() if k.lower() not in ("traceparent", "tracestate")}
        self._propagate.inject(carrier, context=self._trace.set_span_in_context(span))
        return carrier

    def end_attempt(self, span, out) -> None:
        if out.status:
            span.set_attribute("http.response.status_code", out.status)
        if out.status >= 500 or not out.status:
            span.set_status(self._status(self._code.ERROR, out.reason or "no answer"))
        span.end()


def _install_provider(trace) -> None:
    """A provider with the exporter OTEL_TRACES_EXPORTER names (otlp by default, console), unless
    this process already has one."""
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "lb"}
    provider = TracerProvider(resource=Resource.create(attrs))
    for name in (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(","):
        name = name.strip().lower()
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads OTEL_EXPORTER_OTLP_*
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s: not supported here (otlp, console); ignored", name)
    trace.set_tracer_provider(provider)


def make_tracing(cfg) -> NoTracing | Tracing:
    if not wanted(cfg):
        return NoTracing()
    try:
        return Tracing()
    except ImportError as e:
        raise SystemExit(f"tracing is on ([server] tracing or OTEL_* variables) but {e.name} is missing: "
                         "pip install 'lb[otel]'") from None
