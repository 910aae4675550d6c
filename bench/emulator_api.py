"""The emulator's non-chat faces: embeddings, rerank and score (vLLM's shapes), tokenize and
detokenize, a model's card, and audio transcription/translation (multipart).

Everything that would cost a real engine GPU time (embeddings, rerank, score, audio) runs a
prefill through the engine model (`Emulator.prefill`), so it queues and takes KV like any
request. Vectors are deterministic functions of the bench tokenizer's token ids, so a test
can compute what it should get back.
"""
from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
import uuid

import mmh3
import orjson
from aiohttp import web

from bench.emulator_requests import ApiError, parse_json
from bench.tokenizer import decode, encode, filler_text, pieces, render_chat

DIM = 32  # embedding width unless the request asks for `dimensions`
MAX_PIECES = 1 << 16  # detokenize remembers this many prompt pieces it has tokenized


def embedding(ids: list[int], dim: int = DIM) -> list[float]:
    """Unit vector: the normalized sum of one pseudo-random vector per token id."""
    v = [0.0] * dim
    for t in ids:
        for j in range(dim):
            v[j] += mmh3.hash(f"{t}:{j}", signed=True) / 2**31
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def _inputs(value: object, key: str) -> list[list[int]]:
    """OpenAI's `input`: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [encode(value)]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(x, (str, list)) for x in value):
        return [ids for x in value for ids in _inputs(x, key)]
    raise ApiError(400, f"'{key}' must be a string, strings, token ids or lists of token ids.", key)


class ApiFaces:
    def __init__(self, emu):
        self.emu = emu
        self._pieces: dict[int, str] = {}

    def _model(self, body: dict) -> str:
        model = body.get("model")
        if model is not None and model != self.emu.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        return self.emu.model

    def _usage(self, n: int) -> dict:
        return {"prompt_tokens": n, "total_tokens": n}

    # -- pooling -----------------------------------------------------------------------------
    async def embeddings(self, request: web.Request) -> web.Response:
        body = parse_json(await request.read())
        model = self._model(body)
        batch = _inputs(body.get("input"), "input")
        dim = body.get("dimensions") or DIM
        if not isinstance(dim, int) or isinstance(dim, bool) or not 1 <= dim <= 4096:
            raise ApiError(400, "'dimensions' must be an integer in 1..4096.", "dimensions")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise ApiError(400, "'encoding_format' must be float or base64.", "encoding_format")
        await self.emu.prefill(batch)
        data = []
        for i, ids in enumerate(batch):
            vec = embedding(ids, dim)
            out = base64.b64encode(struct.pack(f"<{dim}f", *vec)).decode() if fmt == "base64" else vec
            data.append({"object": "embedding", "index": i, "embedding": out})
        return _json({"object": "list", "data": data, "model": model,
                      "usage": self._usage(sum(len(ids) for ids in batch))})

    async def rerank(self, request: web.Request) -> web.Response:
        body = parse_json(await request.read())
        model = self._model(body)
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
            raise ApiError(400, "'query' must be a string and 'documents' a list of strings.", "documents")
        q = encode(query)
        batch = [q + encode(d) for d in docs]
        await self.emu.prefill(batch)
        qv = embedding(q)
        results = [{"index": i, "document": {"text": d}, "relevance_score": _cos(qv, embedding(encode(d)))}
                   for i, d in enumerate(docs)]
        results.sort(key=lambda r: -r["relevance_score"])
        top_n = body.get("top_n")
        if isinstance(top_n, int) and top_n > 0:
            results = results[:top_n]
        return _json({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                      "usage": {"total_tokens": sum(map(len, batch))}})

    async def score(self, request: web.Request) -> web.Response:
        body = parse_json(await request.read())
        model = self._model(body)
        t1, t2 = body.get("text_1"), body.get("text_2")
        firsts = [t1] if isinstance(t1, str) else t1
        seconds = [t2] if isinstance(t2, str) else t2
        if not (isinstance(firsts, list) and isinstance(seconds, list) and firsts and seconds
                and all(isinstance(t, str) for t in firsts + seconds)):
            raise ApiError(400, "'text_1' and 'text_2' must be strings or lists of strings.", "text_1")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ApiError(400, "'text_1' and 'text_2' must pair up (one to many, or as many each).", "text_2")
        pairs = [(encode(a), encode(b)) for a, b in zip(firsts, seconds)]
        await self.emu.prefill([a + b for a, b in pairs])
        data = [{"index": i, "object": "score", "score": _cos(embedding(a), embedding(b))}
                for i, (a, b) in enumerate(pairs)]
        return _json({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                      "model": model, "data": data, "usage": self._usage(sum(len(a) + len(b) for a, b in pairs))})

    # -- tokenizer ---------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        body = parse_json(await request.read())
        self._model(body)
        if isinstance(body.get("messages"), list):
            text = render_chat(body["messages"])
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise ApiError(400, "Give 'prompt' (a string) or 'messages'.", "prompt")
        ps = pieces(text)
        ids = encode(text)
        for t, p in zip(ids, ps):
            if len(self._pieces) < MAX_PIECES:
                self._pieces[t] = p
        return _json({"tokens": ids, "count": len(ids), "max_model_len": self.emu.engine.max_request_tokens()})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = parse_json(await request.read())
        self._model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ApiError(400, "'tokens' must be a list of token ids.", "tokens")
        text = "".join(self._pieces.get(t) or decode([t]) for t in tokens)
        return _json({"prompt": text, "text": text})  # vLLM's key, SGLang's key

    # -- models ------------------------------------------------------------------------------
    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.emu.model and name not in self.emu.adapters:
            raise ApiError(404, f"The model '{name}' does not exist", "model")
        return _json(self.emu.model_card(name))

    # -- audio -------------------------------------------------------------------------------
    async def audio(self, request: web.Request) -> web.Response:
        """Transcription/translation stub: reads the whole upload, spends engine time on a
        prompt as long as the audio (one token per 2 kB), answers deterministic text."""
        if not request.content_type.startswith("multipart/form-data"):
            raise ApiError(400, "Send multipart/form-data with a 'file' and a 'model'.", "file")
        reader = await request.multipart()
        fields: dict[str, str] = {}
        digest, size, filename = hashlib.sha256(), 0, None
        while (part := await reader.next()) is not None:
            if part.name == "file":
                filename = part.filename
                while chunk := await part.read_chunk(65536):
                    digest.update(chunk)
                    size += len(chunk)
            elif part.name:
                fields[part.name] = (await part.read(decode=True)).decode("utf-8", "replace")
        if filename is None:
            raise ApiError(400, "The 'file' part is missing.", "file")
        self._model(fields)
        n = max(1, min(size // 2048, self.emu.engine.max_request_tokens() // 2))
        await self.emu.prefill([encode(filler_text(n, key=size))])
        text = filler_text(8, key=size).strip()
        doc = {"text": text, "usage": {"type": "duration", "seconds": max(1, size // 32000)},
               "emulator": {"bytes": size, "sha256": digest.hexdigest(), "filename": filename,
                            "fields": sorted(fields)}}
        if fields.get("response_format") == "text":
            return web.Response(text=text)
        return _json(doc)


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _json(obj: object) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")
