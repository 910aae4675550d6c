"""An SGLang-faced server whose answers finish inside the engine before their stream ends: what
a busy LB sees when an engine's last tokens are still on their way back to it.

Each streamed chat answer sends its first token, then leaves the engine's count at once (its
`/get_load` no longer shows it: the engine is done with it), and only `TAIL_S` later sends the
rest and `[DONE]`. Nothing else: `/v1/models`, `/health`, `/get_load` (SGLang's shape, no KV
room), `POST /v1/chat/completions` (streamed only).

    python -m tests.daemon.tail_standin PORT TAIL_S
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

from aiohttp import web

from tests.daemon.engine_standin import standin_app


def app(tail_s: float) -> web.Application:
    state = {"running": 0}

    async def get_load(request: web.Request) -> web.Response:
        return web.json_response([{"num_reqs": state["running"], "num_waiting_reqs": 0, "num_tokens": 0}])

    def chunk(content: str | None, finish: str | None = None, usage: dict | None = None) -> bytes:
        doc = {"id": "c1", "object": "chat.completion.chunk", "created": int(time.time()), "model": "m",
               "choices": [] if usage else [{"index": 0, "delta": {} if content is None else {"content": content},
                                             "finish_reason": finish}]}
        if usage:
            doc["usage"] = usage
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        state["running"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await resp.write(chunk("first"))
        finally:
            state["running"] -= 1  # the engine is done with it; its tail is still to come
        await asyncio.sleep(tail_s)
        await resp.write(chunk(" last", "stop"))
        await resp.write(chunk(None, usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return standin_app(chat, {"/get_load": get_load})


if __name__ == "__main__":
    web.run_app(app(float(sys.argv[2])), host="127.0.0.1", port=int(sys.argv[1]), print=None)
