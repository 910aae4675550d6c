"""The engine model with pure-decode runs collapsed: same timing, a fraction of the calls.

Stepping every decode iteration of ~100 replicas for a day is ~10⁸ `Engine.step` calls and
~10⁹ emitted tokens: hours of Python. But between two events that change a batch (an
arrival, an admission, a finish, a preemption) every step of `Engine` is a pure decode step
of the same n sequences whose duration grows by `context_token_s·n` per step, so k of them
have a closed form. `FastEngine` is `Engine` plus three methods that plan such a run,
find how many of its steps had started by some instant, and apply j steps at once.

What stays exact (tests/bench/test_sim.py checks it against `Engine` stepped one by one):
step start/end times, admission, first-token and finish times, KV accounting, preemption,
cached tokens. What differs: output token *ids* (`Engine(token_ids=False)`) are a window of
`bench.engine.ANSWERS` per sampled request (one fixed id without a sample key) instead of a
draw per token: a slice per run, and two answers still differ exactly when their keys do.

Why a run can be collapsed: admission is checked at each step start, and during pure decode
the free KV minus running reservations never grows (each sequence takes one token and its
reservation shrinks by at most one), so a head that does not fit at the run's start does
not fit within it; k is cut before the first finish and before KV runs out, so neither a
finish nor a preemption falls inside the run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from bench.engine import FIXED_TOKEN, Engine, answer_ids


@dataclass(frozen=True)
class DecodeRun:
    start: float
    n: int  # decoding sequences
    k: int  # steps in the run
    first: float  # duration of its first step
    growth: float  # each next step is this much longer (context grows by n tokens)

    def step_start(self, i: int) -> float:
        return self.start + i * self.first + self.growth * i * (i - 1) / 2

    @property
    def end(self) -> float:
        return self.step_start(self.k)

    def started_before(self, t: float) -> int:
        """How many of the run's steps started strictly before `t`."""
        if t <= self.start:
            return 0
        a, b = self.growth / 2, self.first - self.growth / 2
        x = t - self.start  # solve a·i² + b·i = x
        i = x / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * x)) / (2 * a)
        j = min(self.k, max(0, math.ceil(i)))
        while j > 0 and self.step_start(j - 1) >= t:
            j -= 1
        while j < self.k and self.step_start(j) < t:
            j += 1
        return j


class FastEngine(Engine):
    collapsed_steps = 0  # steps applied in closed form (per instance once set)

    def __init__(self, profile, seed: int = 0, token_ids: bool = False):
        super().__init__(profile, seed, token_ids)

    def plan_decode_run(self, now: float, min_steps: int = 2) -> DecodeRun | None:
        """The pure-decode steps from `now` on that `step` would run with nothing in between,
        stopping before the first finish and before KV runs out; None if fewer than
        `min_steps` (then step normally)."""
        running = self._running
        if not running or now < self._busy_until:
            return None
        p = self.profile
        if self._waiting and (p.new_token_ratio is not None or p.waiting_order == "lpm"):
            # SGLang's ratio decays every step, so the head may fit within the run; and
            # admitting at `now` ahead of time would miss arrivals before `now`, which LPM
            # may order first: step normally while any wait.
            return None
        self._admit(now)  # what the next step does first; admits nothing twice
        n = len(running)
        remaining = math.inf
        context = 0
        for seq in running:
            if seq.computed < seq.prefill_end:
                return None  # a prompt chunk to prefill: a normal step
            left = seq.target - seq.output_len
            if left < remaining:
                remaining = left
            context += seq.computed
        k = min(int(remaining) - 1, self._free() // n)
        if k < min_steps:
            return None
        first = p.step_base_s + p.decode_seq_s * n + p.context_token_s * context
        return DecodeRun(now, n, k, first, p.context_token_s * n)

    def apply_decode_steps(self, run: DecodeRun, j: int) -> None:
        """The state after the run's first `j` steps, exactly as `step` would leave it."""
        if j <= 0:
            return
        self._allocate(run.n * j)
        filler = [FIXED_TOKEN] * j
        for seq in self._running:
            key = seq.req.sample_key
            seq.tokens.extend(filler if key is None else answer_ids(key, seq.output_len, j))
            seq.private += j
            seq.computed = len(seq.tokens)
        self.counters.generation_tokens += run.n * j
        self.counters.count_decode_batches(j)
        if self.profile.new_token_ratio is not None:  # j decode steps, no retraction
            self.new_token_ratio = max(self._ratio_min, self.new_token_ratio - j * self._ratio_decay)
        self.collapsed_steps += j
        self._busy_until = run.step_start(j)

    def probe(self, at: float | None = None) -> tuple:
        """(waiting, running, KV usage, free KV tokens, preemptions, retracted lately, first
        tokens, running LoRA adapters): what a load endpoint reports. A vLLM-like engine's /metrics has the preemption
        counter and its TTFT histogram's count; SGLang's /v1/loads the retractions of its last
        stats window (`queues.retracted`), its /metrics the count (`SimReplica.probe_into_view`
        reads it only where the daemon would). `at`: when it answers (the first tokens of a step
        still under way are not counted yet); None: those counted so far."""
        used, total = self._used(), self.profile.kv_tokens
        c = self.counters
        vllm = self.profile.new_token_ratio is None
        return (len(self._waiting), len(self._running), used / total, total - used,
                c.preemptions if vllm else None, None if vllm else c.retracted_last_window,
                c.ttfts if at is None else self.first_tokens_by(at),
                # vLLM's /metrics names the running LoRA adapters (`vllm:lora_requests_info`);
                # SGLang's load endpoints name none
                frozenset(s.req.adapter for s in self._running if s.req.adapter)
                if vllm and self.profile.max_loras is not None else frozenset())
