"""`lb-bench run`: drive a workload against OpenAI-compatible targets and report.

One aiohttp session (a keep-alive pool) streams every request with
`stream_options.include_usage`, timing TTFT, inter-chunk gaps and E2E and reading the token
counts from the usage chunk (`--no-stream`: asks for whole answers, as batch and many
third-party clients do; E2E and usage only, no TTFT). Closed-loop workloads run `--clients`
programs at a time; open-loop replays fire at trace times divided by `--time-scale` (an agent's tool runs too). A run
stops issuing at `--duration` or after `--requests`, and a hard `--deadline` cancels whatever
is still in flight (reported as errors of kind `deadline`), so every run ends by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import aiohttp
import orjson

from bench import report as report_mod
from bench.stats import RequestRecord, programs_finished_rps, run_report
from bench.workloads import WORKLOADS, is_open_loop, make_workload
from bench.workloads.base import EXACT, RequestSpec, check_max_tokens

DEFAULT_REQUESTS = 100
DEFAULT_GRACE_S = 30.0  # in-flight requests may finish this long after --duration
DEFAULT_DEADLINE_S = 600.0  # hard limit when only --requests bounds the run


class SSEDecoder:
    """Incremental Server-Sent Events decoder: bytes in, `data` payloads out.

    Handles events split anywhere across network chunks, CRLF or LF line ends, comment lines
    and multi-line `data` fields, as the SSE spec and OpenAI-compatible servers use them.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            line = self._buffer[:newline].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[newline + 1:]
            if not line:  # blank line ends an event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
            # other fields (event:, id:, retry:) and comments (":") carry nothing we need


def chunk_text(chunk: dict) -> str:
    """The text a streamed chat or completion chunk adds."""
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            parts.append(text)
    return "".join(parts)


async def send_whole(session: aiohttp.ClientSession, url: str, spec: RequestSpec, model: str,
                     record: RequestRecord, clock, declared: str | int = EXACT, lb_headers: bool = True) -> str | None:
    """One request answered whole (`stream: false`), filling `record` (no TTFT: the client
    sees nothing before the end); returns the output text when it succeeded."""
    body = spec.body(model, declared)
    body["stream"] = False
    body.pop("stream_options", None)
    sent = clock()
    try:
        async with session.post(url, data=orjson.dumps(body),
                                headers={"Content-Type": "application/json", **spec.headers(lb_headers)}) as resp:
            record.status = resp.status
            data = await resp.read()
    except aiohttp.ClientConnectorError:
        record.error = "connect"
        return None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        record.error = "disconnect" if record.status else "connect"
        return None
    record.e2e = clock() - sent
    if record.status != 200:
        record.error = f"http_{record.status}"
        return None
    try:
        doc = orjson.loads(data)
        text = doc["choices"][0]["message"]["content"] or ""
        read_usage(record, doc.get("usage") or {})
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        record.error = "bad_body"
        return None
    record.ok = True
    return text


def read_usage(record: RequestRecord, usage: dict) -> None:
    """Token counts from an OpenAI `usage` object (a stream's last chunk, or a whole answer)."""
    record.prompt_tokens = usage.get("prompt_tokens") or 0
    record.output_tokens = usage.get("completion_tokens") or 0
    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def send(session: aiohttp.ClientSession, url: str, spec: RequestSpec, model: str,
               record: RequestRecord, clock, declared: str | int = EXACT, lb_headers: bool = True) -> str | None:
    """Stream one request, filling `record`; returns the output text when it succeeded.
    `declared`: what max_tokens the client declares (bench.workloads.base.EXACT); `lb_headers`
    False: it sends none of lb's headers (`RequestSpec.headers`)."""
    sent = clock()
    output: list[str] = []
    last_token_at = None
    done = finished = False
    chunks = 0
    try:
        async with session.post(url, data=orjson.dumps(spec.body(model, declared)),
                                headers={"Content-Type": "application/json", **spec.headers(lb_headers)}) as resp:
            record.status = resp.status
            if resp.status != 200:
                await resp.read()
                record.error = f"http_{resp.status}"
                return None
            decoder = SSEDecoder()
            async for raw in resp.content.iter_any():
                for data in decoder.feed(raw):
                    if data == "[DONE]":
                        done = True
                        continue
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        record.error = "stream_error"
                        return None
                    text = chunk_text(chunk)
                    if text:
                        now = clock()
                        if last_token_at is None:
                            record.ttft = now - sent
                        else:
                            record.itl.append(now - last_token_at)
                        last_token_at = now
                        chunks += 1
                        output.append(text)
                    finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or ())
                    usage = chunk.get("usage")
                    if usage:
                        read_usage(record, usage)
    except aiohttp.ClientConnectorError:
        record.error = "connect"
        return None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        record.error = "disconnect" if record.status else "connect"
        return None
    record.e2e = clock() - sent
    if not (done or finished):
        record.error = "incomplete"
        return None
    record.output_tokens = record.output_tokens or chunks
    record.ok = True
    return "".join(output)


class Bench:
    """One bounded run: issues requests, keeps records, cancels stragglers at the deadline."""

    def __init__(self, targets: list[str], workload, *, model: str, clients: int,
                 duration: float | None, requests: int | None, time_scale: float,
                 deadline: float, progress: bool, stream: bool = True, max_tokens: str | int = EXACT,
                 program_rate: float | None = None, seed: int = 0, lb_headers: bool = True):
        self.send = send if stream else send_whole
        self.lb_headers = lb_headers
        self.declared = max_tokens
        self.urls = itertools.cycle([t.rstrip("/") + "/v1/chat/completions" for t in targets])
        self.workload, self.model, self.clients = workload, model, clients
        self.duration, self.max_requests, self.time_scale = duration, requests, time_scale
        self.deadline, self.progress = deadline, progress
        self.records: list[RequestRecord] = []
        self.inflight: dict[asyncio.Task, RequestRecord] = {}
        self.completions: deque[float] = deque()
        self.t0 = 0.0
        # programs arriving open loop (Poisson, each its own user) instead of closed-loop clients
        self.program_rate, self.seed = program_rate, seed
        self.programs_started = 0
        self.finished: list[tuple[float, float]] = []  # (started, ended) of each program that ran whole

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def may_issue(self) -> bool:
        if self.max_requests is not None and len(self.records) >= self.max_requests:
            return False
        return self.duration is None or self.clock() < self.duration

    def issue(self, session: aiohttp.ClientSession, spec: RequestSpec) -> asyncio.Task:
        record = RequestRecord(spec.request_id, self.clock(), tenant=spec.user, tier=spec.tier,
                               interaction_id=spec.interaction_id, final=spec.final)
        self.records.append(record)
        task = asyncio.ensure_future(self.send(session, next(self.urls), spec, self.model, record, self.clock,
                                                 self.declared, self.lb_headers))
        self.inflight[task] = record
        task.add_done_callback(lambda t: (self.inflight.pop(t, None), self.completions.append(self.clock())))
        return task

    async def closed_client(self, session: aiohttp.ClientSession, client: int) -> None:
        for index in itertools.count():
            if not self.may_issue():
                return
            await self.run_program(session, self.workload.program(client, index))

    async def run_program(self, session: aiohttp.ClientSession, program) -> None:
        """One program to its end: its next requests go out as their parents answer. It ran
        whole unless the run's end kept one of them from going out."""
        started, cut = self.clock(), False
        self.programs_started += 1
        running: dict[asyncio.Task, RequestSpec] = {}
        for spec in program.start():
            if not self.may_issue():
                cut = True
                continue
            running[self.issue(session, spec)] = spec
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                spec = running.pop(task)
                output = task.result()
                cut |= output is None  # failed, or its tool ran past the run's end
                for nxt in program.on_done(spec, output):
                    if not self.may_issue():
                        cut = True
                        continue
                    if nxt.delay_s > 0:  # a tool runs first (its time scaled as the engines')
                        running[asyncio.ensure_future(self.issue_after(session, nxt))] = nxt
                    else:
                        running[self.issue(session, nxt)] = nxt
        if not cut:
            self.finished.append((started, self.clock()))

    async def program_arrivals(self, session: aiohttp.ClientSession) -> None:
        """Programs as Poisson arrivals at `program_rate` a second, each its own user (program
        `i` of client `i`), as the simulator's `--load` drives them: past capacity the backlog
        of new programs grows without bound, which closed-loop clients never build."""
        rng = random.Random(f"{self.seed}/program-arrivals")
        tasks = []
        for i in itertools.count():
            await asyncio.sleep(rng.expovariate(self.program_rate))
            if not self.may_issue():
                break
            tasks.append(asyncio.ensure_future(self.run_program(session, self.workload.program(i, 0))))
        if tasks:
            await asyncio.wait(tasks)

    async def issue_after(self, session: aiohttp.ClientSession, spec: RequestSpec) -> str | None:
        """`spec` sent once its tool has run; None (the program stops) when the run is over."""
        await asyncio.sleep(spec.delay_s / self.time_scale)
        if not self.may_issue():
            return None
        return await self.issue(session, spec)

    async def open_loop(self, session: aiohttp.ClientSession, arrivals: Iterator[RequestSpec]) -> None:
        tasks = []
        for spec in arrivals:
            at = spec.at / self.time_scale
            if self.duration is not None and at >= self.duration:
                break
            if at > self.clock():
                await asyncio.sleep(at - self.clock())
            if not self.may_issue():
                break
            tasks.append(self.issue(session, spec))
        if tasks:
            await asyncio.wait(tasks)

    async def show_progress(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = self.clock()
            while self.completions and self.completions[0] < now - 5.0:
                self.completions.popleft()
            done = len(self.records) - len(self.inflight)
            sys.stdout.write(f"\r  {now:7.1f}s  done {done:6d}  in flight {len(self.inflight):4d}"
                             f"  {len(self.completions) / min(5.0, max(now, 1e-9)):7.1f} req/s ")
            sys.stdout.flush()

    async def run(self) -> tuple[dict, list[RequestRecord]]:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            self.t0 = time.monotonic()
            if is_open_loop(self.workload):
                drivers = [asyncio.ensure_future(self.open_loop(session, self.workload.arrivals()))]
            elif self.program_rate:
                drivers = [asyncio.ensure_future(self.program_arrivals(session))]
            else:
                drivers = [asyncio.ensure_future(self.closed_client(session, c)) for c in range(self.clients)]
            ticker = asyncio.ensure_future(self.show_progress()) if self.progress else None
            _, late = await asyncio.wait(drivers, timeout=self.deadline)
            stragglers = dict(self.inflight)
            for task in [*late, *stragglers]:
                task.cancel()
            await asyncio.gather(*late, *stragglers, return_exceptions=True)
            for record in stragglers.values():
                record.error = "deadline"
            for task in drivers:
                if not task.cancelled() and task.exception():
                    raise task.exception()
            duration = self.clock()
            if ticker:
                ticker.cancel()
                sys.stdout.write("\n")
        report = run_report(self.records, duration, self.duration, workload=self.workload.name, model=self.model,
                            clients=self.clients if not (is_open_loop(self.workload) or self.program_rate) else None,
                            program_rate=self.program_rate, time_scale=self.time_scale)
        if not is_open_loop(self.workload):
            report["programs"] = {"started": self.programs_started, "finished": len(self.finished),
                                  "finished_rps": programs_finished_rps(self.finished, report["steady"]["from_s"],
                                                                        min(self.duration or duration, duration))}
        return report, self.records


async def discover_model(target: str) -> str:
    """The first model the target serves (`GET /v1/models`), so --model is optional."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(target.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            # SGLang Router serves JSON as text/plain
            return (await resp.json(content_type=None))["data"][0]["id"]


async def run_bench(targets: list[str], workload_name: str, *, clients: int = 8,
                    duration: float | None = None, requests: int | None = None, seed: int = 0,
                    model: str | None = None, time_scale: float = 1.0, deadline: float | None = None,
                    progress: bool = False, params: dict | None = None,
                    stream: bool = True, max_tokens: str | int = EXACT,
                    program_rate: float | None = None, lb_headers: bool = True) -> tuple[dict, list[RequestRecord]]:
    """Run one bounded workload; returns (run JSON, per-request records). Used by scenarios."""
    if duration is None and requests is None:
        requests = DEFAULT_REQUESTS
    if deadline is None:
        deadline = duration + DEFAULT_GRACE_S if duration is not None else DEFAULT_DEADLINE_S
    workload = make_workload(workload_name, seed=seed, **(params or {}))
    model = model or await discover_model(targets[0])
    bench = Bench(targets, workload, model=model, clients=clients, duration=duration,
                  requests=requests, time_scale=time_scale, deadline=deadline, progress=progress,
                  stream=stream, max_tokens=max_tokens, program_rate=program_rate, seed=seed, lb_headers=lb_headers)
    result, records = await bench.run()
    result = {"target": targets[0] if len(targets) == 1 else targets, "seed": seed, "stream": stream,
              "max_tokens": max_tokens, "lb_headers": lb_headers, **result}
    return result, records


def parse_param(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--param wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", action="append", required=True,
                        help="base URL of an OpenAI-compatible server; repeat to round-robin")
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients (default 8)")
    parser.add_argument("--program-rate", type=float, metavar="R",
                        help="programs (trees, conversations, sessions) arriving at R a second, Poisson, each "
                             "its own user, instead of closed-loop clients: past capacity new programs pile "
                             "up as in the simulator's --load; the run reports programs finished a second")
    parser.add_argument("--duration", type=float, help="stop issuing after S seconds")
    parser.add_argument("--requests", type=int, help=f"stop after N requests (default {DEFAULT_REQUESTS} "
                                                     "when --duration is absent)")
    parser.add_argument("--deadline", type=float, help="hard limit: cancel in-flight requests after S "
                        f"seconds (default duration + {DEFAULT_GRACE_S:.0f}, or {DEFAULT_DEADLINE_S:.0f})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model name (default: the target's first /v1/models entry)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="replay F× faster (open loop) and run agent tools F× faster (closed loop)")
    parser.add_argument("--param", action="append", type=parse_param, default=[],
                        help="workload parameter KEY=VALUE (JSON values), e.g. output_tokens=32")
    parser.add_argument("--out", type=Path, help="write the run JSON here")
    parser.add_argument("--records", type=Path, help="write one JSON line per request here")
    parser.add_argument("--no-stream", action="store_true",
                        help="ask for whole answers (stream: false): E2E and usage only, no TTFT")
    parser.add_argument("--no-session-headers", action="store_true",
                        help="send none of lb's headers (x-lb-session, -interaction-id, -user, ...), as the openai SDK "
                             "and most third-party clients do; the OpenAI `user` field stays in the body")
    parser.add_argument("--max-tokens", default=EXACT, metavar="exact|none|N",
                        help="what max_tokens to declare: exact (each answer's length, the default: an oracle "
                             "no real client is), none, or N (a loose cap: choose one the context allows); "
                             "otherwise the answer's length goes as min_tokens, where the emulator ends it")


def run(args: argparse.Namespace) -> int:
    try:  # a bad --param reads as one line naming it, before anything starts
        workload = make_workload(args.workload, seed=args.seed, **dict(args.param))
        max_tokens = check_max_tokens(args.max_tokens)
        if args.program_rate is not None and (args.program_rate <= 0 or is_open_loop(workload)):
            raise ValueError(f"--program-rate {args.program_rate}: wants a rate > 0 and a program workload "
                             f"({args.workload} {'replays its own arrivals' if is_open_loop(workload) else 'is one'})")
    except (ValueError, TypeError) as e:
        print(f"lb-bench run: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    result, records = asyncio.run(run_bench(
        args.target, args.workload, clients=args.clients, duration=args.duration,
        requests=args.requests, seed=args.seed, model=args.model, time_scale=args.time_scale,
        deadline=args.deadline, progress=sys.stdout.isatty(), params=dict(args.param),
        stream=not args.no_stream, max_tokens=max_tokens, program_rate=args.program_rate,
        lb_headers=not args.no_session_headers))
    print(report_mod.format_run(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.records:
        with open(args.records, "w") as f:
            for record in records:
                f.write(json.dumps(asdict(record)) + "\n")
    return 0 if result["ok"] > 0 else 1
