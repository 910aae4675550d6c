"""Request facts from a parsed body and the client's headers: what routing needs, once.

Body fields (model, prompt, max_tokens, stream), session affinity and residency are read
here; tenant, app, interaction and tier are `lb.core.identity`'s (`parse_identity(...).apply`
fills them into these facts). Internal headers (hop count, peer identity) are never believed from a client: `is_internal_header`
names them so the daemon strips them before anything reads or forwards them.
"""
from __future__ import annotations

from typing import Callable, Mapping

from lb.core.prefix import CHARS_PER_TOKEN
from lb.core.routes import BY_NAME
from lb.core.types import RequestFacts

H_REQUEST_ID = "x-request-id"
H_SESSION = "x-lb-session"
H_RESIDENCY = "x-lb-residency"
# Documented identity headers; `lb.core.identity` parses them (tenant, app, interaction, tier).
H_USER = "x-lb-user"
H_APP = "x-lb-app"
H_INTERACTION_ID = "x-lb-interaction-id"
H_INTERACTION_STAGE = "x-lb-interaction-stage"
H_FINAL_CALL = "x-lb-final-call"
H_TIER = "x-lb-tier"

# Set only by LBs for LBs; a client sending them is ignored (and they are not forwarded).
H_HOP = "x-lb-hop"
INTERNAL_PREFIXES = ("x-lb-hop", "x-lb-peer-", "x-lb-internal-")


class BadRequest(ValueError):
    """A request field or header that cannot be understood; `param` names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def is_internal_header(name: str) -> bool:
    return name.lower().startswith(INTERNAL_PREFIXES)


def _messages_text(messages: object) -> str:
    parts = []
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):  # multimodal parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}\n")
    return "".join(parts)


def prompt_text(route: str, body: dict) -> str:
    """The text prefix hashing works on: the first of the route's prompt fields that is
    present (`lb.core.routes`): rendered messages, a prompt, /generate's text or its ids."""
    spec = BY_NAME.get(route)
    for name in spec.prompt if spec else ("prompt",):
        value = body.get(name)
        if value is None:
            continue
        if name == "messages":
            return _messages_text(value)
        if isinstance(value, list) and name != "input_ids":
            return "".join(p if isinstance(p, str) else str(p) for p in value)
        return value if isinstance(value, str) else str(value)
    return ""


def build_facts(route: str, body: dict, headers: Mapping[str, str], request_id: str, now: float,
                is_adapter: Callable[[str], bool] | None = None) -> RequestFacts:
    """`headers` must be case-insensitive (or lower-case keyed). Raises BadRequest.
    `is_adapter`: whether a model name is a LoRA adapter some replica serves (its card names a
    parent); the request then runs with it (lb.core.adapters), as does SGLang's /generate with a
    `lora_path`.

    Identity fields keep their defaults here; `lb.core.identity` fills them.
    """
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("`model` must be a string", "model")
    if route in ("chat", "completions") and not model:
        raise BadRequest("you must provide a model parameter", "model")
    if route == "chat" and not isinstance(body.get("messages"), list):
        raise BadRequest("`messages` must be a list of messages", "messages")
    if route == "completions" and body.get("prompt") is None:
        raise BadRequest("`prompt` is required", "prompt")

    spec = BY_NAME.get(route)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if spec is not None and spec.output_field:
        max_tokens = body.get(spec.output_field)
    if route == "generate" and isinstance(body.get("sampling_params"), dict):
        max_tokens = body["sampling_params"].get("max_new_tokens")
    if spec is not None and not spec.generates:
        max_tokens = 0  # embeddings, scores, tokenize: no decode, nothing to reserve KV for
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0):
        raise BadRequest("`max_tokens` must be a non-negative integer", "max_tokens")
    samples = body.get("n", 1)
    if route == "generate" and isinstance(body.get("sampling_params"), dict):
        samples = body["sampling_params"].get("n", 1)
    if samples is None:  # an SDK that sends every field sends `"n": null` for the default
        samples = 1
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise BadRequest("`n` must be a positive integer", "n")
    text = prompt_text(route, body)
    adapter = model if model and is_adapter is not None and is_adapter(model) else None
    if route == "generate" and isinstance(body.get("lora_path"), str) and body["lora_path"]:
        adapter = body["lora_path"]
    return RequestFacts(
        request_id=request_id,
        model=model,
        adapter=adapter,
        prompt=text,
        prompt_tokens=len(text) // CHARS_PER_TOKEN,  # a tokenizer-free estimate; engines report the truth
        max_tokens=max_tokens,
        samples=samples,
        stream=bool(body.get("stream")),
        arrival=now,
        session=headers.get(H_SESSION) or None,
        residency=headers.get(H_RESIDENCY) or None,
        hops=0,  # peers (issue 4) set this after authenticating; a client's hop header is ignored
    )
