"""OpenAI-shaped errors: the ones `lb` answers itself, and the engines' ones normalized.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}`, whether it
came from `lb` (queue full, no replica, bad JSON) or from an engine (SGLang's flat
`{object: "error", message, ...}` is rewrapped).
"""
from __future__ import annotations

import orjson
from aiohttp import web

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


def error_body(message: str, status: int, *, param: str | None = None, code: str | None = None,
               type: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type or _TYPES.get(status, "server_error"),
                                   "param": param, "code": code}})


class LBError(Exception):
    """An answer `lb` gives instead of forwarding; `reason` goes to the access log."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 retry_after: int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after
        self.headers = headers or {}  # e.g. the x-ratelimit-* of a throttle

    @property
    def reason(self) -> str:
        return self.code

    def response(self, request_id: str | None = None) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if request_id:
            headers["X-Request-Id"] = request_id
        return web.Response(status=self.status, headers=headers, content_type="application/json",
                            body=error_body(self.message, self.status, param=self.param, code=self.code))


@web.middleware
async def answer_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every handler's `LBError` becomes its OpenAI-shaped answer here, in one place (the
    proxy answers its own first, to account and log them; admin and the rest raise)."""
    try:
        return await handler(request)
    except LBError as e:
        return e.response(request.headers.get("X-Request-Id"))


def normalize_upstream_error(status: int, body: bytes) -> bytes:
    """An engine's error body in the OpenAI shape, keeping its message, type, param and code."""
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        err = doc["error"]
    elif isinstance(doc, dict) and ("message" in doc or doc.get("object") == "error"):
        err = doc  # SGLang's flat shape
    elif isinstance(doc, dict) and isinstance(doc.get("error"), str):
        err = {"message": doc["error"]}
    else:
        text = body.decode("utf-8", "replace").strip()[:500] if body else ""
        err = {"message": text or f"upstream answered HTTP {status}"}
    code = err.get("code")
    return orjson.dumps({"error": {
        "message": str(err.get("message") or f"upstream answered HTTP {status}"),
        "type": err.get("type") or _TYPES.get(status, "server_error"),
        "param": err.get("param"),
        "code": code if isinstance(code, (str, int)) or code is None else str(code),
    }})


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """What ends a stream that broke after its first byte: an error event, then [DONE]."""
    return (b"data: " + orjson.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                                 "code": code}}) + b"\n\ndata: [DONE]\n\n")
