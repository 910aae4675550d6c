"""A continuous-batching inference engine, as a pure model with the clock passed in.

The HTTP emulator drives it in real time and the simulator in virtual time, with the same
calls; nothing here sleeps, reads a clock or knows asyncio.

API (stable; build on it):

    engine = Engine(profile, seed=0, token_ids=True)   # token_ids=False: see below
    engine.submit(EngineRequest(id, prompt_tokens, max_new_tokens, ignore_eos, priority,
                                arrival), now)          # ValueError if it can never fit
    t = engine.next_event_time(now)   # None when idle: nothing to run, sleep until a submit
    res = engine.step(now)            # runs one iteration starting at `now`
    # res.duration: how long it takes (profile); its tokens appear at res.end = now + duration.
    # Call step again at res.end (next_event_time says so); a submit/abort in between joins
    # the next step.
    engine.abort(id, now) -> bool     # frees the request's KV (disconnect, /abort_request)
    engine.load() -> EngineLoad       # running, waiting, KV used/total, hit rate, counters
    engine.flush_cache() -> bool      # False while requests are queued or running

Scheduling, as SGLang and vLLM do it:
- A waiting request is admitted (becomes running) only when its uncached prompt tokens plus
  a decode reservation (`profile.decode_reserve`, capped by max_new_tokens, at least its
  first token) fit in the free KV, token-granular, after the reservations of running
  requests (at least their next token each); evictable cache counts as free. Admission is in priority order (higher `priority` first, as SGLang), then arrival,
  and stops at the first request that does not fit (no overtaking). `profile.max_running`
  caps the batch. Admission is tried on submit, on abort and at every step, so *waiting*
  requests are exactly those the KV (or the cap) cannot take right now; an admitted
  request's prefill starts with the next step.
- Each step decodes one token for every running request past its prefill and spends the
  rest of the token budget (`profile.prefill_budget`) on prompt chunks (chunked prefill);
  the step that completes a prompt emits its first token. KV grows one token per emitted
  token. When a step's tokens do not fit, the newest running request of the lowest priority
  is preempted back to waiting (recompute: its prompt and output so far are prefilled again,
  mostly from the cache, when it is readmitted).
- SGLang's scheduler, when the profile asks for it (`Profile.as_sglang`): admission checks a
  request's uncached prompt plus its whole remaining max_new_tokens (clipped at 4096) against
  the free KV minus `ratio × remaining max_new_tokens` of every running request, where
  `ratio` starts at 0.7, decays by (0.7 − 0.098)/600 per decode step down to 0.098 and is
  reset when the engine idles; so after a quiet stretch SGLang admits far more than fits
  for the whole output. When a decode step does not fit, it retracts requests (fewest
  output tokens first, longest prompt among those) until 20 decode steps of the rest fit,
  and raises `ratio` to (tokens decoded + 20 × running) / Σ max_new_tokens (at most 1).
  Sources: sglang python/sglang/srt/managers/schedule_policy.py (`PrefillAdder.add_one_req`,
  `rem_total_tokens`), schedule_batch.py (`retract_decode`), scheduler.py
  (`update_running_batch`, `self_check_during_idle`), environ.py — sglang main, 2025.
  Waiting order "lpm": the queue is sorted by the longest cached prefix before each
  admission, falling back to arrival order when more than 128 wait (schedule_policy.py
  `_determine_active_policy`); admission still stops at the first request that does not fit.
- Waiting requests pin nothing: like SGLang's radix cache (only running requests hold
  `lock_ref`) and vLLM's block pool (blocks are touched only when scheduled), the cached
  prefix of a waiting request can be evicted before it is admitted; `lost_while_waiting`
  counts the prompt tokens lost that way.
- Prefix cache: a radix tree of hash-chained token blocks (`profile.block_size`). A prompt
  chunk's full blocks are inserted as the chunk is scheduled, prompt + output when a request
  ends (also on abort and preemption, up to what was computed). A request whose prefill
  starts in a step takes the blocks that earlier chunks of that step, or requests since its
  admission, have inserted: siblings sent together compute their shared prefix once, as
  vLLM v1 (blocks cached at scheduling) and SGLang (LPM's in-batch prefix caching, a step
  later) do (`Engine._shareable`). Unreferenced leaf blocks are evicted LRU
  when KV is needed. The cached part of a prompt skips prefill and is reported as cached
  tokens (always leaving at least the last prompt token to compute, as engines do).
- Step time = step_base_s + prefill_token_s·prefill tokens + decode_seq_s·decoding sequences
  + context_token_s·context tokens of the batch.
- Output: `ignore_eos` → exactly max_new_tokens; otherwise `min_new_tokens` when given (the
  model ends its answer as soon as it may), else a lognormal length (seeded per engine seed
  and prompt), capped by max_new_tokens. Output token ids are deterministic per
  (seed, prompt) and come from `tokenizer.OUTPUT_IDS`, so they decode to text.
- Sampled answers: a request with a `sample_key` (sampled decoding, the API's default) draws
  its length and ids per (seed, prompt, key), so two requests with the same prompt share the
  prompt's cache but not their answers; without one (greedy decoding) the answer follows the
  prompt. With `token_ids=False` (the simulator) a keyed answer is a window of `ANSWERS`.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from dataclasses import dataclass, field, replace

import mmh3

from bench.profiles import Profile
from bench.tokenizer import OUTPUT_IDS

FIXED_TOKEN = OUTPUT_IDS[0]  # the one output id emitted with token_ids=False and no sample key
# Sampled answers in the simulator: one long pre-drawn stream of output words, each keyed
# answer a window of it starting where its key points. A list slice per decode run, where a
# draw per token would cost the simulator its speed (it emits ~10^9 tokens an hour).
ANSWERS: tuple[int, ...] = tuple(random.Random(0x5A3D).choices(OUTPUT_IDS, k=1 << 16))


def _answer_at(key: int, i: int) -> int:
    """Where in `ANSWERS` the answer sampled under `key` has its token `i`."""
    return (key + i) % len(ANSWERS)


def answer_ids(key: int, start: int, count: int) -> list[int]:
    """Output ids `start` .. `start + count` of the answer sampled under `key`."""
    n = len(ANSWERS)
    i, out = _answer_at(key, start), []
    while count > 0:
        take = min(count, n - i)
        out.extend(ANSWERS[i:i + take])
        count, i = count - take, 0
    return out


def sample_ids(request_id: str, n: int) -> list[str]:
    """The engine request of each of a request's `n` parallel samples (the API's `n`: SGLang's
    tokenizer manager and vLLM's parallel sampling fan it out into `n` requests with ids of their
    own); a single answer keeps the request's own id."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def answer_key(request_id: str) -> int:
    """The simulator's sample key of a request: its answer is its own (clients sample)."""
    return mmh3.hash64(request_id, signed=False)[0]


# sglang environ.py: SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION, SGLANG_RETRACT_DECODE_STEPS;
# schedule_policy.py: LPM falls back to FCFS above this many waiting requests.
CLIP_MAX_NEW_TOKENS = 4096
RETRACT_DECODE_STEPS = 20
# sglang server_args.py `decode_log_interval`: every this many decode batches the scheduler
# logs its stats and hands the requests retracted since the last log to what /v1/loads
# reports (`queues.retracted`), zeroing its count (scheduler_metrics_mixin.py
# `log_decode_stats`): a count of the last window, not a total.
DECODE_LOG_INTERVAL = 40
LPM_MAX_QUEUE = 128


@dataclass
class EngineRequest:
    id: str
    prompt_tokens: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    priority: int = 0
    arrival: float = 0.0
    # The caller promises that no other request's prompt shares a block with this one (the
    # simulator's trace prompts, unique token ranges): its cache blocks are keyed per request
    # instead of hashed from token ids, which are never read (only `len(prompt_tokens)`).
    # The cache behaves exactly as with hashed keys (nothing else ever matches either way).
    unique_prompt: bool = False
    # Sampled decoding: the answer's draw (two requests with the same prompt and different keys
    # get different answers, as sampling gives them); None: greedy, the answer follows the prompt.
    sample_key: int | None = None
    # The API's `min_tokens` (SGLang's `min_new_tokens`): no end of answer before this many
    # tokens. Without `ignore_eos` the emulated model ends its answer as soon as that allows, so
    # a benchmark client can dictate an answer's length without declaring it as `max_tokens`
    # (bench.workloads.base.EXACT); 0: the lognormal length below.
    min_new_tokens: int = 0
    # The LoRA adapter the request runs with (the API's `model` naming an adapter); None: the
    # base model. Its KV is its own: engines key the prefix cache by adapter (vLLM's block
    # hashes take the LoRA id as an extra key; SGLang's radix tree is split by `lora_id`).
    adapter: str | None = None


@dataclass
class Finished:
    id: str
    reason: str  # "length" (hit max_new_tokens) or "stop" (the model's own end)
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass
class StepResult:
    start: float
    duration: float
    tokens: dict[str, int] = field(default_factory=dict)  # request id → its token this step
    finished: list[Finished] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seqs: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration


# vLLM's bucket bounds of `vllm:time_to_first_token_seconds` (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0  # finished normally
    aborted: int = 0
    preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the cache (first admission)
    prefix_hits: int = 0  # of which found
    evicted_tokens: int = 0  # prefix-cache tokens evicted to make room
    # prompt tokens that were cached when a request arrived but evicted before it was first
    # admitted: what a waiting queue costs when waiting requests do not pin their prefix
    # (neither SGLang's radix cache nor vLLM's block pool locks a waiting request's blocks)
    lost_while_waiting: int = 0
    decode_batches: int = 0  # steps that decoded (SGLang's `forward_ct_decode`)
    preempted_since_log: int = 0  # preemptions since the last DECODE_LOG_INTERVAL boundary
    retracted_last_window: int = 0  # those of the last whole window: SGLang's `queues.retracted`
    # each request's time from its arrival to its first token, summed, and how many: the sum
    # and count of the engines' TTFT histograms (`vllm:time_to_first_token_seconds`,
    # `sglang:time_to_first_token_seconds`); `ttft_buckets` counts them by vLLM's bounds
    ttft_total_s: float = 0.0
    ttfts: int = 0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS_S))

    def count_first_token(self, ttft_s: float) -> None:
        self.ttft_total_s += ttft_s
        self.ttfts += 1
        at = bisect.bisect_left(TTFT_BUCKETS_S, ttft_s)  # the first bound it is not above
        if at < len(TTFT_BUCKETS_S):  # above the last: only in +Inf, which is the count
            self.ttft_buckets[at] += 1

    def count_decode_batches(self, n: int) -> None:
        """`n` more decode batches: at each DECODE_LOG_INTERVAL boundary the window's
        preemptions become what the load endpoint reports, and the count starts over."""
        crossed = (self.decode_batches + n) // DECODE_LOG_INTERVAL - self.decode_batches // DECODE_LOG_INTERVAL
        self.decode_batches += n
        if crossed:  # past a second boundary the window reported had none
            self.retracted_last_window = self.preempted_since_log if crossed == 1 else 0
            self.preempted_since_log = 0


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    kv_used_tokens: int  # referenced by requests (evictable cache counts as free)
    kv_total_tokens: int
    cache_tokens: int  # blocks held by the prefix cache, referenced or not
    waiting_prompt_tokens: int
    max_running: int | None
    counters: Counters
    # LoRA: the adapters of the running and of the waiting requests, and how many one batch runs
    # (vLLM's `vllm:lora_requests_info` labels running_lora_adapters, waiting_lora_adapters, max_lora)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    max_loras: int | None = None

    @property
    def token_usage(self) -> float:
        return self.kv_used_tokens / self.kv_total_tokens

    @property
    def cache_hit_rate(self) -> float:
        c = self.counters
        return c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0


class _Block:
    __slots__ = ("key", "parent", "children", "refs", "last_use")

    def __init__(self, key: int, parent: "_Block | None", now: float):
        self.key, self.parent, self.children, self.refs, self.last_use = key, parent, 0, 1, now


class PrefixCache:
    """Radix tree of token blocks keyed by chained hashes; LRU eviction of unreferenced leaves."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._blocks: dict[int, _Block] = {}
        self._referenced = 0  # blocks with refs > 0
        self._lru: list[tuple[float, int, _Block]] = []  # eviction candidates, lazily pruned
        self._tie = itertools.count()

    @property
    def size_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    @property
    def referenced_tokens(self) -> int:
        return self._referenced * self.block_size

    def block_keys(self, tokens: list[int], start_keys: list[int], n_blocks: int, root: int = 0) -> list[int]:
        """Extend `start_keys` (keys of the first blocks) to `n_blocks` chained keys; `root`
        seeds the chain (an adapter's own, so its blocks never match another's)."""
        keys, b = start_keys, self.block_size
        parent = keys[-1] if keys else root
        for i in range(len(keys), n_blocks):
            parent = hash((parent, tuple(tokens[i * b:(i + 1) * b])))
            keys.append(parent)
        return keys

    def match(self, keys: list[int]) -> list[_Block]:
        found = []
        for k in keys:
            block = self._blocks.get(k)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, blocks: list[_Block], now: float) -> None:
        for b in blocks:
            if b.refs == 0:
                self._referenced += 1
            b.refs += 1
            b.last_use = now

    def release(self, blocks: list[_Block], now: float) -> None:
        for b in reversed(blocks):
            b.refs -= 1
            b.last_use = now
            if b.refs == 0:
                self._referenced -= 1
                if b.children == 0:
                    heapq.heappush(self._lru, (now, next(self._tie), b))

    def insert(self, parent: _Block | None, key: int, now: float) -> tuple[_Block, bool]:
        """The referenced block for `key` under `parent`; True if it was created."""
        block = self._blocks.get(key)
        if block is not None:
            self.acquire([block], now)
            return block, False
        block = self._blocks[key] = _Block(key, parent, now)
        self._referenced += 1
        if parent is not None:
            parent.children += 1
        return block, True

    def evict(self, tokens: int) -> int:
        """Evict least recently used unreferenced leaves until `tokens` are freed (or none left)."""
        freed = 0
        while freed < tokens and self._lru:
            last_use, _, b = heapq.heappop(self._lru)
            if (self._blocks.get(b.key) is not b or b.refs or b.children
                    or b.last_use != last_use):
                continue  # stale entry: reused, re-pushed later, or already gone
            del self._blocks[b.key]
            freed += self.block_size
            parent = b.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.refs == 0:
                    heapq.heappush(self._lru, (parent.last_use, next(self._tie), parent))
        if len(self._lru) > 4 * len(self._blocks) + 1024:
            self._lru = [e for e in self._lru if self._blocks.get(e[2].key) is e[2]
                         and not e[2].refs and not e[2].children and e[2].last_use == e[0]]
            heapq.heapify(self._lru)
        return freed

    def clear(self) -> None:
        assert self._referenced == 0, "clear() with referenced blocks"
        self._blocks.clear()
        self._lru.clear()


class _Seq:
    """Engine-side state of one request."""

    __slots__ = ("req", "no", "tokens", "prompt_len", "target", "rng", "keys", "blocks",
                 "private", "computed", "prefill_end", "admit_no", "cached_tokens", "admitted",
                 "cached_at_submit", "fresh", "readmitted", "submitted_at")

    def __init__(self, req: EngineRequest, no: int, target: int, rng: random.Random):
        self.req, self.no, self.target, self.rng = req, no, target, rng
        # a unique prompt's ids are never read: placeholders keep the lengths right
        self.tokens = [0] * len(req.prompt_tokens) if req.unique_prompt else list(req.prompt_tokens)
        self.prompt_len = len(self.tokens)
        self.keys: list[int] = []  # chained block keys of `tokens`, extended lazily
        self.blocks: list[_Block] = []  # cache blocks this request references
        self.private = 0  # KV tokens held outside the cache
        self.computed = 0  # tokens whose KV exists
        self.prefill_end = 0  # `computed` at which this admission's prefill is done
        self.admit_no = 0
        self.cached_tokens = 0
        self.admitted = False  # ever admitted (counters and cached_tokens count once)
        self.readmitted = False  # admitted again after a preemption
        self.fresh = False  # admitted, its prefill not started: looks the cache up again
        self.cached_at_submit = 0  # prompt tokens the cache held when the request arrived
        self.submitted_at = 0.0

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.prompt_len


class Engine:
    def __init__(self, profile: Profile, seed: int = 0, token_ids: bool = True):
        if profile.max_running is not None and profile.max_running < 1:
            raise ValueError("max_running must be at least 1 (or None for no cap)")
        if profile.kv_tokens < profile.block_size or profile.prefill_budget < 1:
            raise ValueError("kv_tokens must hold a block and prefill_budget must be positive")
        self.profile = profile
        self.seed = seed
        self.token_ids = token_ids
        self.cache = PrefixCache(profile.block_size)
        self.counters = Counters()
        self._waiting: list[_Seq] = []  # sorted by (-priority, arrival order)
        self._running: list[_Seq] = []  # in admission order
        self._by_id: dict[str, _Seq] = {}
        self._private = 0  # Σ seq.private
        self._order = itertools.count()
        self._busy_until = -math.inf
        self._firsts: tuple[float, list[float]] = (0.0, [])  # (end, TTFTs) of the last step's first tokens
        r = profile.new_token_ratio
        self._ratio_init = r[0] if r else 0.0
        self._ratio_min = r[0] * r[1] if r else 0.0
        self._ratio_decay = (r[0] - r[0] * r[1]) / r[2] if r else 0.0
        self.new_token_ratio = self._ratio_init

    # ---- requests in and out -------------------------------------------------------------

    def max_request_tokens(self) -> int:
        return min(self.profile.max_model_len, self.profile.kv_tokens)

    def submit(self, req: EngineRequest, now: float) -> None:
        if req.id in self._by_id:
            raise ValueError(f"duplicate request id {req.id!r}")
        if not req.prompt_tokens:
            raise ValueError("empty prompt")
        if req.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        limit = self.max_request_tokens()
        if len(req.prompt_tokens) + req.max_new_tokens > limit:
            raise ValueError(f"prompt ({len(req.prompt_tokens)} tokens) + max_new_tokens "
                             f"({req.max_new_tokens}) exceeds the context limit of {limit}")
        # the per-request draws (output length, token ids), seeded by the prompt; unused when
        # neither is drawn (the simulator), and hashing a long prompt is not free
        draw = (self.seed, tuple(req.prompt_tokens)) if req.sample_key is None else \
            (self.seed, tuple(req.prompt_tokens), req.sample_key)
        rng = random.Random(hash(draw)) if self.token_ids or not (req.ignore_eos or req.min_new_tokens) else None
        if req.ignore_eos:
            target = req.max_new_tokens
        elif req.min_new_tokens:
            target = min(req.max_new_tokens, req.min_new_tokens)
        else:
            p = self.profile
            drawn = round(rng.lognormvariate(math.log(p.output_median), p.output_sigma))
            target = max(1, min(req.max_new_tokens, drawn))
        seq = _Seq(req, next(self._order), target, rng)
        seq.submitted_at = now
        b = self.profile.block_size
        seq.keys = self._keys(seq, (len(seq.tokens) - 1) // b)
        seq.cached_at_submit = len(self.cache.match(seq.keys)) * b
        self._by_id[req.id] = seq
        self._enqueue(seq)
        self._admit(now)  # a request that fits is running at once: waiting means "no room"

    def abort(self, request_id: str, now: float) -> bool:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return False
        if seq in self._running:
            self._running.remove(seq)
            self._release(seq, now)
        else:
            self._waiting.remove(seq)
        self.counters.aborted += 1
        self._admit(now)
        return True

    def flush_cache(self) -> bool:
        if self._by_id:
            return False
        self.cache.clear()
        return True

    # ---- time ----------------------------------------------------------------------------

    def next_event_time(self, now: float) -> float | None:
        if not self._running and not self._waiting:
            return None
        return max(now, self._busy_until)

    def first_tokens_by(self, t: float) -> int:
        """The first tokens the engine has produced by `t` (its TTFT histogram's count then)."""
        end, pending = self._firsts
        if pending and t >= end:
            self._commit_first_tokens()
        return self.counters.ttfts

    def _commit_first_tokens(self) -> None:
        for ttft in self._firsts[1]:
            self.counters.count_first_token(ttft)
        self._firsts = (0.0, [])

    def step(self, now: float) -> StepResult:
        self._admit(now)
        result = StepResult(start=now, duration=0.0)
        if not self._running:
            assert not self._waiting, "a waiting request cannot be admitted into an empty engine"
            return result
        sglang = self.profile.new_token_ratio is not None
        while True:
            decodes, chunks, emitting = self._plan()
            if emitting <= self._free() and not (
                    sglang and result.preempted and len(self._running) > 1
                    and self._free() < RETRACT_DECODE_STEPS * len(self._running)):
                break
            victim = self._victim()
            self._preempt(victim, now)
            result.preempted.append(victim.req.id)
        if sglang:
            self._update_ratio(bool(result.preempted), bool(decodes))
        self._allocate(emitting)
        p = self.profile
        context = prefilled = 0
        firsts = []  # requests whose first token this step emits
        for seq, n, shared in chunks:
            if seq.fresh:
                self._take_shared(seq, shared, now)
            seq.computed += n
            prefilled += n
            context += seq.computed
            self._cache_blocks(seq, now)  # as scheduled: later requests find them
            if seq.computed == seq.prefill_end:
                if not seq.output_len:  # not one recomputing after a preemption
                    firsts.append(seq)
                self._emit(seq, result, now)
        for seq in decodes:
            context += seq.computed
            self._emit(seq, result, now)
        result.prefill_tokens = prefilled
        result.decode_seqs = len(decodes)
        if decodes:
            self.counters.count_decode_batches(1)
        result.duration = (p.step_base_s + p.prefill_token_s * result.prefill_tokens
                           + p.decode_seq_s * len(decodes) + p.context_token_s * context)
        # their tokens come out as the step ends: counted then (`first_tokens_by`), as an
        # engine's metrics count a first token once the step that made it has returned
        self._commit_first_tokens()
        self._firsts = (result.end, [result.end - seq.submitted_at for seq in firsts])
        self._busy_until = result.end
        return result

    # ---- observation ---------------------------------------------------------------------

    def load(self) -> EngineLoad:
        return EngineLoad(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_used_tokens=self._used(),
            kv_total_tokens=self.profile.kv_tokens,
            cache_tokens=self.cache.size_tokens,
            waiting_prompt_tokens=sum(len(s.tokens) for s in self._waiting),
            max_running=self.profile.max_running,
            counters=replace(self.counters, ttft_buckets=list(self.counters.ttft_buckets)),
            running_adapters=_adapters(self._running),
            waiting_adapters=_adapters(self._waiting),
            max_loras=self.profile.max_loras,
        )

    def adapters(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The LoRA adapters of the running and of the waiting requests."""
        return _adapters(self._running), _adapters(self._waiting)

    def is_waiting(self, request_id: str) -> bool:
        seq = self._by_id.get(request_id)
        return seq is not None and seq in self._waiting

    # ---- internals -----------------------------------------------------------------------

    def _keys(self, seq: _Seq, n_blocks: int) -> list[int]:
        """`seq`'s first `n_blocks` block keys (extending the ones it has)."""
        if not seq.req.unique_prompt:
            adapter = seq.req.adapter
            return self.cache.block_keys(seq.tokens, seq.keys, n_blocks, hash(("lora", adapter)) if adapter else 0)
        keys = seq.keys  # (request number, block number): unique in this engine
        for i in range(len(keys), n_blocks):
            keys.append(hash((-1, seq.no, i)))
        return keys

    def _used(self) -> int:
        return self.cache.referenced_tokens + self._private

    def _free(self) -> int:
        return self.profile.kv_tokens - self._used()

    def _reservation(self, seq: _Seq) -> int:
        """KV held back for `seq`'s coming tokens: at least the next one, as vLLM schedules
        running requests' next slots before admitting new ones."""
        return max(1, min(self.profile.decode_reserve, seq.req.max_new_tokens) - seq.output_len)

    def _victim(self) -> _Seq:
        """Who gives its KV back when a step does not fit: the lowest priority first, then
        vLLM's newest admission, or SGLang's `retract_decode` order (fewest output tokens,
        the longest prompt among those)."""
        if self.profile.new_token_ratio is not None:
            return max(self._running, key=lambda s: (-s.req.priority, -s.output_len, s.prompt_len, s.admit_no))
        return max(self._running, key=lambda s: (-s.req.priority, s.admit_no))

    def _update_ratio(self, retracted: bool, decoded: bool) -> None:
        """SGLang's new-token ratio after a step: up to what the running requests actually
        need after a retraction (schedule_batch.py `retract_decode`), else one decay step
        per decode step (scheduler.py `update_running_batch`)."""
        if retracted and self._running:
            decoded_tokens = sum(s.output_len for s in self._running)
            max_new = sum(s.req.max_new_tokens for s in self._running)
            self.new_token_ratio = min(1.0, (decoded_tokens + RETRACT_DECODE_STEPS * len(self._running))
                                       / (max_new + 1))
        elif decoded:
            self.new_token_ratio = max(self._ratio_min, self.new_token_ratio - self._ratio_decay)

    def _remaining_new(self, seq: _Seq) -> int:
        return max(0, min(seq.req.max_new_tokens - seq.output_len, CLIP_MAX_NEW_TOKENS))

    def _admission_order(self) -> list[_Seq]:
        """The waiting queue in the order admission tries it: arrival order (within
        priority), or SGLang's LPM (longest cached prefix first) while at most 128 wait."""
        if self.profile.waiting_order != "lpm" or not 1 < len(self._waiting) <= LPM_MAX_QUEUE:
            return self._waiting
        b = self.profile.block_size
        for seq in self._waiting:
            seq.keys = self._keys(seq, (len(seq.tokens) - 1) // b)
        return sorted(self._waiting, key=lambda s: (-s.req.priority, -len(self.cache.match(s.keys)), s.no))

    def _enqueue(self, seq: _Seq) -> None:
        bisect.insort(self._waiting, seq, key=lambda s: (-s.req.priority, s.no))

    def _allocate(self, tokens: int) -> None:
        """Take `tokens` of KV outside the cache, evicting unreferenced cache blocks if needed."""
        short = tokens - (self.profile.kv_tokens - self.cache.size_tokens - self._private)
        if short > 0:
            self.counters.evicted_tokens += self.cache.evict(short)
        assert self.cache.size_tokens + self._private + tokens <= self.profile.kv_tokens
        self._private += tokens

    def _admit(self, now: float) -> None:
        if not self._waiting:  # the common case, called every step: skip the reservation sum
            return
        p, b = self.profile, self.profile.block_size
        sglang = p.new_token_ratio is not None
        if sglang:
            if not self._running:  # scheduler.py self_check_during_idle: reset when idle
                self.new_token_ratio = self._ratio_init
            ratio = self.new_token_ratio
            reserved = sum(self._remaining_new(s) * ratio for s in self._running)
        else:
            r = p.decode_reserve  # Σ _reservation, inlined: this runs every step while any wait
            reserved = sum(max(1, min(r, s.req.max_new_tokens) - len(s.tokens) + s.prompt_len) for s in self._running)
        order = self._admission_order()  # self._waiting itself, or a sorted copy
        budget = self._budget_left() if p.admit_within_budget else None
        adapters = {s.req.adapter for s in self._running if s.req.adapter} if p.max_loras is not None else None
        i = 0
        while i < len(order) and (p.max_running is None or len(self._running) < p.max_running):
            if budget is not None and budget <= 0:
                break
            seq = order[i]
            adapter = seq.req.adapter
            if adapters is not None and adapter and adapter not in adapters:
                if len(adapters) >= p.max_loras:
                    i += 1  # one adapter too many for this batch: skipped, the queue goes on
                    continue
            # leave at least the last token to compute: the engine needs its logits
            seq.keys = self._keys(seq, (len(seq.tokens) - 1) // b)
            matched = self.cache.match(seq.keys)
            cached = len(matched) * b
            reactivated = b * sum(1 for blk in matched if blk.refs == 0)
            uncached = len(seq.tokens) - cached + reactivated
            if sglang:
                # add_one_req: the whole remaining output must fit now; reserve ratio × it after
                remaining = self._remaining_new(seq)
                if uncached + max(1, remaining) >= self._free() - reserved:
                    break
                reservation = remaining * ratio
            else:
                reservation = self._reservation(seq)
                if uncached + reservation > self._free() - reserved:
                    break
            if order is self._waiting:
                order.pop(i)
            else:
                self._waiting.remove(seq)
                i += 1
            if budget is not None:
                budget -= uncached
            self.cache.acquire(matched, now)
            seq.blocks = matched
            seq.computed = cached
            seq.prefill_end = len(seq.tokens)
            seq.private = len(seq.tokens) - cached
            self._allocate(seq.private)
            seq.admit_no = next(self._order)
            seq.fresh = True
            self._running.append(seq)
            if adapters is not None and adapter:
                adapters.add(adapter)
            reserved += reservation
            if seq.admitted:
                seq.readmitted = True
            else:
                seq.admitted = True
                seq.cached_tokens = cached
                c = self.counters
                c.prompt_tokens += seq.prompt_len
                c.cached_tokens += cached
                c.prefix_queries += seq.prompt_len
                c.prefix_hits += cached
                c.lost_while_waiting += max(0, seq.cached_at_submit - cached)

    def _budget_left(self) -> int:
        """The step's tokens the running requests leave for new ones: one per decode, the
        rest of each unfinished prefill (as `_plan` hands them out)."""
        left = self.profile.prefill_budget
        for seq in self._running:
            left -= 1 if seq.computed >= seq.prefill_end else seq.prefill_end - seq.computed
            if left <= 0:
                return 0
        return left

    def _shareable(self, seq: _Seq, scheduled: set[int]) -> int:
        """How many blocks past those it holds a request whose prefill starts this step finds
        computed by then: in the cache and referenced (so not evictable before it takes them),
        or scheduled by an earlier chunk of this step. vLLM v1 puts a chunk's full blocks in
        the prefix cache when it schedules the chunk (kv_cache_manager.py `allocate_slots` →
        `cache_blocks`, keyed by token ids, before the forward pass), so a request scheduled
        after it finds them (each layer writes the batch's KV before its attention reads it).
        SGLang gets the same sharing a step later: LPM defers a waiting request whose prefix
        an earlier one in the batch is computing (schedule_policy.py, in-batch prefix
        caching), then it hits the radix cache. Without this, siblings sent at once (a tree's
        branches) each recomputed their shared prefix."""
        blocks, keys = self.cache._blocks, seq.keys
        i = have = len(seq.blocks)
        while i < len(keys):
            block = blocks.get(keys[i])
            if not ((block is not None and block.refs) or keys[i] in scheduled):
                break
            i += 1
        return i - have

    def _take_shared(self, seq: _Seq, n_blocks: int, now: float) -> None:
        """The blocks `_shareable` counted (earlier chunks of this step have cached them)."""
        seq.fresh = False
        if not n_blocks:
            return
        have = len(seq.blocks)
        gained = self.cache.match(seq.keys[:have + n_blocks])[have:]
        assert len(gained) == n_blocks, "a block counted as shared is not in the cache"
        self.cache.acquire(gained, now)
        seq.blocks.extend(gained)
        tokens = n_blocks * self.block_size
        seq.private -= tokens
        self._private -= tokens
        seq.computed += tokens
        if not seq.readmitted:
            seq.cached_tokens += tokens
            c = self.counters
            c.cached_tokens += tokens
            c.prefix_hits += tokens

    def _plan(self) -> tuple[list[_Seq], list[tuple[_Seq, int, int]], int]:
        """This step's decoding sequences, prefill chunks (request, tokens, blocks it shares
        from earlier chunks), and how many tokens it emits."""
        decodes = [s for s in self._running if s.computed >= s.prefill_end]
        budget = max(0, self.profile.prefill_budget - len(decodes))
        chunks, emitting = [], len(decodes)
        # keys of the blocks this step's chunks compute, while a request starting its prefill
        # could share them (see `_shareable`)
        scheduled: set[int] | None = set() if any(s.fresh for s in self._running) else None
        b = self.block_size
        for seq in self._running:
            if budget == 0:
                break
            if seq.computed < seq.prefill_end:
                shared = self._shareable(seq, scheduled) if seq.fresh else 0
                start = seq.computed + shared * b
                n = min(budget, seq.prefill_end - start)
                chunks.append((seq, n, shared))
                budget -= n
                emitting += start + n == seq.prefill_end
                if scheduled is not None:
                    scheduled.update(self._keys(seq, (start + n) // b))
        return decodes, chunks, emitting

    def _emit(self, seq: _Seq, result: StepResult, now: float) -> None:
        key = seq.req.sample_key
        token = (OUTPUT_IDS[seq.rng.randrange(len(OUTPUT_IDS))] if self.token_ids
                 else FIXED_TOKEN if key is None else ANSWERS[_answer_at(key, seq.output_len)])
        seq.tokens.append(token)
        seq.private += 1
        seq.computed = n = len(seq.tokens)
        self.counters.generation_tokens += 1
        result.tokens[seq.req.id] = token
        if n - seq.prompt_len >= seq.target:
            self._running.remove(seq)
            del self._by_id[seq.req.id]
            self._release(seq, now)
            self.counters.requests += 1
            reason = "length" if seq.output_len >= seq.req.max_new_tokens else "stop"
            result.finished.append(Finished(seq.req.id, reason, seq.prompt_len,
                                            seq.cached_tokens, seq.output_len))

    def _cache_blocks(self, seq: _Seq, now: float) -> None:
        """Move the full blocks of what `seq` has computed into the prefix cache."""
        b = self.block_size
        n_full = seq.computed // b
        seq.keys = self._keys(seq, n_full)
        for i in range(len(seq.blocks), n_full):
            parent = seq.blocks[-1] if seq.blocks else None
            block, _ = self.cache.insert(parent, seq.keys[i], now)
            seq.blocks.append(block)
            # created: our tokens now live in the cache; found: ours were a duplicate, freed
            seq.private -= b
            self._private -= b

    @property
    def block_size(self) -> int:
        return self.profile.block_size

    def _release(self, seq: _Seq, now: float) -> None:
        self._cache_blocks(seq, now)
        self.cache.release(seq.blocks, now)
        self._private -= seq.private
        seq.blocks, seq.private, seq.computed = [], 0, 0

    def _preempt(self, seq: _Seq, now: float) -> None:
        self._running.remove(seq)
        self._release(seq, now)
        self._enqueue(seq)
        self.counters.preemptions += 1
        self.counters.preempted_since_log += 1


def _adapters(seqs: list[_Seq]) -> tuple[str, ...]:
    return tuple(sorted({s.req.adapter for s in seqs if s.req.adapter}))
