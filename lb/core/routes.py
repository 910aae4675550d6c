"""The API surface `lb` serves: one declaration per route, and the pure decisions around it.

Each `Route` says where its model is, which engines serve it, and how it is dispatched:

- `QUEUED`: waits in the LB queue and is pushed like a chat request (policy, pushing mode,
  fairness, admission, retries before the first byte). Everything that costs engine time.
- `DIRECT`: goes at once to the least-busy healthy replica serving the model, with retries
  but no queue and no pushing accounting (tokenize/detokenize, a model's card): cheap calls
  that must not wait behind generation.
- `FANOUT`: every healthy replica of the route's engines, answers combined (`combine`).

Paths and shapes follow SGLang's `http_server.py` and vLLM's OpenAI-compatible server
(docs/api.md lists them with each engine's support). The upstream path is the client's path.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Sequence

from lb.core.types import ReplicaView

# where the body is
JSON, MULTIPART, NONE = "json", "multipart", "none"
# where the model is: the body's `model` field, a multipart form field `model`, the path's {model}, nowhere
BODY, FORM, PATH = "body", "form", "path"
# how a request is dispatched
QUEUED, DIRECT, FANOUT = "queued", "direct", "fanout"

SGLANG = frozenset({"sglang"})


@dataclass(frozen=True)
class Route:
    name: str  # the `route` label of metrics and the access log
    paths: tuple[str, ...]  # client paths (aiohttp patterns); each goes upstream unchanged
    methods: tuple[str, ...] = ("POST",)
    body: str = JSON
    model: str = BODY
    model_required: bool = False
    engines: frozenset[str] = frozenset()  # empty: any engine, peer LBs included
    dispatch: str = QUEUED
    generates: bool = False  # produces tokens: max_tokens is read, an SGLang `rid` and tier priority added
    prompt: tuple[str, ...] = ()  # body fields whose text feeds prefix-aware routing, first present wins
    output_field: str = ""  # the body's output-token limit, when not max_tokens/max_completion_tokens

    def accepts(self, view: ReplicaView) -> bool:
        return not self.engines or view.engine in self.engines


ROUTES: tuple[Route, ...] = (
    # generation
    Route("chat", ("/v1/chat/completions",), model_required=True, generates=True, prompt=("messages",)),
    Route("completions", ("/v1/completions",), model_required=True, generates=True, prompt=("prompt",)),
    Route("generate", ("/generate",), engines=SGLANG, generates=True, prompt=("text", "input_ids")),
    Route("responses", ("/v1/responses",), generates=True, prompt=("input",), output_field="max_output_tokens"),
    # pooling models and scoring
    Route("embeddings", ("/v1/embeddings",), prompt=("input", "messages")),
    Route("rerank", ("/v1/rerank", "/rerank", "/v2/rerank"), prompt=("query",)),
    Route("score", ("/v1/score", "/score"), prompt=("text_1", "query")),
    Route("classify", ("/v1/classify", "/classify"), prompt=("input", "text")),
    Route("pooling", ("/pooling",), prompt=("input",)),
    Route("encode", ("/encode",), engines=SGLANG, prompt=("text",)),
    Route("moderations", ("/v1/moderations",), prompt=("input",)),
    # audio: multipart uploads, streamed through (lb.daemon.surface.MultipartBody)
    Route("transcriptions", ("/v1/audio/transcriptions",), body=MULTIPART, model=FORM),
    Route("translations", ("/v1/audio/translations",), body=MULTIPART, model=FORM),
    # cheap calls: no queue
    Route("tokenize", ("/tokenize", "/v1/tokenize"), dispatch=DIRECT, prompt=("prompt", "messages")),
    Route("detokenize", ("/detokenize", "/v1/detokenize"), dispatch=DIRECT),
    Route("model", ("/v1/models/{model:.+}",), methods=("GET",), body=NONE, model=PATH, dispatch=DIRECT),
    # SGLang's native control routes: every replica, one combined answer
    Route("model_info", ("/get_model_info", "/model_info"), methods=("GET",), body=NONE, model=NONE,
          engines=SGLANG, dispatch=FANOUT),
    Route("server_info", ("/get_server_info", "/server_info"), methods=("GET",), body=NONE, model=NONE,
          engines=SGLANG, dispatch=FANOUT),
    Route("flush_cache", ("/flush_cache",), methods=("GET", "POST"), body=NONE, model=NONE, engines=SGLANG,
          dispatch=FANOUT),
    # a stored response lives on the replica that made it: ask them all, answer the one that has it
    Route("response", ("/v1/responses/{id}",), methods=("GET",), body=NONE, model=NONE, dispatch=FANOUT),
    Route("response_cancel", ("/v1/responses/{id}/cancel",), body=NONE, model=NONE, dispatch=FANOUT),
)
BY_NAME: dict[str, Route] = {r.name: r for r in ROUTES}


def direct_target(targets: Iterable, model: str, accepts: Callable[[ReplicaView], bool],
                  tried: Collection[str], now: float):
    """A DIRECT request's replica (anything with `.view` and `.breaker`, as the scheduler's
    targets): healthy, not draining, serving the model, its circuit closed; one not tried yet
    if there is one; the fewest requests in flight, ties by id. Pushing headroom is not asked:
    a tokenize call takes no KV. None when nothing qualifies."""
    ok = [t for t in targets if t.view.healthy and not t.view.draining and t.view.serves(model) and accepts(t.view)
          and (t.breaker is None or t.breaker.allows(now))]
    fresh = [t for t in ok if t.view.id not in tried]
    return min(fresh or ok, key=lambda t: (t.view.outstanding, t.view.id), default=None)


_DISPOSITION = re.compile(rb'(?im)^content-disposition:[^\r\n]*?;\s*name="?([^";\r\n]+)"?')


def multipart_field(buf: bytes, boundary: bytes, name: bytes) -> tuple[bool, str | None]:
    """Find form field `name` in the first bytes of a multipart body: (True, value) once its
    part is complete in `buf`, (True, None) when the body ended without it, (False, None)
    when more bytes are needed. Only whole parts are read, so a value is never cut."""
    delim = b"--" + boundary
    parts = buf.split(delim)
    # parts[0] is the preamble; a part is complete when another delimiter follows it
    for part in parts[1:-1]:
        head, sep, value = part.partition(b"\r\n\r\n")
        m = _DISPOSITION.search(head)
        if sep and m and m.group(1) == name:
            return True, value[:-2].decode("utf-8", "replace") if value.endswith(b"\r\n") else value.decode(
                "utf-8", "replace")
    last = parts[-1] if len(parts) > 1 else b""
    return (True, None) if last.startswith(b"--") else (False, None)


@dataclass(frozen=True)
class FanoutFailure:
    """A FANOUT call with no answer to pass on: why (`code`, `message`, `param`), the worst
    replica status when one answered with an error (None when none did), every replica's answer.
    HTTP-free: the daemon turns it into a response (lb.daemon.surface)."""
    code: str
    message: str
    param: str | None = None
    replica_status: int | None = None
    replicas: tuple = ()


def combine(route: str, answers: Sequence[tuple[str, int, object]]) -> tuple[int, dict] | FanoutFailure:
    """One answer from every replica's (id, HTTP status or 0 when unreachable, parsed body or
    text) for a FANOUT route: a replica's own (status, body) passed on, or a FanoutFailure. A
    stored response's (`response`, `response_cancel`) is the answer of the replica that has it.
    `model_info`/`server_info` keep the first good answer's shape, so a client reading e.g.
    `model_path` works as against one engine; every replica's answer is under `lb_replicas`.
    `flush_cache` succeeds only when every replica flushed."""
    per = [{"id": rid, "status": status, "body": body} for rid, status, body in answers]
    ok = [a for a in per if 200 <= a["status"] < 300]
    failed = [a for a in per if a not in ok]
    if route == "flush_cache":
        if not failed:
            return 200, {"message": f"Cache flushed on {len(ok)} replicas.", "flushed": len(ok), "failed": 0,
                         "lb_replicas": per}
        return FanoutFailure("flush_failed", f"cache not flushed on {len(failed)} of {len(per)} replicas: "
                             + ", ".join(f"{a['id']} ({a['status'] or 'unreachable'})" for a in failed),
                             replica_status=max(a["status"] for a in failed) or None, replicas=tuple(per))
    if route in ("response", "response_cancel"):  # the owner's answer as it is, success or its error
        owner = ok or [a for a in failed if a["status"] not in (0, 404)]
        if owner:
            return owner[0]["status"], owner[0]["body"]
        return FanoutFailure("response_not_found", "no replica has this response", param="response_id")
    if not ok:
        return FanoutFailure("upstream_unavailable", "no replica answered " + route, replicas=tuple(per))
    first = ok[0]["body"]
    return 200, {**(first if isinstance(first, dict) else {"answer": first}), "lb_replicas": per}
