"""A replica that misbehaves on command, for `lb`'s fault-injection tests (never production).

`python -m bench.faulty_replica --port P [--mode ok] [--probe honest]` serves a tiny
OpenAI/SGLang face: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/get_load`,
`/health`. `POST /fault {"mode": ..., "probe": ..., "probe_delay_s": ...}` changes its
behaviour while it runs; `GET /fault` returns the behaviour, how many generation requests
it received, and the headers of the last one.

Request modes (what a generation request gets):
  ok         a valid SSE stream (or JSON), `tokens` chunks `token_delay_s` apart
  hang       the connection is accepted and the request read, then nothing is ever sent
  error500   HTTP 500 with an error body
  malformed  HTTP 200 `text/event-stream` whose body is not server-sent events
  die        `die_after` chunks of a stream, then the process exits at once (mid-stream)
  cookie     as `ok`, and every answer sets a cookie (a proxy must never send it back)
Broken HTTP and oversized answers (issue 13; `size_bytes` sets how big):
  bad_chunk     HTTP/1.1 200, chunked, whose first chunk size is not hex
  cr_header     HTTP/1.1 200 with a bare CR inside a header value
  endless_line  HTTP 200 `text/event-stream`: `data: ` then `size_bytes` without a newline
  huge_body     HTTP 200 JSON of `size_bytes`
  huge_error    HTTP 500 whose body is `size_bytes` (an error message, then padding)
  gzip          HTTP 200 with `Content-Encoding: gzip` (the client never asked for it)
  bad_status    HTTP/1.1 999
  mid_break     a valid stream's first `die_after` chunks, then a bad chunk size (after the first byte)
  hang_body     HTTP 200 JSON headers (a Content-Length), then never the body
Probe modes (what `/get_load` and `/health` do):
  honest     hanging requests are reported waiting, streaming ones running
  lie        always reports an idle replica (pending 0), whatever it holds
  slow       answers after `probe_delay_s`
  hang       never answers
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import time

import orjson
from aiohttp import web

MODES = ("ok", "hang", "error500", "malformed", "die", "cookie", "bad_chunk", "cr_header", "endless_line", "huge_body",
         "huge_error", "gzip", "bad_status", "mid_break", "hang_body")
HOSTILE = MODES[6:]  # the broken shapes (the chaos scenario rotates through them)
MIB = 1 << 20
PROBES = ("honest", "lie", "slow", "hang")


class Faulty:
    def __init__(self, args: argparse.Namespace):
        self.model = args.model
        self.behaviour = {"mode": args.mode, "probe": args.probe, "probe_delay_s": args.probe_delay_s,
                          "tokens": args.tokens, "token_delay_s": args.token_delay_s, "die_after": args.die_after,
                          "size_bytes": args.size_bytes}
        self.received = 0
        self.hanging = 0
        self.streaming = 0
        self.last_headers: dict[str, str] = {}

    # ---- control ---------------------------------------------------------------------------
    async def get_fault(self, request: web.Request) -> web.Response:
        return _json({**self.behaviour, "received": self.received, "hanging": self.hanging,
                      "streaming": self.streaming, "last_headers": self.last_headers})

    async def set_fault(self, request: web.Request) -> web.Response:
        doc = orjson.loads(await request.read())
        unknown = set(doc) - set(self.behaviour)
        if unknown or doc.get("mode", "ok") not in MODES or doc.get("probe", "honest") not in PROBES:
            return _json({"error": f"bad fault {doc}; modes {MODES}, probes {PROBES}"}, 400)
        self.behaviour.update(doc)
        return await self.get_fault(request)

    # ---- probes ----------------------------------------------------------------------------
    async def _probe_behaviour(self) -> None:
        probe = self.behaviour["probe"]
        if probe == "hang":
            await asyncio.Event().wait()
        if probe == "slow":
            await asyncio.sleep(self.behaviour["probe_delay_s"])

    async def health(self, request: web.Request) -> web.Response:
        await self._probe_behaviour()
        return web.Response(status=200)

    async def get_load(self, request: web.Request) -> web.Response:
        await self._probe_behaviour()
        waiting, running = (0, 0) if self.behaviour["probe"] == "lie" else (self.hanging, self.streaming)
        return _json([{"dp_rank": 0, "num_reqs": waiting + running, "num_waiting_reqs": waiting}])

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "faulty"}]})

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.received += 1
        self.last_headers = {str(k): v for k, v in request.headers.items()}  # keys are istr
        mode = self.behaviour["mode"]
        if mode == "hang_body":  # the headers, then nothing: stuck in the body
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 100
            await resp.prepare(request)
            mode = "hang"
        if mode == "hang":
            self.hanging += 1
            try:
                await asyncio.Event().wait()
            finally:
                self.hanging -= 1
        if mode == "error500":
            return _json({"error": {"message": "injected failure", "type": "server_error", "param": None,
                                    "code": "injected"}}, 500)
        if mode == "malformed":
            return web.Response(status=200, body=b"<html>this is not server-sent events</html>\n\n",
                                content_type="text/event-stream")
        chat = request.path.endswith("chat/completions")
        if mode in HOSTILE and mode != "mid_break":
            return await self._hostile(request, mode, chat, bool(body.get("stream")))
        if not body.get("stream"):
            text = "tok " * self.behaviour["tokens"]
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            resp = _json({"id": "faulty", "object": "chat.completion" if chat else "text_completion",
                          "model": self.model, "choices": [choice], "usage": _usage(self.behaviour["tokens"])})
            if mode == "cookie":
                resp.set_cookie("session", "s3cr3t")
            return resp
        return await self._stream(request, chat, bool((body.get("stream_options") or {}).get("include_usage")))

    async def _stream(self, request: web.Request, chat: bool, include_usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        self.streaming += 1
        try:
            n = self.behaviour["tokens"]
            for i in range(n):
                if self.behaviour["mode"] == "die" and i >= self.behaviour["die_after"]:
                    os._exit(1)  # a crash: no FIN on the chunked body, no [DONE]
                if self.behaviour["mode"] == "mid_break" and i >= self.behaviour["die_after"]:
                    request.transport.write(b"zz\r\n")  # not a chunk size, after the first byte
                    request.transport.close()
                    return resp
                delta = {"content": "tok "} if chat else None
                await resp.write(_sse(_chunk(self.model, chat, delta, "tok ", None)))
                await asyncio.sleep(self.behaviour["token_delay_s"])
            await resp.write(_sse(_chunk(self.model, chat, {}, "", "length")))
            if include_usage:
                await resp.write(_sse({"id": "faulty", "model": self.model, "choices": [], "usage": _usage(n)}))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            self.streaming -= 1
        return resp

    async def _hostile(self, request: web.Request, mode: str, chat: bool, stream: bool) -> web.StreamResponse:
        """One broken answer. Big ones are written a MiB at a time: the replica stays small."""
        size = self.behaviour["size_bytes"]
        raw = {"bad_chunk": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b"zz\r\ndata: {}\r\n",
               "cr_header": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Bad: a\rb\r\n"
                            b"Content-Length: 2\r\n\r\n{}",
               "bad_status": b"HTTP/1.1 999 Odd\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"}
        if mode in raw:  # below aiohttp's response writer: bytes no HTTP library would send
            request.transport.write(raw[mode])
            await asyncio.sleep(0.05)
            request.transport.close()
            return web.Response()
        if mode == "gzip" and stream:  # a whole event stream, compressed
            events = [_sse(_chunk(self.model, chat, {"content": "zipped"}, "zipped", None)),
                      _sse(_chunk(self.model, chat, {}, "", "stop")), b"data: [DONE]\n\n"]
            return web.Response(body=gzip.compress(b"".join(events)), content_type="text/event-stream",
                                headers={"Content-Encoding": "gzip"})
        if mode == "gzip":
            doc = {"id": "faulty", "object": "chat.completion" if chat else "text_completion", "model": self.model,
                   "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "zipped"}}],
                   "usage": _usage(1)}
            return web.Response(body=gzip.compress(orjson.dumps(doc)), content_type="application/json",
                                headers={"Content-Encoding": "gzip"})
        status, ctype, head = {"endless_line": (200, "text/event-stream", b"data: "),
                               "huge_body": (200, "application/json", b'{"id": "faulty", "pad": "'),
                               "huge_error": (500, "application/json", b'{"error": {"message": "huge failure ')}[mode]
        resp = web.StreamResponse(status=status, headers={"Content-Type": ctype})
        if mode != "endless_line":
            resp.content_length = size
        await resp.prepare(request)
        await resp.write(head)
        left, block = size - len(head), b"x" * MIB
        while left > 0:
            await resp.write(block[:left])
            left -= MIB
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * MIB)  # big prompts reach it (job bounds are lb's to enforce)
        r = app.router
        r.add_get("/fault", self.get_fault)
        r.add_post("/fault", self.set_fault)
        r.add_get("/health", self.health)
        r.add_get("/get_load", self.get_load)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/chat/completions", self.generate)
        r.add_post("/v1/completions", self.generate)
        return app


def _chunk(model: str, chat: bool, delta: dict | None, text: str, finish: str | None) -> dict:
    choice = {"index": 0, "finish_reason": finish, **({"delta": delta} if chat else {"text": text})}
    return {"id": "faulty", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def _usage(n: int) -> dict:
    return {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n,
            "prompt_tokens_details": {"cached_tokens": 0}}


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.faulty_replica", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="m")
    p.add_argument("--mode", default="ok", choices=MODES)
    p.add_argument("--probe", default="honest", choices=PROBES)
    p.add_argument("--probe-delay-s", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--token-delay-s", type=float, default=0.01)
    p.add_argument("--die-after", type=int, default=2)
    p.add_argument("--size-bytes", type=int, default=300 * MIB, help="how big huge_body/huge_error/endless_line are")
    args = p.parse_args(argv)
    # handler_cancellation: an LB that gives up on a hanging request frees it here too
    web.run_app(Faulty(args).app(), host="127.0.0.1", port=args.port, print=None, access_log=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
