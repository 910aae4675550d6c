"""Request bodies of the emulator's faces (OpenAI chat/completions, SGLang /generate), checked.

Everything a client can get wrong becomes an `ApiError` carrying the OpenAI error object, so
handlers never answer 500 for bad input.
"""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

import orjson

from bench.tokenizer import encode, render_chat


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or {400: "BadRequestError", 404: "NotFoundError",
                              503: "ServiceUnavailableError"}.get(status, "InternalServerError")

    def body(self) -> bytes:
        # vLLM's nested shape (SGLang's is flat); `code` is the status, as vLLM sends it.
        return orjson.dumps({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.status}})


@dataclass
class GenRequest:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int | None  # None: up to the context limit
    ignore_eos: bool
    priority: int
    stream: bool
    include_usage: bool
    model: str | None
    sample_key: int | None = None  # bench.engine.EngineRequest.sample_key (`sample_key` below)
    min_new_tokens: int = 0  # bench.engine.EngineRequest.min_new_tokens (`min_tokens`)
    n: int = 1  # parallel sampling: this many answers to the one prompt (the API's `n`)
    lora_path: str | None = None  # SGLang's /generate: the LoRA adapter it runs with
    adapter: str | None = None  # the LoRA adapter it runs with, once the emulator has resolved its name

    def sample_key_of(self, i: int) -> int | None:
        """Sample i's draw: `sample_key` + i, as vLLM seeds child i with `seed + i`
        (v1/engine/parallel_sampling.py), so sample 0 draws what n=1 draws. Greedy decoding
        (None) gives every sample the same answer, as it does on a real engine."""
        return None if self.sample_key is None else self.sample_key + i


def parse_json(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"Malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _typed(body: dict, key: str, types: type | tuple, what: str, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; JSON true is not an integer
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise ApiError(400, f"'{key}' must be {what}.", key)
    return value


def _as_tuple(types: type | tuple) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _positive(body: dict, key: str) -> int | None:
    value = _typed(body, key, int, "an integer")
    if value is not None and value < 1:
        raise ApiError(400, f"'{key}' must be at least 1.", key)
    return value


MAX_SAMPLES = 128  # OpenAI's bound on `n`


def _sample_count(options: dict) -> int:
    n = _typed(options, "n", int, "an integer", 1)
    if not 1 <= n <= MAX_SAMPLES:
        raise ApiError(400, f"'n' must be between 1 and {MAX_SAMPLES}.", "n")
    return n


def sample_key(params: dict) -> int | None:
    """How the answer is drawn. Greedy decoding (`temperature` 0) answers a prompt the same way
    each time: None, the answer follows the prompt. Sampled decoding (the API's default
    temperature is 1) answers it differently each time unless `seed` fixes the draw, so two
    clients asking the same question share its prompt's cache but not their answers."""
    temperature = _typed(params, "temperature", (int, float), "a number")
    if temperature == 0:
        return None
    seed = _typed(params, "seed", int, "an integer")
    return seed if seed is not None else random.getrandbits(63)


def _common(body: dict, prompt_ids: list[int], max_new: int | None, ignore_eos: bool,
            stream: bool, include_usage: bool, n: int = 1,
            params: dict | None = None) -> GenRequest:
    """`params`: where the sampling options are (SGLang's `sampling_params`; else the body)."""
    rid = _typed(body, "rid", str, "a string") or uuid.uuid4().hex
    priority = _typed(body, "priority", int, "an integer", 0)
    model = _typed(body, "model", str, "a string")
    if not prompt_ids:
        raise ApiError(400, "The prompt is empty.", "prompt")
    options = body if params is None else params
    min_new = _typed(options, "min_new_tokens" if params is not None else "min_tokens", int, "an integer", 0)
    if min_new < 0:
        raise ApiError(400, "'min_tokens' must be at least 0.", "min_tokens")
    lora_path = _typed(body, "lora_path", str, "a string") if params is not None else None
    return GenRequest(rid, prompt_ids, max_new, ignore_eos, priority, stream, include_usage, model,
                      sample_key(options), min_new, n, lora_path)


def _openai_options(body: dict) -> tuple[int | None, bool, bool, bool, int]:
    for key in ("top_p", "presence_penalty", "frequency_penalty"):  # temperature: `sample_key`
        _typed(body, key, (int, float), "a number")
    # SGLang Router rewrites max_tokens into max_completion_tokens; either is honoured
    max_new = _positive(body, "max_completion_tokens")
    if max_new is None:
        max_new = _positive(body, "max_tokens")
    ignore_eos = _typed(body, "ignore_eos", bool, "a boolean", False)
    stream = _typed(body, "stream", bool, "a boolean", False)
    options = _typed(body, "stream_options", dict, "an object", {})
    include_usage = _typed(options, "include_usage", bool, "a boolean", False)
    return max_new, ignore_eos, stream, include_usage, _sample_count(body)


def parse_chat(body: dict) -> GenRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array.", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, "Each message must be an object with a string 'role'.", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(400, "A message's 'content' must be a string or an array of parts.",
                           "messages")
    return _common(body, encode(render_chat(messages)), *_openai_options(body))


def _prompt_ids(prompt: object, key: str) -> list[int]:
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _prompt_ids(prompt[0], key)  # a batch of one
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return list(prompt)
    raise ApiError(400, f"'{key}' must be a string, one string in an array, or token ids "
                        "(batches are not supported).", key)


def parse_completion(body: dict) -> GenRequest:
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required.", "prompt")
    return _common(body, _prompt_ids(body["prompt"], "prompt"), *_openai_options(body))


def parse_generate(body: dict) -> GenRequest:
    """SGLang's native /generate: text or input_ids, sampling_params, stream, rid."""
    if body.get("text") is not None:
        ids = _prompt_ids(body["text"], "text")
    elif body.get("input_ids") is not None:
        ids = _prompt_ids(body["input_ids"], "input_ids")
    else:
        raise ApiError(400, "Either 'text' or 'input_ids' is required.", "text")
    params = _typed(body, "sampling_params", dict, "an object", {})
    max_new = _positive(params, "max_new_tokens")
    ignore_eos = _typed(params, "ignore_eos", bool, "a boolean", False)
    stream = _typed(body, "stream", bool, "a boolean", False)
    # SGLang's default max_new_tokens for /generate is 128
    return _common(body, ids, 128 if max_new is None else max_new, ignore_eos, stream, False,
                   _sample_count(params), params)


def parse_responses(body: dict) -> GenRequest:
    """OpenAI Responses: `input` a string or a list of messages, `max_output_tokens`."""
    value = body.get("input")
    if isinstance(value, str):
        ids = encode(value)
    elif isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        ids = encode(render_chat([{"role": str(m.get("role", "user")), "content": m.get("content")} for m in value]))
    else:
        raise ApiError(400, "'input' must be a string or a list of messages.", "input")
    max_new = _positive(body, "max_output_tokens")
    stream = _typed(body, "stream", bool, "a boolean", False)
    return _common(body, ids, max_new, False, stream, False)
