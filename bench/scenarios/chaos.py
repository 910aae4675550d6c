"""Scenario `chaos`: steady streaming load through `lb` over two emulators and one hostile
replica that rotates through every broken shape it knows (issue 13); is any request lost?

The hostile replica (`bench/faulty_replica.py`) changes shape every `ROTATE_S`: a bad chunk
size, a CR inside a header, a never-ending SSE line, a huge body, a huge error body, gzip
nobody asked for, HTTP status 999, a stream broken after its first byte, headers then never a
body, a request accepted
and never answered while its probes say it is idle, a stream stalled after its first byte.
Clients stream (three in four) or not, for `--duration` seconds (default 30; `--quick` 10).
Every answer is classified:
  ok           2xx, a whole answer (a stream ends with `data: [DONE]` and carries no error)
  clear_error  an OpenAI-shaped error: a JSON `{"error": {...}}` body, or a stream ending
               with an error event and `data: [DONE]`
  lost         anything else: a reset, a timeout, a stream cut without [DONE], a body that
               is not the OpenAI shape, a status outside 100-599 (must be 0)
and `lb`'s RSS and open file descriptors are read from /proc at the start and the end.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

from bench.faulty_replica import HOSTILE, MIB
from bench.fleet import Fleet, free_port
from bench.scenarios._lb import start_lb

DESCRIPTION = "chaos: streaming load through lb over 2 emulators + 1 replica rotating through every broken shape; 0 lost"
DEFAULT_DURATION_S = 30.0
QUICK_DURATION_S = 10.0
ROTATE_S = 0.5
CLIENTS = 6
REQUEST_TIMEOUT_S = 30.0
SHAPES = [{"mode": m, **({"probe": "lie"} if m == "hang_body" else {})} for m in HOSTILE] + [
    {"mode": "hang", "probe": "lie"},  # accepted, never answered, probes say idle
    {"mode": "ok", "probe": "lie", "tokens": 4, "token_delay_s": 1000.0},  # stalls after the first byte
]
LB_CONFIG = {
    "server": {"access_log": False},
    # a few seconds, not minutes: the stalls are found by evidence (hung_after_s) or these
    "upstream": {"retries": 2, "max_response_bytes": MIB, "max_error_body_bytes": 65536,
                 "max_sse_line_bytes": 65536, "hung_after_s": 1.0, "first_byte_timeout_s": 5.0,
                 "read_timeout_s": 10.0},
    "breaker": {"failures": 0},  # keep sending it traffic: every shape must be met, not avoided
}


def proc_stats(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    return {"rss_mb": round(int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024, 1),
            "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


def classify(status: int, body: bytes, stream: bool) -> str:
    if not 100 <= status <= 599:
        return "lost"
    if 200 <= status < 300:
        if stream:
            if not body.endswith(b"data: [DONE]\n\n"):
                return "lost"
            events = [e for e in body.split(b"\n\n") if e.startswith(b"data: {")]
            return "clear_error" if events and b'"error"' in events[-1][:20] else "ok"
        try:
            return "ok" if "choices" in json.loads(body) else "lost"
        except ValueError:
            return "lost"
    try:
        err = json.loads(body)["error"]
        return "clear_error" if isinstance(err, dict) and "message" in err and "type" in err else "lost"
    except (ValueError, KeyError, TypeError):
        return "lost"


class Rotator:
    """Changes the hostile replica's shape every ROTATE_S until stopped."""

    def __init__(self, url: str):
        self.url, self.stop, self.count = url, threading.Event(), 0

    def run(self) -> None:
        for shape in itertools.cycle(SHAPES):
            if self.stop.is_set():
                break
            self._set({"probe": "honest", "token_delay_s": 0.01, "tokens": 8, "size_bytes": 8 * MIB, **shape})
            self.count += 1
            self.stop.wait(ROTATE_S)
        self._set({"mode": "ok", "probe": "honest"})

    def _set(self, doc: dict) -> None:
        req = urllib.request.Request(self.url + "/fault", data=json.dumps(doc).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=5).read()
        except OSError:
            pass


async def load(lb_url: str, duration_s: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    counts = {"sent": 0, "ok": 0, "clear_error": 0, "lost": 0}
    lost: list[str] = []
    deadline = time.monotonic() + duration_s
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            n += 1
            stream = rng.random() < 0.75
            doc = {"model": "m", "max_tokens": 16, "stream": stream,
                   "messages": [{"role": "user", "content": f"client {i} request {n}: tell me a story"}]}
            counts["sent"] += 1
            try:
                async with session.post(lb_url + "/v1/chat/completions", json=doc) as r:
                    body = await r.read()
                    kind = classify(r.status, body, stream)
                    why = f"HTTP {r.status} {body[-200:]!r}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                kind, why = "lost", f"{type(e).__name__}: {e}"
            counts[kind] += 1
            if kind == "lost" and len(lost) < 20:
                lost.append(why)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session, i) for i in range(CLIENTS)))
    return {**counts, "lost_examples": lost}


def run(out_dir: Path, quick: bool, duration: float | None = None) -> dict:
    duration = duration or (QUICK_DURATION_S if quick else DEFAULT_DURATION_S)
    with Fleet(out_dir / "logs") as fleet:
        emus = fleet.emulators(2, profile="tiny", speed=4.0, model="m")
        port = free_port()
        hostile = fleet.start("hostile", [sys.executable, "-m", "bench.faulty_replica", "--port", str(port)],
                              "/fault", port)
        lb = start_lb(fleet, [e.url for e in emus] + [hostile.url], policy="round-robin", config=LB_CONFIG)
        start = proc_stats(lb.pid)
        rotator = Rotator(hostile.url)
        thread = threading.Thread(target=rotator.run, daemon=True)
        thread.start()
        t0 = time.monotonic()
        try:
            counts = asyncio.run(load(lb.url, duration))
        finally:
            rotator.stop.set()
            thread.join(timeout=10)
        wall = time.monotonic() - t0
        end = proc_stats(lb.pid)
        alive = lb.popen.poll() is None
    figures = {**counts, "duration_s": round(wall, 1), "shape_changes": rotator.count, "lb_alive": alive,
               "lb_start": start, "lb_end": end}
    notes = [f"{counts['sent']} requests sent over {duration:g}s (the last answered {wall - duration:.1f}s later), "
             f"{rotator.count} shape changes: {counts['ok']} answered 2xx, "
             f"{counts['clear_error']} with a clear error, {counts['lost']} lost",
             f"lb RSS {start['rss_mb']} -> {end['rss_mb']} MB, open fds {start['open_fds']} -> {end['open_fds']}"]
    warnings = [f"{counts['lost']} requests lost, e.g. {counts['lost_examples'][:3]}"] if counts["lost"] else []
    if not alive:
        warnings.append("lb exited during the run")
    return {"scenario": "chaos", "variants": {}, "chaos": figures, "notes": notes, "warnings": warnings}
