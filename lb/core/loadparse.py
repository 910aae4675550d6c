"""Turn engines' load and usage responses into numbers, without trusting their shape.

Each parser takes the raw response (bytes or a decoded JSON value) of one endpoint and
returns an `EngineLoad`, or raises `ValueError` when the response is not that endpoint's shape, so
the daemon's adapter can fall back to the next endpoint. Shapes are those SGLang, vLLM
and llama.cpp serve (see the tests in tests/core/test_health_loadparse.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import orjson


@dataclass(frozen=True)
class EngineLoad:
    pending: int  # requests waiting inside the engine (not yet admitted to the batch)
    running: int | None = None
    kv_usage: float | None = None  # 0..1
    kv_free_tokens: int | None = None  # KV tokens not held by requests (SGLang /v1/loads)
    kv_total_tokens: int | None = None  # the whole KV cache in tokens (summed over dp ranks / engines)
    max_running: int | None = None  # the engine's batch cap
    preemptions: float | None = None  # requests it preempted since it started (a counter)
    # requests it preempted in its last stats window (SGLang's /v1/loads `queues.retracted`: a
    # count that starts over every 40 decode batches, so it says "lately", not how many in all)
    retracted_lately: int | None = None
    reserves: bool = False  # it reserves KV for answers at admission (SGLang), so preempts only short of its estimate
    # the first tokens it has produced since it started (its TTFT histogram's count)
    first_tokens: int | None = None
    # LoRA (vLLM's `vllm:lora_requests_info`): the adapters its batch runs, and how many it may
    # (None where the endpoint does not say)
    running_adapters: frozenset[str] | None = None
    max_loras: int | None = None


def _dp_ranks(value: object) -> list[dict]:
    if not isinstance(value, list) or not value or not all(isinstance(r, dict) for r in value):
        raise ValueError("expected a non-empty list of per-dp-rank objects")
    return value


def parse_sglang_v1_loads(body: bytes) -> EngineLoad:
    """SGLang `GET /v1/loads`: `{loads: [{num_waiting_reqs, num_running_reqs, token_usage}]}`."""
    doc = orjson.loads(body)
    ranks = _dp_ranks(doc.get("loads") if isinstance(doc, dict) else None)
    usage = [r["token_usage"] for r in ranks if isinstance(r.get("token_usage"), (int, float))]
    sized = all(isinstance(r.get("max_total_num_tokens"), int) and isinstance(r.get("num_used_tokens"), int)
                for r in ranks)
    caps = [r.get("max_running_requests") for r in ranks]
    retracted = [r["queues"].get("retracted") for r in ranks if isinstance(r.get("queues"), dict)]
    return EngineLoad(
        pending=sum(int(r["num_waiting_reqs"]) for r in ranks),
        running=sum(int(r.get("num_running_reqs", 0)) for r in ranks),
        kv_usage=max(usage) if usage else None,
        # the most room one rank has: a request lands on one rank, not on their sum
        kv_free_tokens=max(r["max_total_num_tokens"] - r["num_used_tokens"] for r in ranks) if sized else None,
        kv_total_tokens=sum(r["max_total_num_tokens"] for r in ranks) if sized else None,
        max_running=sum(caps) if all(isinstance(c, int) and c > 0 for c in caps) else None,
        retracted_lately=sum(retracted) if retracted and all(isinstance(n, int) for n in retracted) else None,
        reserves=True,
    )


def parse_sglang_get_load(body: bytes) -> EngineLoad:
    """SGLang `GET /get_load`: a list per dp rank `[{num_reqs, num_waiting_reqs, num_tokens}]`.

    `num_reqs` counts running + waiting in the versions that have both fields.
    """
    doc = orjson.loads(body)
    if isinstance(doc, dict) and "load" in doc:  # oldest shape: one number, no split
        raise ValueError("`{load: N}` has no pending count")
    ranks = _dp_ranks(doc)
    pending = sum(int(r["num_waiting_reqs"]) for r in ranks)
    total = sum(int(r.get("num_reqs", 0)) for r in ranks)
    return EngineLoad(pending=pending, running=max(0, total - pending))


def samples(text: bytes, name: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(label set, value) of each sample line of metric `name` in a Prometheus text page.

    Found with bytes.find, not by splitting the page: vLLM 0.32's /metrics is 53 kB and 644
    lines (histograms of every latency), and a probe per replica every 100 ms, plus one soon
    after each push, must not walk all of it in Python (a line walk took 1.3 ms per page).
    """
    needle = b"\n" + name
    at = 0 if text.startswith(name) else _line_at(text.find(needle))
    while at >= 0:
        end = text.find(b"\n", at)
        line = text[at:] if end < 0 else text[at:end]
        sep = line[len(name):len(name) + 1]  # not a longer name that starts with this one
        if sep == b"{":  # a label set, then the value (label values may hold spaces)
            labels, _, rest = line[len(name):].rpartition(b"}")
            yield labels + b"}", rest.strip()
        elif sep == b" ":
            yield b"", line[len(name):].strip()
        if end < 0:
            return
        at = _line_at(text.find(needle, end))


def _line_at(newline: int) -> int:
    """Where the line after a newline found by `find` starts; -1 when none was found."""
    return -1 if newline < 0 else newline + 1


def prometheus_values(text: bytes, names: Iterable[str]) -> dict[str, float]:
    """Sum each named sample over its label sets; names absent from `text` are absent."""
    out: dict[str, float] = {}
    for n in names:
        for _, value in samples(text, n.encode()):
            try:
                v = float(value.split()[0])
            except (ValueError, IndexError):
                continue
            out[n] = out.get(n, 0.0) + v
    return out


# SGLang's `--schedule-policy` values that order its waiting queue by the cache (schedule_policy.py
# `CacheAwarePolicy`): "lpm" (longest cached prefix first; the default of older releases) and
# "dfs-weight". Current releases default to "fcfs", arrival order.
CACHE_AWARE_POLICIES = frozenset({"lpm", "dfs-weight"})


def orders_by_prefix(server_info: bytes) -> bool:
    """SGLang `GET /server_info` (older `/get_server_info`: its server arguments at the top level):
    does the engine admit a waiting request with a cached prefix ahead of those without one?
    False for any other shape: an engine that does not say is taken to admit in arrival order."""
    doc = orjson.loads(server_info)
    policy = doc.get("schedule_policy") if isinstance(doc, dict) else None
    return isinstance(policy, str) and policy in CACHE_AWARE_POLICIES


def lora_limit(server_info: bytes) -> int | None:
    """SGLang `GET /server_info`: how many LoRA adapters one batch runs (`max_loras_per_batch`)
    where it serves any (`enable_lora`, or adapters in `lora_paths`); None otherwise."""
    doc = orjson.loads(server_info)
    if not isinstance(doc, dict) or not (doc.get("enable_lora") is True or doc.get("lora_paths")):
        return None
    limit = doc.get("max_loras_per_batch")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def _metrics_parser(pending: str, running: str, kv: str | None, kv_scale: float = 1.0,
                    preemptions: str | None = None, reserves: bool = False,
                    first_tokens: str | None = None) -> Callable[[bytes], EngineLoad]:
    names = [n for n in (pending, running, kv, preemptions, first_tokens) if n]

    def parse(body: bytes) -> EngineLoad:
        vals = prometheus_values(body, names)
        if pending not in vals:
            raise ValueError(f"/metrics has no {pending}")
        kv_usage = vals.get(kv) if kv else None
        return EngineLoad(
            pending=int(vals[pending]),
            running=int(vals[running]) if running in vals else None,
            kv_usage=None if kv_usage is None else kv_usage * kv_scale,
            preemptions=vals.get(preemptions) if preemptions else None,
            reserves=reserves,
            first_tokens=int(vals[first_tokens]) if first_tokens in vals else None,
        )

    parse.__name__ = f"parse_{pending.split(':')[0]}_metrics"
    return parse


# the retraction counter: SGLang's /metrics since 2025 (`sglang:num_retracted_reqs` beside it is a
# gauge of the last stats window, zeroed at each log: no total)
parse_sglang_metrics = _metrics_parser("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage",
                                       preemptions="sglang:num_retracted_requests_total", reserves=True,
                                       first_tokens="sglang:time_to_first_token_seconds_count")
_VLLM_KV_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")  # the latter: before v0.10
_VLLM_CACHE_INFO = b"vllm:cache_config_info"
_VLLM_FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"  # the TTFT histogram's count


def _label(labels: bytes, key: bytes) -> bytes | None:
    """The value of one label in a `{k="v",...}` set (values here are numbers or names: no escapes)."""
    at = labels.find(key + b'="')
    if at < 0 or (at > 0 and labels[at - 1] not in b"{, "):
        return None
    start = at + len(key) + 2
    end = labels.find(b'"', start)
    return labels[start:end] if end >= 0 else None


def _vllm_kv(text: bytes) -> tuple[float | None, int | None, int | None]:
    """(KV usage 0..1, free KV tokens, all engines' KV tokens) from vLLM's `/metrics`, per
    engine (data-parallel rank).

    vLLM publishes KV usage as a fraction (`vllm:kv_cache_usage_perc`, `vllm:gpu_cache_usage_perc`
    before v0.10) and its capacity as labels of the info gauge `vllm:cache_config_info`
    (`num_gpu_blocks`, `block_size`; vllm/v1/metrics/loggers.py `log_metrics_info`), so free
    tokens = (1 - usage) x blocks x block size. A request lands on one engine: the most room
    one engine has is what one push can use, as for SGLang's dp ranks.
    """
    usage: dict[bytes, float] = {}
    for name in reversed(_VLLM_KV_USAGE):  # the current name last: it wins when a version serves both
        for labels, value in samples(text, name):
            try:
                usage[_label(labels, b"engine") or b""] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    capacity: dict[bytes, int] = {}
    for labels, _ in samples(text, _VLLM_CACHE_INFO):
        blocks, size = _label(labels, b"num_gpu_blocks"), _label(labels, b"block_size")
        if blocks and size and blocks.isdigit() and size.isdigit():  # "None" before profiling
            capacity[_label(labels, b"engine") or b""] = int(blocks) * int(size)
    if not usage:
        return None, None, None
    free = [int((1.0 - min(1.0, max(0.0, u))) * capacity[e]) for e, u in usage.items() if e in capacity]
    return max(usage.values()), (max(free) if free else None), (sum(capacity.values()) if capacity else None)


_VLLM_LORA_INFO = b"vllm:lora_requests_info"


def _vllm_lora(text: bytes) -> tuple[frozenset[str] | None, int | None]:
    """(the LoRA adapters running, max LoRAs a batch runs) from vLLM's `/metrics`: the info gauge
    `vllm:lora_requests_info` (labels `running_lora_adapters`, comma-separated, and `max_lora`;
    vllm/v1/metrics/loggers.py). Its value is the time it was set, and each set of adapters seen
    stays a series of its own, so the newest series is the present one."""
    newest, at = None, -1.0
    for labels, value in samples(text, _VLLM_LORA_INFO):
        try:
            t = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        if t > at:
            newest, at = labels, t
    if newest is None:
        return None, None
    limit = _label(newest, b"max_lora")
    running = _label(newest, b"running_lora_adapters") or b""
    return (frozenset(a for a in running.decode("utf-8", "replace").split(",") if a),
            int(limit) if limit and limit.isdigit() and int(limit) > 0 else None)


def parse_vllm_metrics(body: bytes) -> EngineLoad:
    """vLLM `/metrics`: waiting and running summed over engines, KV usage and free KV tokens
    (`_vllm_kv`) so SP-P's headroom works as it does for SGLang's `/v1/loads`, and the first
    tokens it has produced (its TTFT histogram's count: lb.core.backlog)."""
    vals = prometheus_values(body, ("vllm:num_requests_waiting", "vllm:num_requests_running",
                                    "vllm:num_preemptions_total", _VLLM_FIRST_TOKENS))
    if "vllm:num_requests_waiting" not in vals:
        raise ValueError("/metrics has no vllm:num_requests_waiting")
    kv_usage, kv_free, kv_total = _vllm_kv(body)
    running = vals.get("vllm:num_requests_running")
    adapters, max_loras = _vllm_lora(body)
    return EngineLoad(pending=int(vals["vllm:num_requests_waiting"]),
                running=None if running is None else int(running),
                kv_usage=kv_usage, kv_free_tokens=kv_free, kv_total_tokens=kv_total,
                preemptions=vals.get("vllm:num_preemptions_total"),
                first_tokens=int(vals[_VLLM_FIRST_TOKENS]) if _VLLM_FIRST_TOKENS in vals else None,
                running_adapters=adapters, max_loras=max_loras)


parse_llamacpp_metrics = _metrics_parser("llamacpp:requests_deferred", "llamacpp:requests_processing", None)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


FAST_OBJECT_TRIES = 8  # closing braces tried before the byte-by-byte scan


def usage_from_tail(tail: bytes) -> Usage | None:
    """The last `"usage": {...}` object in the tail of a response (JSON body or SSE stream).

    The proxy keeps only the last few kB of what it forwarded, so token accounting costs one
    small parse per request instead of one per chunk.
    """
    at = tail.rfind(b'"usage"')
    while at >= 0:
        start = _value_start(tail, at + len(b'"usage"'))
        u = _object_at(tail, start) if start >= 0 else None
        if isinstance(u, dict):  # Chat/Completions names, else the Responses API's
            details = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
            return Usage(
                prompt_tokens=int(u.get("prompt_tokens") or u.get("input_tokens") or 0),
                cached_tokens=int((details.get("cached_tokens") if isinstance(details, dict) else 0) or 0),
                completion_tokens=int(u.get("completion_tokens") or u.get("output_tokens") or 0),
            )
        at = tail.rfind(b'"usage"', 0, at)
    return None


def _value_start(buf: bytes, i: int) -> int:
    """Index of the `{` opening the value after a key, or -1 (e.g. `"usage": null`)."""
    n = len(buf)
    while i < n and buf[i] in b" \t:":
        i += 1
    return i if i < n and buf[i] == 123 else -1


def _object_at(buf: bytes, start: int) -> object | None:
    """The JSON object that opens at `start`, decoded; None when it does not end in `buf` or
    is not JSON. Fast path: the first `}` where the braces balance and the bytes parse ends the
    object (a JSON object has no proper prefix that is itself an object); byte by byte only
    when a brace inside a string gets in the way (profiled on the request path)."""
    end = buf.find(b"}", start)
    for _ in range(FAST_OBJECT_TRIES):
        if end < 0:
            break
        piece = buf[start:end + 1]
        if piece.count(b"{") == piece.count(b"}"):
            try:
                return orjson.loads(piece)
            except orjson.JSONDecodeError:
                pass
        end = buf.find(b"}", end + 1)
    piece = _balanced_object(buf, start)
    if piece is None:
        return None
    try:
        return orjson.loads(piece)
    except orjson.JSONDecodeError:
        return None


def _balanced_object(buf: bytes, start: int) -> bytes | None:
    depth, in_str, esc = 0, False, False
    for i in range(start, len(buf)):
        c = buf[i]
        if in_str:
            if esc:
                esc = False
            elif c == 92:  # backslash
                esc = True
            elif c == 34:
                in_str = False
        elif c == 34:
            in_str = True
        elif c == 123:
            depth += 1
        elif c == 125:
            depth -= 1
            if depth == 0:
                return buf[start:i + 1]
    return None
