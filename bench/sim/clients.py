"""Clients in virtual time, as `lb-bench run` drives them live (bench/client.py).

Closed loop (`Programs`): the live workloads' own programs (bench/workloads: Tree of
Thoughts, Mixed Tree, multi-turn conversations) hand out requests; a request's prompt is
the program's chat messages rendered and tokenized exactly as the emulator does
(`bench.tokenizer`), and when it finishes the program is given the output text the
simulated engine produced (`bench.engine.answer_ids` under the request's sample key: every
answer is sampled, its own, as a Tree of Thoughts samples its thoughts; the ids decode to
text that encodes back to the same ids, so a child's prompt carries its parent's answer as
a token prefix, as it does live). Two trees asking the same question share the question's
prompt, not their answers. Programs run either
- from a fixed number of clients per region, each running one program after another (the
  live client's `--clients`; the agreement test uses this), or
- as program arrivals, a Poisson stream of new programs at a rate (how `--load` offers a
  share of the fleet's capacity: each arrival is a tree or a conversation that then runs
  closed-loop inside).

Open loop (`Replay`): requests at given times whatever the system does (trace replays).
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Callable, Iterator

from bench.engine import answer_ids, answer_key
from bench.sim.arena import Arena, Call, Done
from bench.tokenizer import decode, encode, render_chat
from bench.workloads.base import RequestSpec


def output_text(request_id: str, n: int) -> str:
    """The text of the `n` output tokens the simulated engine emits for `request_id`."""
    return decode(answer_ids(answer_key(request_id), 0, n))


@functools.lru_cache(maxsize=1 << 16)
def _encode_part(text: str) -> tuple[int, ...]:
    return tuple(encode(text))


_HEAD = "<|begin_of_text|>"
_GENERATION = render_chat([])[len(_HEAD):]  # the assistant header that ends every prompt


def encode_chat(messages: list[dict]) -> list[int]:
    """`encode(render_chat(messages))`, message by message: every rendered message starts and
    ends at a special token, which no piece straddles, so the parts encode independently and
    a conversation's earlier messages (shared by every child and later turn) are cached."""
    tokens = list(_encode_part(_HEAD))
    for m in messages:
        tokens.extend(_encode_part(render_chat([m])[len(_HEAD):-len(_GENERATION)]))
    tokens.extend(_encode_part(_GENERATION))
    return tokens


def call_of(spec: RequestSpec, region: str) -> Call:
    return Call(request_id=spec.request_id, region=region, tokens=encode_chat(spec.messages),
                output_tokens=spec.max_tokens, user=spec.user, session=spec.session,
                interaction_id=spec.interaction_id, stage=spec.stage, final=bool(spec.final), app=spec.app,
                samples=spec.n)


class Programs:
    """Closed-loop programs of one workload (`program(client, index)`) sent into an arena
    until `stop_at`; a program's next requests go out the moment their parent's last
    token is back at the client, or `delay_s` later (a tool's run), as the live client does."""

    def __init__(self, arena: Arena, workload, *, stop_at: float, max_requests: int | None = None):
        self.arena, self.workload, self.stop_at = arena, workload, stop_at
        self.max_requests = max_requests  # like the live client's --requests: stop issuing after this many
        self.programs_started = 0
        self.finished: list[tuple[float, float]] = []  # (started, ended) of each program that ran whole

    def may_issue(self) -> bool:
        if self.max_requests is not None and self.arena.sent >= self.max_requests:
            return False
        return self.arena.loop.now < self.stop_at

    def _send(self, program, spec: RequestSpec, region: str, on_end: Callable[[], None] | None) -> None:
        self.arena.send(call_of(spec, region), lambda done: self._finished(program, spec, region, on_end, done))

    def _finished(self, program, spec: RequestSpec, region: str, on_end, done: Done) -> None:
        program.pending -= 1
        for nxt in program.on_done(spec, output_text(spec.request_id, done.output_tokens)):
            if not self.may_issue():
                program.cut = True
            else:
                program.pending += 1
                if nxt.delay_s > 0:  # a tool runs first: the request leaves when it is done
                    self.arena.loop.at(self.arena.loop.now + nxt.delay_s, self._after_delay, program, nxt, region, on_end)
                else:
                    self._send(program, nxt, region, on_end)
        self._settle(program, on_end)

    def _after_delay(self, program, spec: RequestSpec, region: str, on_end) -> None:
        if self.may_issue():
            self._send(program, spec, region, on_end)
            return
        program.pending -= 1
        program.cut = True
        self._settle(program, on_end)

    def _settle(self, program, on_end: Callable[[], None] | None) -> None:
        """A program with nothing in flight or waiting on a tool has ended; it ran whole unless
        a request it would have sent was not (the run's end, `max_requests`)."""
        if program.pending:
            return
        if not program.cut:
            self.finished.append((program.started_at, self.arena.loop.now))
        if on_end is not None:
            on_end()

    def start_program(self, client: int, index: int, region: str, on_end: Callable[[], None] | None = None) -> None:
        if not self.may_issue():
            return
        program = self.workload.program(client, index)
        self.programs_started += 1
        program.pending, program.cut, program.started_at = 0, False, self.arena.loop.now
        for spec in program.start():
            if not self.may_issue():
                program.cut = True
            else:
                program.pending += 1
                self._send(program, spec, region, on_end)
        self._settle(program, on_end)

    def clients(self, per_region: dict[str, int]) -> None:
        """Fixed clients: each runs programs 0, 1, 2, ... one after another."""
        client = 0
        for region, n in per_region.items():
            for _ in range(n):
                self._client_loop(client, 0, region)
                client += 1

    def _client_loop(self, client: int, index: int, region: str) -> None:
        self.start_program(client, index, region, lambda: self._client_loop(client, index + 1, region))

    def arrivals(self, rate_per_region: dict[str, float], seed: int, surge: "Surge | None" = None) -> None:
        """New programs as Poisson arrivals at `rate` per second in each region (times `surge`'s
        factor inside its window: the same draws, their times warped)."""
        rng = random.Random(f"{seed}/program-arrivals")
        counter = iter(range(1 << 40))
        loop = self.arena.loop
        warp = Surge.warp_of(surge)

        def arrive(region: str, rate: float, u: float) -> None:
            if loop.now >= self.stop_at:
                return
            self.start_program(next(counter), 0, region)
            u += rng.expovariate(rate)
            loop.at(warp(u), arrive, region, rate, u)

        for region, rate in rate_per_region.items():
            if rate > 0:
                u = rng.expovariate(rate)
                loop.at(warp(u), arrive, region, rate, u)


@dataclass(frozen=True)
class Surge:
    """Offered load `factor` times the run's from `start_s` to `end_s` (virtual seconds), as
    traffic does when a launch or an outage elsewhere lands on the fleet: arrivals drawn at the
    run's rate keep their order and draws, and their times inside the window are compressed
    by `factor` (later ones shifted back accordingly), so every system sees the same ones."""
    start_s: float
    end_s: float
    factor: float

    @classmethod
    def parse(cls, spec: str) -> "Surge":
        parts = spec.split(":")
        try:
            start, end, factor = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"{spec!r}: expected START:END:FACTOR in virtual seconds and a multiple of the "
                             "offered load, e.g. 100:200:1.5") from None
        if not 0 <= start < end:
            raise ValueError(f"{spec!r}: the window must have 0 <= START < END")
        if not factor > 0:
            raise ValueError(f"{spec!r}: FACTOR must be > 0 (1.5: half again the offered load)")
        return cls(start, end, factor)

    @staticmethod
    def warp_of(surge: "Surge | None"):
        """`surge.warp`, or with no surge the times as drawn."""
        return surge.warp if surge is not None else (lambda u: u)

    def warp(self, u: float) -> float:
        """The virtual time of an arrival drawn at time `u` on the run's own rate."""
        if u <= self.start_s:
            return u
        inside = (self.end_s - self.start_s) * self.factor  # the run-rate time the window takes in
        if u < self.start_s + inside:
            return self.start_s + (u - self.start_s) / self.factor
        return u - inside + (self.end_s - self.start_s)


@dataclass
class Timed:
    at: float
    call: Call


class Replay:
    """Open loop: each call at its time (already scaled), one heap entry at a time."""

    def __init__(self, arena: Arena, calls: Iterator[Timed], *, stop_at: float):
        self.arena, self.calls, self.stop_at = arena, calls, stop_at
        self._next()

    def _next(self) -> None:
        item = next(self.calls, None)
        if item is None or item.at >= self.stop_at:
            return
        self.arena.loop.at(item.at, self._fire, item)

    def _fire(self, item: Timed) -> None:
        self.arena.send(item.call, lambda done: None)
        self._next()
