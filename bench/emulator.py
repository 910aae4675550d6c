"""`lb-bench emulate`: the engine model behind real HTTP, with SGLang's and vLLM's faces.

One task (`Driver.run`) drives the engine: it sleeps until the engine's next event (never
ticks while idle), runs a step, sleeps that step's duration divided by `--speed`, and hands
every stream its token of the step at once. Handlers only wait on their stream's event and
write SSE. A client that disconnects aborts its request inside the engine (its KV is freed),
as a real engine's abort does. A request for `n` answers (parallel sampling) runs as n engine
requests, one stream each, as SGLang and vLLM fan it out.

Faces: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models` and
`/v1/models/{id}`, `/v1/embeddings`, `/v1/audio/transcriptions|translations`), vLLM's
`/rerank` (`/v1/rerank`, `/v2/rerank`), `/score` (`/v1/score`), `/tokenize` and
`/detokenize` (bench/emulator_api.py), `/reset_prefix_cache` (dev mode's), SGLang
(`/generate`, `/v1/loads`, `/get_load`, `/server_info`, `/model_info` and their `get_`
aliases, `/health`, `/health_generate`, `/ping`, `/flush_cache`, `/abort_request`) and one
`/metrics` carrying both `sglang:*` and `vllm:*` families.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import signal
import time
import uuid
from datetime import datetime, timezone

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bench.emulator_api import ApiFaces
from bench.emulator_requests import (ApiError, GenRequest, parse_chat, parse_completion,
                                     parse_generate, parse_json, parse_responses)
from bench.engine import TTFT_BUCKETS_S, Engine, EngineRequest, Finished, StepResult, sample_ids
from bench.profiles import PROFILES, Profile, get_profile
from bench.tokenizer import decode

VERSION = "0.4.0-emulated"
STORED_RESPONSES = 1000  # finished /v1/responses kept for GET /v1/responses/{id}
EOS_TOKEN_ID = 128009  # Llama 3 <|eot_id|>, reported by /generate on a "stop" finish


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--profile", default="tiny", choices=sorted(PROFILES))
    parser.add_argument("--speed", type=float, default=1.0,
                        help="run engine time this many times faster than real time")
    parser.add_argument("--model", help="served model name (default: the profile's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-adapters", type=int, default=0,
                        help="serve this many LoRA adapters of the model, named lora-0, lora-1, ... (requested "
                             "as the API's `model`, or /generate's `lora_path`)")
    parser.add_argument("--max-loras", type=int,
                        help="LoRA adapters one batch runs (default: vLLM's 1, or SGLang's 8 for an SGLang profile); "
                             "alone, LoRA on with no adapter until one is loaded (POST /v1/load_lora_adapter)")
    parser.add_argument("--max-running", type=int, help="cap on running requests")
    parser.add_argument("--kv-tokens", type=int, help="KV cache capacity in tokens")
    parser.add_argument("--decode-reserve", type=int,
                        help="KV tokens reserved per request at admission")
    parser.add_argument("--prefill-budget", type=int,
                        help="tokens per step (vLLM --max-num-batched-tokens, SGLang --chunked-prefill-size)")
    parser.add_argument("--admit-within-budget", action="store_true",
                        help="admit waiting requests only while the step's token budget lasts, as "
                             "vLLM's V1 scheduler does (a burst of long prompts waits a few steps)")
    parser.add_argument("--max-queued", type=int,
                        help="reject with 503 'The request queue is full.' beyond this many "
                             "waiting requests (SGLang --max-queued-requests)")
    parser.add_argument("--echo-headers", action="store_true",
                        help="tests of a proxy: answer every request with the headers it arrived with "
                             "(x-emulator-request-headers, JSON) and a few an engine or server may send")
    parser.add_argument("--tls-cert", help="serve HTTPS with this PEM certificate (an engine behind a TLS front)")
    parser.add_argument("--tls-key", help="the certificate's PEM private key")
    parser.add_argument("--tls-client-ca", help="require client certificates this CA bundle signed (mTLS)")


class Stream:
    """What one request's handler waits on: tokens so far, and how it ended. The samples of
    one request (`n`) share `event`, so their handler wakes when any of them moves."""

    __slots__ = ("rid", "prompt_len", "tokens", "finished", "_event")

    def __init__(self, rid: str, prompt_len: int, event: asyncio.Event | None = None):
        self.rid = rid
        self.prompt_len = prompt_len
        self.tokens: list[int] = []
        self.finished: Finished | None = None
        self._event = event if event is not None else asyncio.Event()

    def notify(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


async def until_finished(streams: list[Stream]) -> None:
    """Wait for every sample of one request (they share one event)."""
    while any(s.finished is None for s in streams):
        await streams[0].wait()


MAX_LAG_S = 0.5  # wall seconds the driver may run behind its engine timeline before resyncing


class Driver:
    """Runs the engine in real time: engine seconds = wall seconds × speed."""

    def __init__(self, engine: Engine, speed: float):
        self.engine = engine
        self.speed = speed
        self.streams: dict[str, Stream] = {}
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (now, tokens)

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    def submit(self, g: GenRequest, max_new: int) -> list[Stream]:
        """One engine request, and stream, per sample (`g.n`). SGLang first sends a
        prefill-only request to cache the shared prompt; none is needed here: the samples
        arrive in the same step, and the engine computes a prompt shared by requests
        scheduled in one step once (`Engine._shareable`), as vLLM's prefix caching does."""
        ids = sample_ids(g.rid, g.n)
        taken = next((rid for rid in ids if rid in self.streams), None)
        if taken is not None:
            raise ApiError(400, f"Duplicate request id {taken!r}.", "rid")
        now = self.now()
        event = asyncio.Event()
        streams = []
        for i, rid in enumerate(ids):
            self.engine.submit(EngineRequest(rid, g.prompt_ids, max_new, g.ignore_eos,
                                             g.priority, now, sample_key=g.sample_key_of(i),
                                             min_new_tokens=g.min_new_tokens, adapter=g.adapter), now)
            stream = self.streams[rid] = Stream(rid, len(g.prompt_ids), event)
            streams.append(stream)
        self._wake.set()
        return streams

    def abort(self, rid: str) -> bool:
        stream = self.streams.pop(rid, None)
        if stream is None:
            return False
        self.engine.abort(rid, self.now())
        if stream.finished is None:
            stream.finished = Finished(rid, "abort", stream.prompt_len, 0, len(stream.tokens))
            stream.notify()
        return True

    def abort_unfinished(self, streams: list[Stream]) -> None:
        """Free the KV of every sample still running (its client went away)."""
        for stream in streams:
            if stream.finished is None:
                self.abort(stream.rid)

    def gen_throughput(self) -> float:
        """Output tokens per engine second over the last 5 engine seconds."""
        now = self.now()
        while self._recent and self._recent[0][0] < now - 5.0:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / 5.0

    async def run(self) -> None:
        last_end = None  # engine time the previous step ended, while steps run back to back
        while True:
            now = self.now()
            t = self.engine.next_event_time(now)
            if t is None:
                last_end = None
                self._wake.clear()
                await self._wake.wait()
                continue
            if t > now:
                await asyncio.sleep((t - now) / self.speed)
                continue
            # A step follows the previous one at its engine-time end, not when the event loop
            # got round to it: under CPU contention that wake-up takes milliseconds, which
            # would stretch every step (10 % at --speed 2 on a busy 2-core machine) and make
            # the emulator slower than its profile. Far behind (an overloaded host): resync.
            if last_end is not None and now - last_end < MAX_LAG_S * self.speed:
                now = last_end
            result = self.engine.step(now)
            last_end = result.end
            # sleep to the step's absolute end, so timer slack does not accumulate
            delay = self._t0 + result.end / self.speed - time.monotonic()
            # always yield, even when catching up: the handlers must stream what was delivered
            await asyncio.sleep(max(0.0, delay))
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        self._recent.append((result.end, len(result.tokens)))
        for rid, token in result.tokens.items():
            stream = self.streams.get(rid)
            if stream is not None:
                stream.tokens.append(token)
                stream.notify()
        for fin in result.finished:
            stream = self.streams.pop(fin.id, None)
            if stream is not None:
                stream.finished = fin
                stream.notify()


class Emulator:
    def __init__(self, profile: Profile, model: str, speed: float, seed: int,
                 max_queued: int | None, adapters: tuple[str, ...] = ()):
        self.profile = profile
        self.model = model
        # LoRA adapters served beside the model, name -> path (`profile.max_loras` a batch)
        self.adapters: dict[str, str] = {name: f"/adapters/{name}" for name in adapters}
        self.seed = seed
        self.max_queued = max_queued
        self.engine = Engine(profile, seed)
        self.driver = Driver(self.engine, speed)
        self.abort_calls = 0  # POST /abort_request received (a disconnect aborts without one)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_MetricsCollector(self))
        self.api = ApiFaces(self)
        self.echo_headers = False
        self.stored: collections.OrderedDict[str, dict] = collections.OrderedDict()

    # ---- generation ------------------------------------------------------------------------

    def _admit(self, g: GenRequest) -> list[Stream]:
        if g.model is not None and g.model != self.model and g.model not in self.adapters:
            raise ApiError(404, f"The model `{g.model}` does not exist.", "model")
        if g.lora_path is not None and g.lora_path not in self.adapters:
            raise ApiError(400, f"The LoRA adapter `{g.lora_path}` is not loaded.", "lora_path")
        g.adapter = g.lora_path or (g.model if g.model in self.adapters else None)
        limit = self.engine.max_request_tokens()
        max_new = g.max_new_tokens if g.max_new_tokens is not None else limit - len(g.prompt_ids)
        if len(g.prompt_ids) + max(max_new, 1) > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, "
                                f"you requested {len(g.prompt_ids) + max_new} tokens "
                                f"({len(g.prompt_ids)} in the messages, {max_new} in the "
                                "completion).", "max_tokens")
        if self.max_queued is not None and self.engine.load().num_waiting >= self.max_queued:
            raise ApiError(503, "The request queue is full.")
        return self.driver.submit(g, max_new)

    async def _generate(self, request: web.Request, parse, shape: "_Shape") -> web.StreamResponse:
        g = parse(parse_json(await request.read()))
        streams = self._admit(g)
        try:
            if g.stream:
                return await self._stream(request, g, streams, shape)
            await until_finished(streams)
            return web.Response(body=shape.whole(g, streams), content_type="application/json")
        finally:
            self.driver.abort_unfinished(streams)  # the client went away: free its KV

    async def _stream(self, request: web.Request, g: GenRequest, streams: list[Stream],
                      shape: "_Shape") -> web.StreamResponse:
        """Each sample's tokens as they come (the samples of a step interleave), each
        sample's end as it ends; usage and [DONE] once all have ended."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        samples = [_Sample(stream, i) for i, stream in enumerate(streams)]
        try:
            await resp.prepare(request)
            while True:
                await streams[0].wait()  # the samples share one event
                parts = [part for sample in samples for part in sample.news(g, shape)]
                done = all(sample.ended for sample in samples)
                if done:
                    parts.extend(shape.tail(g, streams))
                    parts.append(b"data: [DONE]\n\n")
                if parts:
                    await resp.write(b"".join(parts))
                if done:
                    await resp.write_eof()
                    return resp
        except ConnectionError:  # the client went away; the caller aborts the request
            return resp

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, _ChatShape(self))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, _CompletionShape(self))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_generate, _GenerateShape(self))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_responses, _ResponsesShape(self))

    def store_response(self, doc: dict) -> dict:
        self.stored[doc["id"]] = doc
        while len(self.stored) > STORED_RESPONSES:
            self.stored.popitem(last=False)
        return doc

    async def stored_response(self, request: web.Request) -> web.Response:
        doc = self.stored.get(request.match_info["id"])
        if doc is None:
            raise ApiError(404, f"Response {request.match_info['id']!r} not found.", "response_id")
        if request.method == "POST":  # cancel: only background responses can be
            raise ApiError(400, "Cannot cancel a synchronous response.", "response_id")
        return _json(doc)

    async def prefill(self, batch: list[list[int]]) -> None:
        """Run each prompt through the engine (prefill and one step): what an embedding,
        score or transcription costs. Aborted if the caller goes away."""
        limit = self.engine.max_request_tokens()
        if any(len(ids) + 1 > limit for ids in batch):
            raise ApiError(400, f"This model's maximum context length is {limit} tokens.", "input")
        if any(not ids for ids in batch):
            raise ApiError(400, "An input is empty.", "input")
        if self.max_queued is not None and self.engine.load().num_waiting >= self.max_queued:
            raise ApiError(503, "The request queue is full.")
        streams = [stream for ids in batch for stream in self.driver.submit(
            GenRequest(f"pool-{uuid.uuid4().hex}", ids, 1, True, 0, False, False, None), 1)]
        try:
            for stream in streams:  # each has its own event: wait for them one by one
                await until_finished([stream])
        finally:
            self.driver.abort_unfinished(streams)

    # ---- SGLang / vLLM control and load ----------------------------------------------------

    def model_card(self, name: str) -> dict:
        """`name`'s card: a LoRA adapter's names its base model as `parent`, and its path as
        `root` (vLLM's `/v1/models`; SGLang's lists its adapters the same way)."""
        adapter = name in self.adapters
        return {"id": name, "object": "model", "created": _START, "owned_by": "sglang",
                "root": self.adapters[name] if adapter else name, "parent": self.model if adapter else None,
                "max_model_len": self.engine.max_request_tokens()}

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self.model_card(name) for name in (self.model, *self.adapters)]})

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's `/v1/load_lora_adapter` (with VLLM_ALLOW_RUNTIME_LORA_UPDATING) and SGLang's
        `/load_lora_adapter`: `{lora_name, lora_path}`; an adapter loaded at run time."""
        body = parse_json(await request.read())
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "'lora_name' and 'lora_path' must be non-empty strings.", "lora_name")
        if self.profile.max_loras is None:
            raise ApiError(400, "LoRA is not enabled (start with --lora-adapters).", "lora_name")
        if name == self.model or name in self.adapters:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's `/v1/unload_lora_adapter` and SGLang's `/unload_lora_adapter`: `{lora_name}`."""
        body = parse_json(await request.read())
        name = body.get("lora_name")
        if name not in self.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def _load_entry(self) -> dict:
        load = self.engine.load()
        return {
            "dp_rank": 0, "num_running_reqs": load.num_running,
            "num_waiting_reqs": load.num_waiting, "num_used_tokens": load.kv_used_tokens,
            "num_total_tokens": load.kv_used_tokens + load.waiting_prompt_tokens,
            "max_total_num_tokens": load.kv_total_tokens, "token_usage": load.token_usage,
            "gen_throughput": self.driver.gen_throughput(), "cache_hit_rate": load.cache_hit_rate,
            "utilization": load.token_usage, "max_running_requests": load.max_running,
            # SGLang's LoadSnapshot queues; retracted: those of its last stats window (bench.engine)
            "queues": {"waiting": load.num_waiting, "grammar": 0, "paused": 0,
                       "retracted": load.counters.retracted_last_window},
        }

    async def loads(self, request: web.Request) -> web.Response:
        entry = self._load_entry()
        return _json({"timestamp": datetime.now(timezone.utc).isoformat(), "version": VERSION,
                      "dp_rank_count": 1, "loads": [entry], "aggregate": {
                          k: entry[k] for k in ("num_running_reqs", "num_waiting_reqs",
                                                "num_used_tokens", "gen_throughput")}})

    async def get_load(self, request: web.Request) -> web.Response:
        # SGLang: num_reqs counts running + waiting; num_tokens adds the waiting prompts
        load = self.engine.load()
        return _json([{"dp_rank": 0, "num_reqs": load.num_running + load.num_waiting,
                       "num_waiting_reqs": load.num_waiting,
                       "num_tokens": load.kv_used_tokens + load.waiting_prompt_tokens,
                       "num_pending_tokens": load.waiting_prompt_tokens}])

    async def server_info(self, request: web.Request) -> web.Response:
        p = self.profile
        return _json({
            # model_path null: SGLang Router would otherwise try to download a tokenizer
            "model_path": None, "tokenizer_path": None, "served_model_name": self.model,
            "host": request.host, "dp_size": 1, "tp_size": 1, "page_size": p.block_size,
            "max_total_num_tokens": p.kv_tokens, "max_running_requests": p.max_running,
            "chunked_prefill_size": p.prefill_budget, "context_length": p.max_model_len,
            "schedule_policy": p.waiting_order,
            "enable_lora": p.max_loras is not None, "max_loras_per_batch": p.max_loras or 8,
            "lora_paths": dict(self.adapters) or None,
            "enable_metrics": True, "enable_cache_report": True, "version": VERSION,
            "internal_states": [{"last_gen_throughput": self.driver.gen_throughput()}],
            "emulator": {"profile": p.name, "speed": self.driver.speed, "seed": self.seed},
        })

    async def model_info(self, request: web.Request) -> web.Response:
        return _json({"model_path": None, "tokenizer_path": None, "is_generation": True,
                      "served_model_name": self.model, "weight_version": "default",
                      "has_image_understanding": False, "has_audio_understanding": False,
                      "model_type": "llama", "architectures": ["LlamaForCausalLM"]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        g = GenRequest(f"health-{time.monotonic_ns()}", [1], 1, True, 0, False, False, None)
        streams = self.driver.submit(g, 1)
        try:
            await until_finished(streams)
        finally:
            self.driver.abort_unfinished(streams)
        return web.Response(status=200)

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(text="pong")

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VERSION})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self.engine.flush_cache():
            return web.Response(status=400, text="Cache not flushed. Please check for pending "
                                                 "requests before flushing the cache.")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation "
                                 "will not be performed.)\n")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = parse_json(await request.read())
        self.abort_calls += 1
        if body.get("abort_all") is True:
            for rid in list(self.driver.streams):
                self.driver.abort(rid)
        elif isinstance(body.get("rid"), str):
            self.driver.abort(body["rid"])
        else:
            raise ApiError(400, "Give 'rid' (a string) or 'abort_all': true.", "rid")
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
        app.on_response_prepare.append(self._note_traceparent)
        if self.echo_headers:
            app.on_response_prepare.append(_echo_headers)
        r = app.router
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/generate", self.generate)
        r.add_get("/v1/models", self.models)
        for path in ("/v1/load_lora_adapter", "/load_lora_adapter"):
            r.add_post(path, self.load_lora)
        for path in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
            r.add_post(path, self.unload_lora)
        r.add_post("/v1/responses", self.responses)
        r.add_get("/v1/responses/{id}", self.stored_response)
        r.add_post("/v1/responses/{id}/cancel", self.stored_response)
        api = self.api
        r.add_get("/v1/models/{model:.+}", api.model)
        r.add_post("/v1/embeddings", api.embeddings)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r.add_post(path, api.rerank)
        for path in ("/score", "/v1/score"):
            r.add_post(path, api.score)
        for path in ("/tokenize", "/v1/tokenize"):
            r.add_post(path, api.tokenize)
        for path in ("/detokenize", "/v1/detokenize"):
            r.add_post(path, api.detokenize)
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            r.add_post(path, api.audio)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/get_load", self.get_load)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/ping", self.ping)
        r.add_get("/version", self.version)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/reset_prefix_cache", self.flush_cache)  # vLLM's, with VLLM_SERVER_DEV_MODE=1
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/metrics", self.metrics)
        r.add_get("/debug/traceparent", self.last_traceparent)
        app.on_startup.append(self._start_driver)
        app.on_cleanup.append(self._stop_driver)
        return app

    async def _note_traceparent(self, request: web.Request, response: web.StreamResponse) -> None:
        """Tests of tracing: the `traceparent` the last request carrying one arrived with."""
        if "traceparent" in request.headers:
            self.traceparent = request.headers["traceparent"]

    async def last_traceparent(self, request: web.Request) -> web.Response:
        return _json({"traceparent": getattr(self, "traceparent", None)})

    async def _start_driver(self, app: web.Application) -> None:
        self._driver_task = asyncio.create_task(self.driver.run())

    async def _stop_driver(self, app: web.Application) -> None:
        self._driver_task.cancel()


_START = int(time.time())


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def _echo_headers(request: web.Request, response: web.StreamResponse) -> None:
    """--echo-headers: what a proxy passed on, and headers it should (not) pass back."""
    response.headers["x-emulator-request-headers"] = orjson.dumps({str(k): v for k, v in request.headers.items()}).decode()
    response.headers["openai-processing-ms"] = "7"
    response.headers["x-ratelimit-remaining-requests"] = "99"
    response.headers["X-LB-Replica"] = "forged-by-upstream"
    response.headers["Set-Cookie"] = "session=upstream"


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return web.Response(body=e.body(), status=e.status, content_type="application/json")
    except web.HTTPException as e:  # unknown route, wrong method, body too large
        if e.status < 400:
            raise
        err = ApiError(e.status, e.reason, type_=type(e).__name__)
        return web.Response(body=err.body(), status=e.status, content_type="application/json")


# ---- response shapes ---------------------------------------------------------------------


class _Shape:
    """How a face writes a request's answers: `streams` holds its samples (one unless `n`)."""

    def __init__(self, emu: Emulator):
        self.model = emu.model
        self.created = int(time.time())

    def usage(self, streams: list[Stream]) -> dict:
        # the samples share the prompt: counted once, with sample 0's cache hit (sample 0
        # is what n=1 would have been); every sample's output counts
        fin = streams[0].finished
        prompt, completion = fin.prompt_tokens, sum(len(s.tokens) for s in streams)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": fin.cached_tokens}}

    def chunk(self, g: GenRequest, stream: Stream, new: list[int], first: bool, index: int) -> bytes:
        raise NotImplementedError

    def finish(self, g: GenRequest, stream: Stream, index: int) -> list[bytes]:
        """What ends one sample's stream."""
        raise NotImplementedError

    def tail(self, g: GenRequest, streams: list[Stream]) -> list[bytes]:
        """What follows once every sample has ended (before [DONE])."""
        return []

    def whole(self, g: GenRequest, streams: list[Stream]) -> bytes:
        raise NotImplementedError


class _Sample:
    """How far one sample's stream has been written."""

    __slots__ = ("stream", "index", "sent", "ended")

    def __init__(self, stream: Stream, index: int):
        self.stream, self.index, self.sent, self.ended = stream, index, 0, False

    def news(self, g: GenRequest, shape: _Shape) -> list[bytes]:
        """Its tokens since the last write, then its end once it has ended."""
        if self.ended:
            return []
        stream = self.stream
        new, first = stream.tokens[self.sent:], self.sent == 0
        self.sent = len(stream.tokens)
        parts = [shape.chunk(g, stream, new, first, self.index)] if new else []
        if stream.finished is not None:
            parts.extend(shape.finish(g, stream, self.index))
            self.ended = True
        return parts


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _OpenAIShape(_Shape):
    """Chat and text completions: one choice per chunk, a usage chunk at the end on request."""

    EMPTY: object  # a chunk's content that says nothing

    def _chunk(self, g: GenRequest, content, finish: str | None, index: int = 0) -> dict:
        raise NotImplementedError

    def finish(self, g, stream, index):
        return [_sse(self._chunk(g, self.EMPTY, stream.finished.reason, index))]

    def tail(self, g, streams):
        if not g.include_usage:
            return []
        usage = self._chunk(g, self.EMPTY, None)
        usage["choices"], usage["usage"] = [], self.usage(streams)
        return [_sse(usage)]


class _ChatShape(_OpenAIShape):
    EMPTY = {}

    def _chunk(self, g, delta, finish, index=0):
        out = {"id": f"chatcmpl-{g.rid}", "object": "chat.completion.chunk",
               "created": self.created, "model": self.model,
               "choices": [{"index": index, "delta": delta, "logprobs": None,
                            "finish_reason": finish}]}
        if g.include_usage:
            out["usage"] = None
        return out

    def chunk(self, g, stream, new, first, index):
        delta = {"role": "assistant", "content": decode(new)} if first else {"content": decode(new)}
        return _sse(self._chunk(g, delta, None, index))

    def whole(self, g, streams):
        return orjson.dumps({
            "id": f"chatcmpl-{g.rid}", "object": "chat.completion", "created": self.created,
            "model": self.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": decode(s.tokens)},
                         "logprobs": None, "finish_reason": s.finished.reason}
                        for i, s in enumerate(streams)],
            "usage": self.usage(streams)})


class _CompletionShape(_OpenAIShape):
    EMPTY = ""

    @staticmethod
    def _choice(text: str, finish: str | None, index: int) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def _chunk(self, g, text, finish, index=0):
        out = {"id": f"cmpl-{g.rid}", "object": "text_completion", "created": self.created,
               "model": self.model, "choices": [self._choice(text, finish, index)]}
        if g.include_usage:
            out["usage"] = None
        return out

    def chunk(self, g, stream, new, first, index):
        return _sse(self._chunk(g, decode(new), None, index))

    def whole(self, g, streams):
        out = self._chunk(g, "", None)
        out["choices"] = [self._choice(decode(s.tokens), s.finished.reason, i)
                          for i, s in enumerate(streams)]
        out["usage"] = self.usage(streams)
        return orjson.dumps(out)


class _GenerateShape(_Shape):
    """SGLang /generate: cumulative text per chunk, meta_info with the finish reason. With
    `n` > 1 SGLang answers a list of n bodies, or streams each sample's bodies marked with
    its `index` (tokenizer_manager.py `_handle_batch_request`)."""

    def _body(self, g: GenRequest, stream: Stream) -> dict:
        fin = stream.finished
        if fin is None:
            reason = None
        elif fin.reason == "stop":
            reason = {"type": "stop", "matched": EOS_TOKEN_ID}
        elif fin.reason == "length":
            reason = {"type": "length", "length": len(stream.tokens)}
        else:
            reason = {"type": "abort", "message": "Abort request."}
        return {"text": decode(stream.tokens), "output_ids": stream.tokens,
                "meta_info": {"id": stream.rid, "finish_reason": reason,
                              "prompt_tokens": len(g.prompt_ids),
                              "completion_tokens": len(stream.tokens),
                              "cached_tokens": fin.cached_tokens if fin else 0}}

    def _streamed(self, g: GenRequest, stream: Stream, index: int) -> bytes:
        body = self._body(g, stream)
        if g.n > 1:
            body["index"] = index
        return _sse(body)

    def chunk(self, g, stream, new, first, index):
        return self._streamed(g, stream, index) if stream.finished is None else b""

    def finish(self, g, stream, index):
        return [self._streamed(g, stream, index)]

    def whole(self, g, streams):
        if g.n == 1:
            return orjson.dumps(self._body(g, streams[0]))
        return orjson.dumps([self._body(g, s) for s in streams])


class _ResponsesShape(_Shape):
    """OpenAI Responses: one `response` object; streamed as typed events. Finished ones are
    kept (the last STORED_RESPONSES) for GET /v1/responses/{id}. The API has no `n`: one
    stream."""

    def __init__(self, emu: "Emulator"):
        super().__init__(emu)
        self.emu = emu

    def _response(self, g: GenRequest, stream: Stream, status: str) -> dict:
        text = decode(stream.tokens)
        out = {"id": f"resp_{g.rid}", "object": "response", "created_at": self.created, "model": self.model,
               "status": status, "output": [{"type": "message", "id": f"msg_{g.rid}", "role": "assistant",
                                             "status": status, "content": [{"type": "output_text", "text": text,
                                                                            "annotations": []}]}]}
        if stream.finished is not None:
            u = self.usage([stream])
            out["usage"] = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                            "total_tokens": u["total_tokens"],
                            "input_tokens_details": {"cached_tokens": stream.finished.cached_tokens}}
        return out

    @staticmethod
    def _event(kind: str, doc: dict) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **doc}) + b"\n\n"

    def chunk(self, g, stream, new, first, index):
        delta = self._event("response.output_text.delta", {"item_id": f"msg_{g.rid}", "output_index": 0,
                                                           "content_index": 0, "delta": decode(new)})
        if first:
            return self._event("response.created", {"response": self._response(g, stream, "in_progress")}) + delta
        return delta

    def finish(self, g, stream, index):
        done = self.emu.store_response(self._response(g, stream, "completed"))
        return [self._event("response.completed", {"response": done})]

    def whole(self, g, streams):
        return orjson.dumps(self.emu.store_response(self._response(g, streams[0], "completed")))


VLLM_BLOCK_SIZE = 16  # vLLM's default KV block size on GPUs


class _MetricsCollector:
    """Both engines' /metrics families from one engine snapshot, per scrape."""

    def __init__(self, emu: Emulator):
        self.emu = emu

    def collect(self):
        emu = self.emu
        emu.engine.first_tokens_by(emu.driver.now())  # a step's first tokens count once it has ended
        load = emu.engine.load()
        c = load.counters
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float, extra: dict | None = None):
            names = labels + list(extra or {})
            fam = GaugeMetricFamily(name, doc, labels=names)
            fam.add_metric([emu.model, *(extra or {}).values()], value)
            return fam

        def counter(name: str, doc: str, value: float, extra: dict | None = None):
            names = labels + list(extra or {})
            fam = CounterMetricFamily(name, doc, labels=names)
            fam.add_metric([emu.model, *(extra or {}).values()], value)
            return fam

        yield gauge("sglang:num_running_reqs", "Running requests", load.num_running)
        yield gauge("sglang:num_queue_reqs", "Waiting requests", load.num_waiting)
        yield gauge("sglang:num_used_tokens", "KV tokens in use", load.kv_used_tokens)
        yield gauge("sglang:max_total_num_tokens", "KV capacity", load.kv_total_tokens)
        yield gauge("sglang:token_usage", "KV usage 0..1", load.token_usage)
        yield gauge("sglang:cache_hit_rate", "Prefix cache hit rate", load.cache_hit_rate)
        yield gauge("sglang:gen_throughput", "Output tokens/s", emu.driver.gen_throughput())
        yield gauge("sglang:utilization", "Utilization 0..1", load.token_usage)
        yield counter("sglang:prompt_tokens", "Prompt tokens", c.prompt_tokens)
        yield counter("sglang:generation_tokens", "Generated tokens", c.generation_tokens)
        yield counter("sglang:cached_tokens", "Prompt tokens served from cache", c.cached_tokens)
        yield counter("sglang:num_requests", "Finished requests", c.requests)
        yield counter("sglang:num_aborted_requests", "Aborted requests", c.aborted)
        yield counter("sglang:num_retracted_requests", "Total number of retracted requests.", c.preemptions)
        yield self._ttft_histogram("sglang:time_to_first_token_seconds", c, {})
        # not an SGLang metric: lets tests tell an explicit abort from a disconnect
        yield counter("emulator:abort_request_calls", "POST /abort_request received", emu.abort_calls)
        engine = {"engine": "0"}
        yield gauge("vllm:num_requests_running", "Running requests", load.num_running, engine)
        yield gauge("vllm:num_requests_waiting", "Waiting requests", load.num_waiting, engine)
        # as vLLM 0.32 publishes it (seen live): every wait here is for scheduling capacity
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason.",
                                      labels=labels + ["engine", "reason"])
        by_reason.add_metric([emu.model, "0", "capacity"], load.num_waiting)
        by_reason.add_metric([emu.model, "0", "deferred"], 0)
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "KV usage 0..1", load.token_usage, engine)
        # vLLM's info gauge (always 1): its labels carry the KV capacity, as
        # vllm/v1/metrics/loggers.py `log_metrics_info("cache_config", ...)` publishes it
        yield gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0,
                    {**engine, "block_size": str(VLLM_BLOCK_SIZE),
                     "num_gpu_blocks": str(load.kv_total_tokens // VLLM_BLOCK_SIZE),
                     "kv_cache_size_tokens": str(load.kv_total_tokens // VLLM_BLOCK_SIZE * VLLM_BLOCK_SIZE),
                     "enable_prefix_caching": "True", "cache_dtype": "auto"})
        yield counter("vllm:prompt_tokens", "Prompt tokens", c.prompt_tokens, engine)
        yield counter("vllm:generation_tokens", "Generated tokens", c.generation_tokens, engine)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queried tokens",
                      c.prefix_queries, engine)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hit tokens", c.prefix_hits, engine)
        yield counter("vllm:num_preemptions", "Preemptions", c.preemptions, engine)
        yield self._ttft_histogram("vllm:time_to_first_token_seconds", c, engine)
        if load.max_loras is not None:
            # vLLM's LoRA info gauge: no model label, its value the time it was set (one series
            # here; vLLM leaves each earlier set of adapters behind as a stale series of its own)
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            lora.add_metric([str(load.max_loras), ",".join(load.waiting_adapters), ",".join(load.running_adapters)],
                            time.time())
            yield lora

    def _ttft_histogram(self, name: str, c, extra: dict) -> HistogramMetricFamily:
        """The engine's TTFTs as both engines publish them, in wall seconds (engine time over
        `--speed`), with vLLM's bucket bounds (an emulator's histogram need not match each
        engine's bounds: `lb` reads only its count)."""
        speed = self.emu.driver.speed
        fam = HistogramMetricFamily(name, "Histogram of time to first token in seconds.",
                                    labels=["model_name", *extra])
        cumulative = list(itertools.accumulate(c.ttft_buckets))
        buckets = [(repr(b / speed), n) for b, n in zip(TTFT_BUCKETS_S, cumulative)] + [("+Inf", c.ttfts)]
        fam.add_metric([self.emu.model, *extra.values()], buckets, c.ttft_total_s / speed)
        return fam


# ---- process -----------------------------------------------------------------------------


def lora_options(count: int, max_loras: int | None, *, sglang: bool) -> tuple[tuple[str, ...], int | None]:
    """(adapter names, adapters a batch runs) for `--lora-adapters` and `--max-loras`; the
    engines' defaults: vLLM `--max-loras` 1, SGLang `--max-loras-per-batch` 8."""
    if count < 0:
        raise SystemExit("--lora-adapters must be 0 or more")
    if max_loras is not None and max_loras < 1:
        raise SystemExit("--max-loras must be at least 1")
    if not count and max_loras is None:
        return (), None  # no LoRA: none served, none loadable at run time
    return tuple(f"lora-{k}" for k in range(count)), max_loras or (8 if sglang else 1)


async def serve(args: argparse.Namespace) -> None:
    profile = get_profile(args.profile)
    adapters, max_loras = lora_options(args.lora_adapters, args.max_loras, sglang=profile.new_token_ratio is not None)
    profile = profile.with_overrides(
        kv_tokens=args.kv_tokens, max_running=args.max_running,
        decode_reserve=args.decode_reserve, prefill_budget=args.prefill_budget,
        admit_within_budget=args.admit_within_budget or None, max_loras=max_loras)
    emu = Emulator(profile, args.model or profile.model, args.speed, args.seed, args.max_queued, adapters)
    emu.echo_headers = args.echo_headers
    # handler_cancellation: a client disconnect cancels its handler, which aborts the request
    runner = web.AppRunner(emu.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    ssl_ctx = None
    if args.tls_cert:
        from lb.daemon.tls import server_context
        ssl_ctx = server_context(args.tls_cert, args.tls_key or "", args.tls_client_ca or "", section="--tls")
    await web.TCPSite(runner, args.host, args.port, backlog=1024, ssl_context=ssl_ctx).start()
    print(f"emulator listening on {'https' if ssl_ctx else 'http'}://{args.host}:{args.port} profile={profile.name} "
          f"model={emu.model} speed={args.speed} kv_tokens={profile.kv_tokens}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    if args.speed <= 0:
        raise SystemExit("--speed must be positive")
    try:
        import uvloop
        uvloop.run(serve(args))
    except ImportError:
        asyncio.run(serve(args))
    return 0
