"""An OpenAI-compatible server whose `/metrics` is a file: absent, it answers like a plain OpenAI
server (404 on every load endpoint); present, it serves the file, e.g. a page captured from a
real vLLM. What `lb`'s engine detection reads, and nothing else, on the real protocol.

    python -m tests.daemon.engine_standin PORT METRICS_FILE
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from aiohttp import web


def app(metrics: Path) -> web.Application:
    async def page(request: web.Request) -> web.Response:
        if not metrics.exists():
            raise web.HTTPNotFound()
        return web.Response(body=metrics.read_bytes(), content_type="text/plain")

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"id": "c1", "object": "chat.completion", "created": int(time.time()), "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    return standin_app(chat, {"/metrics": page})


def standin_app(chat, pages: dict) -> web.Application:
    """What every stand-in serves: one model (`m`) on /v1/models, /health, its `pages`
    (path → GET handler: the load endpoints it plays) and its chat completions."""
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "standin"}]})

    a = web.Application()
    a.router.add_get("/v1/models", models)
    a.router.add_get("/health", lambda r: web.Response(text="ok"))
    for path, handler in pages.items():
        a.router.add_get(path, handler)
    a.router.add_post("/v1/chat/completions", chat)
    return a


if __name__ == "__main__":
    web.run_app(app(Path(sys.argv[2])), host="127.0.0.1", port=int(sys.argv[1]), print=None)
