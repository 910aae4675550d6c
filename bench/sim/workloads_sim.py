"""The proving ground's workloads: fleet shape, client model and run length, by name.

`WORKLOADS` is the registry (`register` adds one; `lb-bench sim-compare --list` prints it).
A workload offers load in one of two ways, both scaled to a share of the fleet's capacity:
- `programs`: closed-loop programs of a live workload (bench/workloads) arriving as a
  Poisson stream per region (`rate = load × capacity / requests per program`);
- `replay`: an open-loop trace, its arrival times compressed or stretched so the mean rate
  is `load × capacity`.
Capacity (requests/s the fleet completes when saturated) is measured in the simulator by
`saturate`: the same request mix from enough closed-loop clients to keep every replica's
batch full, behind `lb`'s default configuration.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

from bench import traces
from bench.profiles import PROFILES, on_sglang
from bench.sim.arena import Arena, Call, FleetSpec, RegionSpec
from bench.sim.clients import Programs, Replay, Surge, Timed
from bench.workloads import long_short, make_workload, random_dataset
from bench.workloads.agent import Agent
from bench.workloads.base import rng_for
from bench.workloads.best_of_n import BestOfN
from bench.workloads.multi_lora import MAX_LORAS, MultiLora, adapter_name
from bench.workloads.reasoning import Reasoning
from bench.workloads.servegen import ServeGen, labelled, tenant_arrivals

ONE_REGION = FleetSpec((RegionSpec("local", 4),))
# SkyWalker's inter-region one-way latencies; clients skewed 2:1:1 as its 40/20/20.
SKYWALKER_MS = {"us-eu": 40.0, "us-asia": 80.0, "eu-asia": 90.0}
THREE_REGIONS = FleetSpec((RegionSpec("us", 2, weight=2.0), RegionSpec("eu", 2), RegionSpec("asia", 2)),
                          latency_ms=SKYWALKER_MS)
HETEROGENEOUS = FleetSpec((RegionSpec("local", 4, slow_replicas=2),), slow_factor=2.0)


@dataclass
class Workload:
    name: str
    description: str
    fleet: FleetSpec
    kind: str  # "programs" | "replay"
    duration_s: float = 300.0
    quick_duration_s: float = 150.0
    program: dict = field(default_factory=dict)  # programs: bench.workloads name + params
    requests_per_program: float = 1.0
    calls: Callable[[int], Iterator[Timed]] | None = None  # replay: seed -> unscaled timed calls
    natural_rps: Callable[[], float] | None = None  # replay: the trace's own mean rate
    # a workload with its own systems and columns (fairness): runs the whole command itself
    runner: Callable[[object], int] | None = None

    def make_program_workload(self, seed: int):
        params = dict(self.program)
        return make_workload(params.pop("workload"), seed=seed, **params)

    def drive(self, arena: Arena, *, seed: int, rate_rps: float, stop_at: float, surge: Surge | None = None) -> object:
        """Offer `rate_rps` requests per second to `arena` until `stop_at` (`surge`'s factor times
        that inside its window)."""
        fleet = self.fleet
        total = sum(r.weight for r in fleet.regions)
        if self.kind == "programs":
            programs = Programs(arena, self.make_program_workload(seed), stop_at=stop_at)
            per_program = rate_rps / self.requests_per_program
            programs.arrivals({r.name: per_program * r.weight / total for r in fleet.regions}, seed, surge)
            return programs
        scale = self.natural_rps() / rate_rps  # trace seconds per simulated second
        warp = Surge.warp_of(surge)
        scaled = (Timed(warp(t.at * scale), t.call) for t in self.calls(seed))
        return Replay(arena, scaled, stop_at=stop_at)

    def saturate(self, arena: Arena, *, seed: int, stop_at: float, per_replica: int | None = None) -> None:
        """Closed-loop clients to keep every replica full (for `capacity`): `per_replica` of
        them a replica (the kind's default when None)."""
        regions = [r.name for r in self.fleet.regions]
        if self.kind == "programs":
            clients = (per_replica or PROGRAMS_PER_REPLICA[0]) * self.fleet.replicas
            programs = Programs(arena, self.make_program_workload(seed), stop_at=stop_at)
            programs.clients({name: clients // len(regions) for name in regions})
            return
        clients = (per_replica or REPLAY_CLIENTS_PER_REPLICA[0]) * self.fleet.replicas
        calls = self.calls(seed)

        def next_call(_done=None) -> None:
            if arena.loop.now >= stop_at:
                return
            item = next(calls, None)
            if item is not None:
                arena.send(item.call, next_call)

        for _ in range(clients):
            next_call()


# Closed-loop clients a replica when capacity is measured: the fleet's capacity is the most it
# completes over these counts. Too few leave room (a replayed call keeps one request in flight,
# and short calls fit many to a replica's KV; a conversation keeps one too), too many thrash the
# caches. Measured (one seed x 300 s, req/s for 24 / 48 / 96 a replica): bursty tenants 6.54 /
# 8.18 / 8.26 (192: 8.36), shared-prefix 3.24 / 3.44 / 3.43, doc-qa 4.08 / 4.49 / 4.49;
# multi-turn 10.40 / 17.24 / 16.47, heterogeneous 36.35 / 44.00 / 33.68, ToT 49.27 / 50.77,
# three regions 72.07 / 78.75, Mixed Tree 60.2 / 53.23. Until 2026-11-27 only 24 was tried, and
# multi-turn's "1.3x" was ~0.8x its peak.
PROGRAMS_PER_REPLICA = (24, 48, 96)
REPLAY_CLIENTS_PER_REPLICA = (64,)

WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    WORKLOADS[workload.name] = workload
    return workload


# The engines a workload's replicas run, each the same hardware (the fleet's profile) under
# another scheduler: vLLM's (it admits by prompt blocks and preempts the newest), SGLang's as
# it ships today (arrival order, a new-token-ratio reservation, retraction) and SGLang with
# `--schedule-policy lpm` (its waiting queue longest cached prefix first: the default of older
# releases). Operators run any of them; a policy has to win on each.
ENGINES = {"vllm": "", "sglang": "-sglang-fcfs", "sglang-lpm": "-sglang"}
# A fleet of both: every second replica of each region on SGLang's scheduler as it ships, the
# rest on vLLM's (`FleetSpec.alt_profile`). Replicas that differ in kind, not only in speed:
# what `lb` knows of each it learns online, and no setting names the engine.
MIXED = "mixed"


def get(name: str) -> Workload:
    """A workload by name; "NAME*K" is NAME on a fleet K times larger (`scaled`), and a suffix
    "@sglang" the same on SGLang's scheduler (`on_engine`)."""
    name, at, engine = name.partition("@")
    if at and engine not in ENGINES and engine != MIXED:
        raise ValueError(f"{name}@{engine!r}: the engine after '@' is one of {', '.join([*ENGINES, MIXED])}, "
                         f"e.g. {name}@sglang")
    base, star, times = name.partition("*")
    if base not in WORKLOADS:
        raise ValueError(f"unknown workload {base!r}; choose from {', '.join(WORKLOADS)} (lb-bench sim-compare --list)")
    w = WORKLOADS[base]
    if star:
        if not times.isdigit() or int(times) < 1:
            raise ValueError(f"{name!r}: the fleet's scale after '*' must be a whole number >= 1, e.g. {base}*4")
        w = scaled(w, int(times))
    return on_engine(w, engine) if at else w


def on_engine(w: Workload, engine: str) -> Workload:
    """`w` with every replica on `engine`'s scheduler (`ENGINES`), the same hardware; `MIXED`:
    every second replica on SGLang's."""
    if engine == MIXED:
        try:
            alt = on_sglang(w.fleet.profile)
        except ValueError as e:
            raise ValueError(f"{w.name}@{engine}: {e}") from None
        return dataclasses.replace(w, name=f"{w.name}@{engine}", fleet=dataclasses.replace(w.fleet, alt_profile=alt),
                                   description=f"{w.description}; every second replica on SGLang's scheduler, "
                                               "the rest on vLLM's")
    if not ENGINES[engine]:
        return w
    profile = f"{w.fleet.profile}{ENGINES[engine]}"
    if profile not in PROFILES:
        raise ValueError(f"{w.name}@{engine}: no {engine} profile of {w.fleet.profile} (bench/profiles.py)")
    return dataclasses.replace(w, name=f"{w.name}@{engine}", fleet=dataclasses.replace(w.fleet, profile=profile),
                               description=f"{w.description}; on {engine}'s scheduler")


def scaled(w: Workload, k: int) -> Workload:
    """`w` on a fleet `k` times larger: every region (and its slow replicas) k times over, the
    same engines, latencies and client model. Load is a share of the capacity measured on that
    fleet, so arrivals scale with it. A fleet of 4 is no operator's fleet: a policy that wins
    there has to keep winning when a fan-out can spread over 16 replicas and every decision
    scores four times as many."""
    if k == 1:
        return w
    regions = tuple(dataclasses.replace(r, replicas=r.replicas * k, slow_replicas=r.slow_replicas * k)
                    for r in w.fleet.regions)
    return dataclasses.replace(w, name=f"{w.name}*{k}", fleet=dataclasses.replace(w.fleet, regions=regions),
                               description=f"{w.description}; the fleet x{k} ({sum(r.replicas for r in regions)} replicas)")


# -- open-loop traces ---------------------------------------------------------------------
MOONCAKE_SIZE_SCALE = 0.25  # as compare-mooncake: 128-token blocks, contexts clipped to 2,048
MOONCAKE_MAX_INPUT = 2048


def mooncake_calls(seed: int) -> Iterator[Timed]:
    """Mooncake's conversation trace: equal hash ids are equal token blocks (prefixes kept).
    Each seed starts at its own point of the trace (so seeds see different stretches of it)
    and the replay wraps around at the end, so a run never runs out of requests."""
    block = max(1, round(traces.MOONCAKE_BLOCK_TOKENS * MOONCAKE_SIZE_SCALE))
    rows = traces.mooncake_conversation()
    t0, span = rows[0].t, rows[-1].t - rows[0].t + 1.0
    start = (seed * 0.3819660112501051 % 1.0) * span  # golden-ratio steps: seeds spread over the trace
    order = sorted(range(len(rows)), key=lambda i: (rows[i].t - t0 - start) % span)
    for lap in itertools.count():
        for i in order:
            row = rows[i]
            at = lap * span + (row.t - t0 - start) % span
            n = min(MOONCAKE_MAX_INPUT, max(1, round(row.input_length * MOONCAKE_SIZE_SCALE)))
            tokens: list[int] = []
            for h in row.hash_ids:
                if len(tokens) >= n:
                    break
                tokens.extend(range((h + 1) << 20, ((h + 1) << 20) + block))
            yield Timed(at, Call(f"mooncake-{lap}-{i}", "local", tokens[:n],
                                 max(1, round(row.output_length * MOONCAKE_SIZE_SCALE)), user="mooncake",
                                 app="mooncake"))


@functools.cache
def _mooncake_rps() -> float:
    rows = traces.mooncake_conversation()
    return len(rows) / max(1e-9, rows[-1].t - rows[0].t)


BURSTY_TENANTS = 8
BURSTY_SIZE_SCALE = 0.5  # Azure conversation shapes, halved to fit the L4's 8k context with room


def bursty_calls(seed: int) -> Iterator[Timed]:
    """ServeGen's busiest tenants at noon (Gamma/Weibull inter-arrivals with the trace's own
    CVs, per 10-minute window), each request an Azure conversation shape; 1 req/s in all
    before scaling. Prompts are unique (no shared prefixes)."""
    sg = ServeGen(seed=seed, tenants=BURSTY_TENANTS, total_rps=1.0)
    chosen = sg.chosen()
    total = sum(next((w.rate for w in ws if w.start <= sg.start < w.start + traces.SERVEGEN_WINDOW_S), 0.0)
                for ws in chosen.values())
    factor = 1.0 / total if total > 0 else 0.0
    streams = [labelled(c, tenant_arrivals(ws, sg.start, factor, rng_for(seed, "bursty", c)))
               for c, ws in chosen.items()]
    sizes = traces.azure_conv()
    size_rng = rng_for(seed, "bursty", "sizes")
    for i, (t, client) in enumerate(heapq.merge(*streams)):
        row = size_rng.choice(sizes)
        n = max(1, round(row.context_tokens * BURSTY_SIZE_SCALE))
        base = (i + 1) << 24
        yield Timed(t, Call(f"bursty-{i}", "local", list(range(base, base + n)),
                            max(1, round(row.generated_tokens * BURSTY_SIZE_SCALE)), user=f"sg-{client}"))


# SGLang's own shared-prefix benchmark (`python -m sglang.bench_serving --dataset-name
# generated-shared-prefix`), at its defaults: 64 system prompts of 2,048 tokens, a 128-token
# question after one of them, 256-token answers, Poisson arrivals. The workload prefix-aware
# routers are tuned on, added after the policy was settled, so it is held out: nothing in `lb`
# was chosen on it. Its 131k tokens of system prompts fill the 4 replicas' KV (32k each) even
# if every prompt is kept on one replica only.
SHARED_PREFIX_GROUPS = 64
SHARED_PREFIX_SYSTEM_TOKENS = 2048
SHARED_PREFIX_QUESTION_TOKENS = 128
SHARED_PREFIX_OUTPUT_TOKENS = 256


def prefixed_calls(seed: int, name: str, ids: str, lengths: list[int], weights: list[float] | None,
                   question_tokens: int, output_tokens: int) -> Iterator[Timed]:
    """A Poisson stream at 1 req/s before scaling; each request one shared prefix (prefix `k`
    is `lengths[k]` tokens, drawn by `weights`, uniformly when None) and a question of its own."""
    rng = rng_for(seed, name)
    choices = range(len(lengths))
    t = 0.0
    for i in itertools.count():
        t += rng.expovariate(1.0)
        k = rng.randrange(len(lengths)) if weights is None else rng.choices(choices, weights)[0]
        yield Timed(t, Call(f"{ids}-{i}", "local", prefixed_prompt(k, lengths[k], i, question_tokens),
                            output_tokens, app=name))


def prefixed_prompt(k: int, prefix_tokens: int, i: int, question_tokens: int, question_shift: int = 12) -> list[int]:
    """Request `i`'s prompt as token ids: shared prefix `k`, then a question of its own (each
    prefix and each question one range of ids, apart from all the others)."""
    prefix = (1 << 48) + (k << 20)
    question = (i + 1) << question_shift
    return [*range(prefix, prefix + prefix_tokens), *range(question, question + question_tokens)]


def own_prompt(space: int, i: int, tokens: int) -> list[int]:
    """Request `i`'s prompt of `tokens` ids that no other request shares a block of (`space`
    keeps one workload's prompts apart from another's and from the shared prefixes')."""
    start = (space << 48) + (i << 16)
    return list(range(start, start + tokens))


def shared_prefix_calls(seed: int) -> Iterator[Timed]:
    """Each request one of the 64 system prompts, uniformly (as the benchmark's shuffled 64 x 16
    prompts), and a question of its own."""
    return prefixed_calls(seed, "shared-prefix", "gsp", [SHARED_PREFIX_SYSTEM_TOKENS] * SHARED_PREFIX_GROUPS, None,
                          SHARED_PREFIX_QUESTION_TOKENS, SHARED_PREFIX_OUTPUT_TOKENS)


# Questions over documents: 200 documents of 1,000-4,000 tokens (fixed per document), each
# request one of them, Zipf-popular (weight 1/rank), and a 64-token question; 128-token answers,
# Poisson arrivals. Synthetic, added after the KV-bounded trie to check it beyond SGLang's
# benchmark: a few documents are hot, most are cold, and all of them together are ~16x what
# the fleet caches.
DOC_QA_DOCUMENTS = 200
DOC_QA_TOKENS = (1000, 4000)
DOC_QA_QUESTION_TOKENS = 64
DOC_QA_OUTPUT_TOKENS = 128


def doc_qa_calls(seed: int) -> Iterator[Timed]:
    sizes = rng_for(0, "doc-qa", "sizes")  # the same documents for every seed
    lengths = [sizes.randint(*DOC_QA_TOKENS) for _ in range(DOC_QA_DOCUMENTS)]
    weights = [1.0 / rank for rank in range(1, DOC_QA_DOCUMENTS + 1)]
    return prefixed_calls(seed, "doc-qa", "docqa", lengths, weights, DOC_QA_QUESTION_TOKENS, DOC_QA_OUTPUT_TOKENS)


# Apps whose popularity moves: 32 system prompts of 1,200 tokens (38k tokens together: more
# than one replica's KV, a third of the fleet's), each request one of them, Zipf-popular (weight
# 1/rank), and a 96-token question; 160-token answers, Poisson arrivals. Every 500 requests the
# ranking is drawn again, so the app that was hot turns cold and a cold one turns hot: a launch,
# a campaign, the next region's morning. doc-qa's popularity stands still; here a router must
# spread a new hot prefix over the replicas it needs and let the old one go. Held out: added
# after the policy was settled (forty-third session), nothing in `lb` chosen on it.
HOT_SHIFT_APPS = 32
HOT_SHIFT_SYSTEM_TOKENS = 1200
HOT_SHIFT_QUESTION_TOKENS = 96
HOT_SHIFT_OUTPUT_TOKENS = 160
HOT_SHIFT_EVERY = 500  # requests between two rankings


def hot_shift_calls(seed: int) -> Iterator[Timed]:
    rng = rng_for(seed, "hot-shift")
    weights = [1.0 / rank for rank in range(1, HOT_SHIFT_APPS + 1)]
    t, ranking = 0.0, list(range(HOT_SHIFT_APPS))
    for i in itertools.count():
        if i % HOT_SHIFT_EVERY == 0:
            rng.shuffle(ranking)  # ranking[r]: the app at rank r + 1 until the next shift
        t += rng.expovariate(1.0)
        k = ranking[rng.choices(range(HOT_SHIFT_APPS), weights)[0]]
        yield Timed(t, Call(f"hot-{i}", "local", prefixed_prompt(k, HOT_SHIFT_SYSTEM_TOKENS, i, HOT_SHIFT_QUESTION_TOKENS),
                            HOT_SHIFT_OUTPUT_TOKENS, app="hot-shift", user=f"user-{i % 64}"))


def system_prompt_calls(live: Reasoning | BestOfN, ids: str, samples: Callable[[object], int] = lambda d: 1
                        ) -> Iterator[Timed]:
    """A live workload's requests of a system prompt and a question (`live.draws()`: the same
    draws), at 1 req/s before scaling; each system prompt one range of token ids, each question
    its own; user `{ids}-{i % 64}` as the live requests name it; `samples(draw)`: its `n`."""
    systems = live.system_lengths()
    for d in live.draws():
        tokens = prefixed_prompt(d.system, systems[d.system], d.i, d.question_tokens, question_shift=14)
        yield Timed(d.at, Call(f"{ids}-{d.i}", "local", tokens, d.answer_tokens, user=f"{ids}-{d.i % 64}",
                               samples=samples(d)))


def reasoning_calls(seed: int) -> Iterator[Timed]:
    """The live `reasoning` workload's requests (bench/workloads/reasoning.py)."""
    return system_prompt_calls(Reasoning(seed=seed), "reason")


def best_of_n_calls(seed: int) -> Iterator[Timed]:
    """The live `best-of-n` workload's requests (bench/workloads/best_of_n.py)."""
    return system_prompt_calls(BestOfN(seed=seed), "bon", lambda d: d.samples)


def multi_lora_calls(seed: int) -> Iterator[Timed]:
    """The live `multi-lora` workload's requests (bench/workloads/multi_lora.py): each adapter's
    system prompt one range of token ids (its KV its own in the engine: `Call.adapter`)."""
    live = MultiLora(seed=seed)
    systems = live.system_lengths()
    for d in live.draws():
        tokens = prefixed_prompt(d.adapter, systems[d.adapter], d.i, d.question_tokens, question_shift=14)
        yield Timed(d.at, Call(f"lora-{d.i}", "local", tokens, d.answer_tokens, user=f"lora-{d.i % 64}",
                               adapter=adapter_name(d.adapter)))


# Long and short prompts on one fleet: the live `long-short` workload's draws
# (bench/workloads/long_short.py says what and why), each system prompt one range of token ids,
# each question and each document its own.
def long_short_calls(seed: int) -> Iterator[Timed]:
    _, system_tokens, question_tokens, answer_tokens = long_short.CHAT
    doc_tokens, doc_answer = long_short.DOC
    for d in long_short.draws(seed):
        if d.system is None:
            yield Timed(d.at, Call(f"doc-{d.i}", "local", own_prompt(2, d.i, doc_tokens), doc_answer,
                                   user=f"doc-{d.i % 32}"))
        else:
            yield Timed(d.at, Call(f"chat-{d.i}", "local", prefixed_prompt(d.system, system_tokens, d.i, question_tokens),
                                   answer_tokens, user=f"chat-{d.i % 64}"))


def random_calls(seed: int) -> Iterator[Timed]:
    """The live `random` workload's draws (bench/workloads/random_dataset.py says what and why) at
    its defaults, each prompt one range of token ids of its own."""
    for d in random_dataset.draws(seed):
        yield Timed(d.at, Call(f"random-{d.i}", "local", own_prompt(3, d.i, d.input_tokens), d.output_tokens))


# -- the registry -------------------------------------------------------------------------
TOT = {"workload": "tot", "branching": 2, "depth": 4, "output_tokens": 64}

register(Workload("tot", "Tree of Thoughts over GSM8K, 2-branch depth 4 (15 requests a tree; "
                  "siblings share the parent's prompt and answer), 4 L4 replicas",
                  ONE_REGION, "programs", program=TOT, requests_per_program=15))
register(Workload("mixed-tree", "Tree of Thoughts, every 4th tree 4-branch (85 requests) and the "
                  "rest 2-branch (15), depth 4, 4 L4 replicas",
                  ONE_REGION, "programs", program={**TOT, "workload": "mixed-tree", "wide_every": 4},
                  requests_per_program=(3 * 15 + 85) / 4))
register(Workload("multiturn", "4-turn conversations over MT-Bench questions (real turn texts; each "
                  "turn carries the whole history and the real previous answer), 128-token answers, 4 L4 replicas",
                  ONE_REGION, "programs", program={"workload": "multiturn", "turns": 4, "output_tokens": 128},
                  requests_per_program=4))
register(Workload("mooncake", "Mooncake conversation trace replay (open loop), prefix blocks kept "
                  f"(block and sizes x{MOONCAKE_SIZE_SCALE:g}, contexts clipped to {MOONCAKE_MAX_INPUT}), 4 L4 replicas",
                  ONE_REGION, "replay", calls=mooncake_calls, natural_rps=_mooncake_rps))
register(Workload("bursty", f"ServeGen's {BURSTY_TENANTS} busiest tenants at noon (bursty Gamma/Weibull "
                  "inter-arrivals) with Azure conversation sizes (x0.5), open loop, 4 L4 replicas",
                  ONE_REGION, "replay", calls=bursty_calls, natural_rps=lambda: 1.0))
register(Workload("shared-prefix", f"SGLang's generated-shared-prefix benchmark at its defaults: "
                  f"{SHARED_PREFIX_GROUPS} system prompts of {SHARED_PREFIX_SYSTEM_TOKENS} tokens, "
                  f"{SHARED_PREFIX_QUESTION_TOKENS}-token questions, {SHARED_PREFIX_OUTPUT_TOKENS}-token answers, "
                  "Poisson arrivals (open loop); held out: added after the policy was settled, 4 L4 replicas",
                  ONE_REGION, "replay", calls=shared_prefix_calls, natural_rps=lambda: 1.0))
register(Workload("doc-qa", f"Questions over {DOC_QA_DOCUMENTS} documents of {DOC_QA_TOKENS[0]:,}-{DOC_QA_TOKENS[1]:,} "
                  f"tokens, Zipf-popular (1/rank), {DOC_QA_QUESTION_TOKENS}-token questions, "
                  f"{DOC_QA_OUTPUT_TOKENS}-token answers, Poisson arrivals (open loop); synthetic, added after the "
                  "KV-bounded trie to check it, 4 L4 replicas",
                  ONE_REGION, "replay", calls=doc_qa_calls, natural_rps=lambda: 1.0))
register(Workload("agent", "Tool-using agent sessions, a coding agent's shape scaled to an 8k context: a shared "
                  "1,500-token system prompt, a task, 4-16 steps each appending the answer and a 50-1,500-token "
                  "tool observation, ~1 s tool runs between steps (closed loop); held out: added after the policy "
                  "was settled, 4 L4 replicas",
                  ONE_REGION, "programs", duration_s=600.0, quick_duration_s=300.0,  # a session lasts ~1-2 min
                  program={"workload": "agent"}, requests_per_program=Agent().mean_steps()))
register(Workload("agent-slow-tools", "The agent sessions with a coding agent's slow tools (builds, test suites): tool "
                  "runs exponential with an 8 s mean, at most 60 s, the rest as `agent`; held out: added after KV "
                  "leases were settled on `agent`, to check how long a lease should hold, 4 L4 replicas",
                  ONE_REGION, "programs", duration_s=900.0, quick_duration_s=450.0,  # a session lasts ~2-4 min
                  program={"workload": "agent", "think_mean_s": 8.0, "think_max_s": 60.0},
                  requests_per_program=Agent().mean_steps()))
register(Workload("reasoning", "A reasoning model's traffic: short prompts (8 system prompts of 200-1,200 tokens, "
                  "Zipf-popular, and a question of ~150 tokens) and long heavy-tailed answers (lognormal, median "
                  "700 tokens, mean ~1,010), Poisson arrivals (open loop); held out: added after the policy was "
                  "settled, decode-bound, 4 L4 replicas",
                  ONE_REGION, "replay", duration_s=600.0, quick_duration_s=300.0,  # an answer runs ~30-120 s
                  calls=reasoning_calls, natural_rps=lambda: 1.0))
register(Workload("long-short", "A chat service (4 system prompts of 300 tokens, 100-token questions, 200-token "
                  "answers) where one request in ten is a unique 6,000-token document to summarize (300-token "
                  "answers), Poisson arrivals (open loop); held out: added after the policy was settled, 4 L4 replicas",
                  ONE_REGION, "replay", calls=long_short_calls, natural_rps=lambda: 1.0))
register(Workload("random", "The serving benchmarks' random dataset (`sglang.bench_serving --dataset-name random` at its "
                  "defaults): prompts of 1-1,024 random tokens, nothing shared, answers of 1-1,024 tokens, uniform, "
                  "Poisson arrivals (open loop); held out: added after the policy was settled, 4 L4 replicas",
                  ONE_REGION, "replay", calls=random_calls, natural_rps=lambda: 1.0))
register(Workload("hot-shift", f"{HOT_SHIFT_APPS} apps' system prompts of {HOT_SHIFT_SYSTEM_TOKENS:,} tokens, "
                  f"Zipf-popular (1/rank), the ranking drawn again every {HOT_SHIFT_EVERY} requests (the hot app "
                  f"turns cold, a cold one hot), {HOT_SHIFT_QUESTION_TOKENS}-token questions, "
                  f"{HOT_SHIFT_OUTPUT_TOKENS}-token answers, Poisson arrivals (open loop); held out: added after "
                  "the policy was settled, 4 L4 replicas",
                  ONE_REGION, "replay", calls=hot_shift_calls, natural_rps=lambda: 1.0))
register(Workload("best-of-n", "Chat beside parallel sampling: 16 apps' system prompts of 400-1,600 tokens, "
                  "Zipf-popular, ~200-token questions, half the requests one answer and the rest n = 4 or 8 answers "
                  "sampled in parallel (a best-of-n reranker), ~200 tokens each, Poisson arrivals (open loop); held "
                  "out: added after the policy was settled, 4 L4 replicas",
                  ONE_REGION, "replay", calls=best_of_n_calls, natural_rps=lambda: 1.0))
register(Workload("multi-lora", f"One base model serving 32 LoRA adapters (fine-tunes), Zipf-popular, each with its "
                  f"own system prompt of 300-900 tokens, ~150-token questions and answers; each batch runs at most "
                  f"{MAX_LORAS} adapters, Poisson arrivals (open loop); held out: added after the policy was settled, "
                  "4 L4 replicas", dataclasses.replace(ONE_REGION, max_loras=MAX_LORAS), "replay",
                  calls=multi_lora_calls, natural_rps=lambda: 1.0))
register(Workload("heterogeneous", "Tree of Thoughts (2-branch) on 4 L4 replicas of which 2 are 2x slower",
                  HETEROGENEOUS, "programs", program=TOT, requests_per_program=15))
register(Workload("regions", "Tree of Thoughts (2-branch) from 3 regions (us/eu/asia, arrivals 2:1:1, "
                  "one-way WAN 40/80/90 ms), 2 L4 replicas each; lb per region with peering, each peer "
                  "one central router in us", THREE_REGIONS, "programs", program=TOT, requests_per_program=15))


def _fairness(args) -> int:
    from bench.sim.fair_workload import run

    return run(args)


register(Workload("fairness", "FairServe: 4 ServeGen tenants in 3-stage interactions + one tenant at 10x the mean "
                  "rate, 1 tiny engine (max-running 2) as the live scenario; lb fcfs/rpm/vtc/wsc/wsc+oit; "
                  "benign P90 ratio, service shares, aborted interactions, wasted tokens",
                  ONE_REGION, "custom", runner=_fairness))


def _tiers(args) -> int:
    from bench.sim.tiers_workload import run

    return run(args)


register(Workload("tiers", "SageServe tiers: Azure conversation arrivals, 30 % IW-F / 70 % IW-N with TTFT targets, "
                  "1 tiny engine as the live scenario, near and above capacity; lb fcfs/edf/pf/dpa; "
                  "SLO violations and Q3 TTFT per tier", ONE_REGION, "custom", runner=_tiers))
