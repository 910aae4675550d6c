"""`lb-bench sim-compare fairness`: FairServe's abusive-tenant experiment in virtual time.

The live scenario's set-up (bench/scenarios/fairness.py), without its noise: four ServeGen
tenants (their own bursty arrival shapes, Azure conversation sizes x0.05) start 3-stage
interactions (the next stage when the previous one's last token is back) at 2 per second
in all, and one abusive tenant starts them at 10x the mean tenant's rate; one emulated tiny
engine at half speed with 2 running requests at most (the live emulator's flags), behind
`lb` with each queue order. Every system runs each seed twice, with and without the
abuser, on the same benign arrivals.

Systems: `lb fcfs`, `lb rpm` (FCFS + per-tenant request limit, always enforced), `lb vtc`
(the VTC paper's cumulative counters and lift), `lb wsc (cumulative)` (WSC with the
papers' counters and lift: what `lb` ran before the fix), `lb wsc` (the default: service
decayed with a half-life, no lift) and `lb wsc+oit` (plus OIT: the limit only while the
region is overloaded, never mid-interaction). Throttling runs the daemon's core rules
(`lb.core.fairness`: `rate_limits`, `throttle_decision`, `InteractionLedger`,
`OverloadDetector`) at arrival on sliding windows of virtual time.

Columns beyond the proving ground's schema: `benign_p90_ratio` (benign tenants' P90 TTFT
over their P90 in the seed's no-abuser FCFS run, as the live scenario reports it),
`benign_p90_ratio_own` (over the same system's no-abuser run), `service_share` per tenant,
`tokens_wasted` and `interactions_aborted` (throttled after their first stage).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bench import traces
from bench.profiles import PROFILES
from bench.sim.arena import Arena, Call, FleetSpec, RegionSpec, lb_config
from bench.workloads.base import rng_for
from bench.workloads.servegen import ServeGen, labelled, tenant_arrivals
from lb.core.fairness import (FairnessConfig, HitResult, InteractionLedger, OverloadDetector, WscConfig,
                              rate_limits, throttle_decision)
from lb.core.types import RequestFacts

STAGES = 3
TENANTS = 4
ABUSE_FACTOR = 10
BENIGN_RPS = 2.0  # interaction starts per second, all benign tenants together (as live)
SIZE_SCALE = 0.05
WINDOW_S = 10.0
WARMUP_S = 20.0  # figures count requests sent after this
PROFILE = "tiny-fairness"
# The live scenario's engine: the tiny profile, `--max-running 2`, `--speed 0.5` (2x slower).
PROFILES.setdefault(PROFILE, PROFILES["tiny"].with_overrides(name=PROFILE, max_running=2))
FLEET = FleetSpec((RegionSpec("local", 1, slow_replicas=1),), profile=PROFILE, slow_factor=2.0)
# system -> (queue order, throttle, WSC config or None for the order's default)
SYSTEMS = {
    "lb fcfs": ("fcfs", "none", None),
    "lb rpm": ("fcfs", "rpm", None),
    "lb vtc": ("vtc", "none", None),
    "lb wsc (cumulative)": ("wsc", "none", WscConfig(half_life_s=0.0)),
    "lb wsc": ("wsc", "none", None),
    "lb wsc+oit": ("wsc", "oit", None),
}
REFERENCE = "lb fcfs"
# Without headers, a stage's prompt adds the last answer and this many tokens (one trie block
# and more: a continuation must extend the earlier prompt by a whole block to be known).
NEXT_CALL_TOKENS = 40


def starts(seed: int, abuser: bool, duration_s: float) -> list[tuple]:
    """Interaction starts (time, id, tenant, prompt tokens, output tokens), in time order."""
    sizes = traces.azure_conv()

    def tenant_stream(sg: ServeGen, tag: str):
        chosen = sg.chosen()
        total = sum(next((w.rate for w in ws if w.start <= sg.start < w.start + traces.SERVEGEN_WINDOW_S), 0.0)
                    for ws in chosen.values())
        factor = sg.total_rps / total if total > 0 else 0.0
        streams = [labelled(c, tenant_arrivals(ws, sg.start, factor, rng_for(seed, tag, c))) for c, ws in chosen.items()]
        rng = rng_for(seed, tag, "sizes")
        for i, (t, client) in enumerate(heapq.merge(*streams)):
            if t >= duration_s:
                return
            row = rng.choice(sizes)
            yield (t, f"{tag}-{i}", "abuser" if tag == "abuser" else f"sg-{client}",
                   max(1, round(row.context_tokens * SIZE_SCALE)), max(1, round(row.generated_tokens * SIZE_SCALE)))

    streams = [tenant_stream(ServeGen(seed=seed, tenants=TENANTS, total_rps=BENIGN_RPS), "benign")]
    if abuser:  # the busiest ServeGen shape again, its own draws, at 10x the mean tenant's rate
        streams.append(tenant_stream(ServeGen(seed=seed + 7919, tenants=1, total_rps=ABUSE_FACTOR * BENIGN_RPS / TENANTS,
                                              name="abuser"), "abuser"))
    return list(heapq.merge(*streams))


def rpm_limit(benign: list[tuple], duration_s: float) -> int:
    """Per-tenant limit an operator would set: 2x the busiest benign tenant's mean request rate."""
    per: dict[str, int] = {}
    for x in benign:
        per[x[2]] = per.get(x[2], 0) + STAGES
    return max(1, math.ceil(2 * max(per.values(), default=1) / duration_s * WINDOW_S))


class Throttle:
    """The daemon's check at arrival (lb/daemon/fairness.py `check_throttle`) in virtual time:
    core rules, sliding windows kept here."""

    def __init__(self, arena: Arena, mode: str, limit: int):
        self.arena = arena
        self.cfg = FairnessConfig(throttle=mode, window_s=WINDOW_S, user_rpm=limit, overload_queue_len=8,
                                  overload_no_replica_s=1.0)
        self.ledger = InteractionLedger(self.cfg.interaction_ttl_s)
        self.overload = OverloadDetector.from_config(self.cfg)
        self.windows: dict[str, deque] = {}

    def _hit(self, key: str, now: float, window_s: float, limit: int) -> HitResult:
        times = self.windows.setdefault(key, deque())
        while times and times[0] <= now - window_s:
            times.popleft()
        allowed = len(times) < limit
        if allowed:
            times.append(now)
        return HitResult(allowed, len(times), (times[0] + window_s - now) if times else 0.0)

    def throttled(self, facts: RequestFacts) -> bool:
        if self.cfg.throttle == "none":
            return False
        now = self.arena.loop.now
        lb = self.arena.fronts["local"]
        lb.scheduler.recognize(facts, now)  # as the daemon: an undeclared call is known by its prompt first
        self.overload.observe(now, len(lb.scheduler), any(lb.scheduler.available(r.view) for r in lb.replicas.values()))
        hits = [(rule, self._hit(rule.key, now, rule.window_s, rule.limit)) for rule in rate_limits(facts, self.cfg)]
        decision = throttle_decision(self.cfg, hits, overloaded=self.overload.overloaded(now),
                                     mid_interaction=self.ledger.in_progress(facts, now))
        if decision is None:
            self.ledger.dispatched(facts, now)
            return False
        self.ledger.throttled(facts, now)
        return True


def run_one(args: tuple) -> dict:
    """One system, one seed, with or without the abuser: per-request records, aggregated.
    `headers` False: clients send none of lb's headers (no interaction, stage, last call or
    app; the OpenAI `user` stays), and each stage's prompt carries the last stage's prompt and
    answer and a new block, as an application's next call does, which is how `lb` knows it."""
    system, seed, abuser, duration_s, *rest = args
    headers = rest[0] if rest else True
    order, throttle, wsc = SYSTEMS[system]
    arena = Arena(FLEET, system, seed=seed, lb_cfg=lb_config(queue=order, wsc=wsc), headers=headers)
    arrivals = starts(seed, abuser, duration_s)
    gate = Throttle(arena, throttle, rpm_limit([x for x in arrivals if x[2] != "abuser"], duration_s))
    ttft: dict[str, list[float]] = {}
    served: dict[str, int] = {}
    counts = {"aborted": 0, "refused": 0, "wasted": 0, "sent": 0, "done": 0}

    def stage(spec: tuple, k: int, tokens: list[int], spent: int) -> None:
        _, iid, user, _, out = spec
        prompt = tokens + [k + 1] if headers else tokens
        call = Call(f"{iid}-s{k}", "local", prompt, out, user=user, interaction_id=iid, stage=k,
                    final=k == STAGES - 1)
        if headers:
            facts = RequestFacts(request_id=call.request_id, model=arena.model, prompt_tokens=len(call.tokens),
                                 max_tokens=out, arrival=arena.loop.now, user=user, app=user, interaction_id=iid,
                                 interaction_stage=k, final_call=call.final)
        else:
            facts = RequestFacts(request_id=call.request_id, model=arena.model, prompt_tokens=len(call.tokens),
                                 max_tokens=out, arrival=arena.loop.now, user=user)
            arena.hash_prompt(facts, call.tokens)
        if gate.throttled(facts):
            counts["aborted" if k else "refused"] += 1
            counts["wasted"] += spent if k else 0
            return
        counts["sent"] += 1

        def done(d) -> None:
            used = d.prompt_tokens + d.output_tokens
            gate.ledger.completed(facts, arena.loop.now, used)
            counts["done"] += 1
            served[user] = served.get(user, 0) + used
            if d.sent_at >= WARMUP_S:
                ttft.setdefault(user, []).append(d.ttft)
            if k + 1 < STAGES and arena.loop.now < duration_s:
                if headers:
                    stage(spec, k + 1, tokens, spent + used)
                else:  # the next call: this prompt, its answer and a new block (distinct tokens)
                    fresh = tokens[0] + ((k + 1) << 16)
                    stage(spec, k + 1, tokens + list(range(fresh, fresh + out + NEXT_CALL_TOKENS)), spent + used)
        arena.send(call, done)

    for i, spec in enumerate(arrivals):
        base = (i + 1) << 24
        arena.loop.at(spec[0], stage, spec, 0, list(range(base, base + spec[3])), 0)
    arena.loop.run(duration_s)
    benign = [t for user, ts in ttft.items() if user != "abuser" for t in ts]
    total = sum(served.values()) or 1
    return {"system": system, "seed": seed, "abuser": abuser,
            "throughput_rps": counts["done"] / duration_s,
            "ttft_p50_s": float(np.percentile(benign, 50)) if benign else None,
            "benign_p90_s": float(np.percentile(benign, 90)) if benign else None,
            "ttft_p90_s": float(np.percentile([t for ts in ttft.values() for t in ts], 90)) if ttft else None,
            "service_share": {u: round(v / total, 4) for u, v in sorted(served.items())},
            "interactions_aborted": counts["aborted"], "interactions_refused": counts["refused"],
            "tokens_wasted": counts["wasted"], "cut_at_deadline": counts["sent"] - counts["done"]}


def summarize(runs: list[dict], seeds: int, duration_s: float) -> dict:
    from bench.sim.compare import median_ci

    ref = {r["seed"]: r["benign_p90_s"] for r in runs if r["system"] == REFERENCE and not r["abuser"]}
    alone = {(r["system"], r["seed"]): r["benign_p90_s"] for r in runs if not r["abuser"]}
    out = {"workload": "fairness", "seeds": seeds, "duration_s": duration_s, "systems": {},
           "reference": f"benign_p90_ratio: over the seed's no-abuser run of '{REFERENCE}'; "
                        "benign_p90_ratio_own: over the same system's no-abuser run",
           "ci": "median of per-seed values; 95 % percentile bootstrap of the median over seeds"}
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system and r["abuser"]]
        shares: dict[str, list[float]] = {}
        for r in mine:
            for u, v in r["service_share"].items():
                shares.setdefault("abuser" if u == "abuser" else u, []).append(v)
        out["systems"][system] = {
            "throughput_rps": median_ci([r["throughput_rps"] for r in mine]),
            "ttft_p50_s": median_ci([r["ttft_p50_s"] for r in mine]),
            "ttft_p90_s": median_ci([r["ttft_p90_s"] for r in mine]),
            "benign_p90_s": median_ci([r["benign_p90_s"] for r in mine]),
            "benign_p90_ratio": median_ci([r["benign_p90_s"] / ref[r["seed"]] for r in mine]),
            "benign_p90_ratio_own": median_ci([r["benign_p90_s"] / alone[(system, r["seed"])] for r in mine]),
            "service_share": {u: round(float(np.median(v)), 4) for u, v in sorted(shares.items())},
            "tokens_wasted": sum(r["tokens_wasted"] for r in mine),
            "interactions_aborted": sum(r["interactions_aborted"] for r in mine),
            "interactions_refused": sum(r["interactions_refused"] for r in mine),
            "errors": 0, "cut_at_deadline": sum(r["cut_at_deadline"] for r in mine)}
    return out


def table(summary: dict) -> str:
    def f(x: dict, digits: int = 2) -> str:
        m, (lo, hi) = x["median"], x["ci95"]
        return "-" if m is None else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"

    rows = ["| system | benign P90 ratio (vs FCFS alone) | vs own no-abuser run | benign P90 s | abuser share | "
            "aborted | wasted tokens | throughput req/s |", "|---|---|---|---|---|---|---|---|"]
    for name, s in summary["systems"].items():
        rows.append(f"| {name} | {f(s['benign_p90_ratio'])} | {f(s['benign_p90_ratio_own'])} | {f(s['benign_p90_s'], 3)} | "
                    f"{s['service_share'].get('abuser', 0):.2f} | {s['interactions_aborted']} | {s['tokens_wasted']} | "
                    f"{f(s['throughput_rps'], 1)} |")
    return "\n".join(rows)


def seeds_and_length(args: argparse.Namespace) -> tuple[int, float]:
    """sim-compare's defaults for these workloads: 5 seeds of 200 s; --quick 3 of 60 s."""
    return args.seeds or (3 if args.quick else 5), 60.0 if args.quick else 200.0


def run_all(name: str, args: argparse.Namespace, jobs: list, one, summarize_runs, render, header: str) -> int:
    """Run `one` over `jobs` (in `args.workers` processes), summarize, write DIR/summary.json
    and DIR/report.md, print the table: the part `fairness` and `tiers` share."""
    seeds, duration = seeds_and_length(args)
    wall = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            runs = list(pool.map(one, jobs))
    else:
        runs = list(map(one, jobs))
    summary = summarize_runs(runs, seeds, duration)
    summary["wall_s"] = time.perf_counter() - wall
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = render(summary)
    (out / "report.md").write_text(f"# sim-compare {name}\n\n{header}\n\n{text}\n")
    print(f"\n{name}: {header}")
    print(text)
    print(f"\n{name}: done in {summary['wall_s']:.1f} s of wall time -> {out}")
    return 0


def run(args: argparse.Namespace) -> int:
    seeds, duration = seeds_and_length(args)
    headers = not getattr(args, "no_session_headers", False)
    jobs = [(system, seed, abuser, duration, headers) for seed in range(seeds) for system in SYSTEMS
            for abuser in (True, False)]
    return run_all("fairness", args, jobs, run_one, summarize, table,
                   f"{seeds} seeds, {duration:g} s each (median [95 % CI])")
