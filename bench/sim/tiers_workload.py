"""`lb-bench sim-compare tiers`: SageServe's interactive tiers in virtual time.

The live scenario's set-up (bench/scenarios/tiers.py) without its noise: Azure conversation
trace arrivals (open loop, sizes x0.2, prompts clipped to 512 tokens), each request IW-F
(30 %) or IW-N (70 %) with TTFT targets 0.5 s / 1.5 s (DPA's tau_n 0.2 s), one emulated tiny
engine at half speed with 2 running requests at most, behind `lb` with each queue order:
FCFS, EDF, PF, DPA (SageServe's classes with the daemon's default tau_p, which never
promotes expired requests; and with tau_p 2 s, as the live scenario ran it, 5 s, the old
default, and 60 s). Each seed replays its own stretch of the trace, its times scaled so the
offered rate is a share of the engine's capacity (measured in the simulator: requests/s it
completes when saturated). Two loads: 0.9 (near capacity, the live scenario's regime) and
1.2 (above capacity, SageServe's regime). Beside them, NIW batch jobs at 0.15 x capacity go
through the daemon's deferred queue (`DeferredGate`: lb.core.deferred's release round each
probe interval), due 0.4 x the run after they arrive.

Columns beyond the proving ground's schema: per tier the SLO violation rate (TTFT over
target, or not answered by the end of the run) and Q3 TTFT; NIW jobs finished by their
deadline.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import numpy as np

from bench import traces
from bench.sim.arena import Arena, Call, lb_config
from bench.sim.fair_workload import FLEET, run_all, seeds_and_length
from bench.workloads.base import rng_for
from lb.core.deferred import DeferredConfig, DeferredQueue
from lb.core.tiers import TierConfig, TierTarget
from lb.core.types import QueueEntry, RequestFacts, Tier

TARGETS = {Tier.IW_F: 0.5, Tier.IW_N: 1.5}
TIERS = TierConfig(targets={**TierConfig().targets, **{t: TierTarget(ttft_s=s, e2e_s=60.0) for t, s in TARGETS.items()}},
                   tau_n_s=0.2)  # tau_p: the daemon's default
# system -> (queue order, DPA's tau_p: how late a request may be before it is served first;
# None: the daemon's default)
SYSTEMS = {"fcfs": ("fcfs", None), "edf": ("edf", None), "pf": ("pf", None), "dpa": ("dpa", None),
           "dpa tau_p=2s": ("dpa", 2.0), "dpa tau_p=5s": ("dpa", 5.0), "dpa tau_p=60s": ("dpa", 60.0)}
# NIW batch work, as SageServe runs it beside the interactive tiers: accepted at once, held in
# the daemon's deferred queue (lb.core.deferred) and released into the LB queue while the
# engine has room, or promoted when its deadline nears. Its times are shares of the run's
# length (a day's batch deadline does not fit a 200 s run): jobs arrive over the first
# (1 - NIW_DEADLINE) of the run at NIW_LOAD x capacity, each due NIW_DEADLINE x the run
# after it arrived, promoted NIW_MARGIN x the run before that.
NIW_LOAD = 0.15
NIW_DEADLINE = 0.4
NIW_MARGIN = 0.15
LOADS = {"near": 0.9, "over": 1.2}  # offered rate / the engine's capacity
SIZE_SCALE = 0.2
MAX_INPUT = 512
FAST_SHARE = 0.3


def calls(seed: int, time_scale: float, duration_s: float) -> list[tuple[float, Call]]:
    """The seed's stretch of the trace with times x `time_scale`, until `duration_s`."""
    rows = traces.azure_conv()
    start = 40.0 + 300.0 * (seed % 5)  # each seed its own stretch of the 30-minute trace
    rng = rng_for(seed, "tiers")
    out = []
    for i, row in enumerate(r for r in rows if r.t >= start):
        at = (row.t - start) * time_scale
        if at >= duration_s:
            break
        n = min(MAX_INPUT, max(1, round(row.context_tokens * SIZE_SCALE)))
        tier = Tier.IW_F if rng.random() < FAST_SHARE else Tier.IW_N
        base = (i + 1) << 24
        out.append((at, Call(f"t{i}", "local", list(range(base, base + n)),
                             max(1, round(row.generated_tokens * SIZE_SCALE)), user=tier.value, tier=tier)))
    return out


@functools.cache
def capacity_rps() -> float:
    """Requests/s the engine completes when saturated (FCFS, 4x the trace's pace, 100 s)."""
    arena = Arena(FLEET, "capacity", seed=0, lb_cfg=lb_config(tiers=TIERS))
    done: list[float] = []
    for at, call in calls(0, 0.25, 100.0):
        arena.loop.at(at, arena.send, call, lambda d: done.append(d.sent_at + d.e2e))
    arena.loop.run(100.0)
    return sum(1 for t in done if t >= 20.0) / 80.0


def time_scale(seed: int, load: float) -> float:
    """Trace seconds -> simulated seconds so the seed's stretch offers `load` x capacity."""
    natural = len(calls(seed, 1.0, 300.0)) / 300.0
    return natural / (load * capacity_rps())


def niw_jobs(seed: int, duration_s: float) -> list[tuple[float, Call]]:
    """The seed's batch jobs: Poisson arrivals at NIW_LOAD x capacity, trace-sized."""
    rows = traces.azure_conv()
    rng = rng_for(seed, "tiers-niw")
    out, at, i = [], 0.0, 0
    while True:
        at += rng.expovariate(NIW_LOAD * capacity_rps())
        if at >= duration_s * (1 - NIW_DEADLINE):
            return out
        row = rows[rng.randrange(len(rows))]
        n = min(MAX_INPUT, max(1, round(row.context_tokens * SIZE_SCALE)))
        base = (1 << 40) + ((i + 1) << 24)
        out.append((at, Call(f"niw{i}", "local", list(range(base, base + n)),
                             max(1, round(row.generated_tokens * SIZE_SCALE)), user="niw", tier=Tier.NIW)))
        i += 1


class DeferredGate:
    """The daemon's admission gate for NIW work in virtual time: each probe interval one
    `DeferredQueue.release_round` (lb.core.deferred) over the LB's queue and replica views."""

    def __init__(self, arena: Arena, tiers: TierConfig, duration_s: float, on_done):
        self.arena, self.front = arena, next(iter(arena.fronts.values()))
        self.queue = DeferredQueue(DeferredConfig(promote_after_s=duration_s, deadline_margin_s=NIW_MARGIN * duration_s),
                                   tiers)
        self.on_done, self.end = on_done, duration_s
        self.released = {"capacity": 0, "promoted": 0}
        self.arena.loop.at(0.0, self._round)

    def submit(self, call: Call) -> None:
        now = self.arena.loop.now
        facts = RequestFacts(request_id=call.request_id, model=self.arena.model, prompt_tokens=len(call.tokens),
                             max_tokens=call.output_tokens, arrival=now, user=call.user, tier=Tier.NIW)
        self.queue.push(QueueEntry(facts, now, payload=call))

    def _round(self) -> None:
        now, lb = self.arena.loop.now, self.front
        lb.refresh(now, [self.arena.model])
        for rel in self.queue.release_round(now, queued=len(lb.scheduler), replicas=[r.view for r in lb.replicas.values()],
                                            available=lb.available):
            self.released["promoted" if rel.promoted else "capacity"] += 1
            self.arena.send(rel.entry.payload, self.on_done)
        if now + lb.cfg.probe_interval_s < self.end:
            self.arena.loop.after(lb.cfg.probe_interval_s, self._round)


def run_one(args: tuple[str, str, int, float]) -> dict:
    system, load, seed, duration_s = args
    order, tau_p = SYSTEMS[system]
    deadline = NIW_DEADLINE * duration_s
    tiers = dataclasses.replace(TIERS, tau_p_s=TIERS.tau_p_s if tau_p is None else tau_p,
                                targets={**TIERS.targets, Tier.NIW: TierTarget(ttft_s=deadline, e2e_s=deadline)})
    arena = Arena(FLEET, f"lb {system}", seed=seed, lb_cfg=lb_config(queue=order, tiers=tiers))
    sent = calls(seed, time_scale(seed, LOADS[load]), duration_s)
    ttft: dict[str, list[float]] = {t.value: [] for t in TARGETS}
    for at, call in sent:
        arena.loop.at(at, arena.send, call, lambda d, tier=call.tier.value: ttft[tier].append(d.ttft))
    batch = niw_jobs(seed, duration_s)
    niw_done: list[float] = []  # completion time - arrival at the LB, per finished job
    arrived = {call.request_id: at for at, call in batch}
    gate = DeferredGate(arena, tiers, duration_s,
                        lambda d: niw_done.append(d.sent_at + d.e2e - arrived[d.req.id]))
    for at, call in batch:
        arena.loop.at(at, gate.submit, call)
    arena.loop.run(duration_s)
    out = {"order": system, "load": load, "seed": seed, "throughput_rps": sum(map(len, ttft.values())) / duration_s,
           "ttft_p50_s": float(np.percentile([x for v in ttft.values() for x in v], 50)),
           "ttft_p90_s": float(np.percentile([x for v in ttft.values() for x in v], 90)),
           "cut_at_deadline": len(sent) - sum(map(len, ttft.values()))}
    for tier, target in TARGETS.items():
        mine = sum(1 for _, c in sent if c.tier is tier)
        done = ttft[tier.value]
        out[f"{tier.value}_violations"] = (mine - sum(1 for x in done if x <= target)) / mine if mine else None
        out[f"{tier.value}_q3_ttft_s"] = float(np.percentile(done, 75)) if done else None
    out["niw_jobs"] = len(batch)
    out["niw_on_time"] = sum(1 for x in niw_done if x <= deadline) / len(batch) if batch else None
    out["niw_released"] = dict(gate.released)
    return out


def summarize(runs: list[dict], seeds: int, duration_s: float) -> dict:
    from bench.sim.compare import median_ci

    out = {"workload": "tiers", "seeds": seeds, "duration_s": duration_s, "loads": LOADS,
           "capacity_rps": capacity_rps(), "systems": {},
           "targets_s": {t.value: s for t, s in TARGETS.items()},
           "ci": "median of per-seed values; 95 % percentile bootstrap of the median over seeds",
           "violations": "share of the tier's requests whose TTFT exceeded its target or that were unanswered at the end"}
    for load in LOADS:
        for order in SYSTEMS:
            mine = [r for r in runs if r["order"] == order and r["load"] == load]
            entry = {m: median_ci([r[m] for r in mine]) for m in ("throughput_rps", "ttft_p50_s", "ttft_p90_s")}
            for t in TARGETS:
                for m in ("violations", "q3_ttft_s"):
                    entry[f"{t.value}_{m}"] = median_ci([r[f"{t.value}_{m}"] for r in mine])
            entry["niw_on_time"] = median_ci([r["niw_on_time"] for r in mine])
            entry["niw_jobs"] = sum(r["niw_jobs"] for r in mine)
            entry["errors"] = 0
            entry["cut_at_deadline"] = sum(r["cut_at_deadline"] for r in mine)
            out["systems"][f"lb {order} @{load}"] = entry
    return out


def table(summary: dict) -> str:
    def f(x: dict, scale: float = 100, digits: int = 0) -> str:
        m, (lo, hi) = x["median"], x["ci95"]
        return "-" if m is None else f"{m * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"

    rows = ["| system @ load | IW-F violations % | IW-N violations % | IW-F Q3 TTFT s | IW-N Q3 TTFT s | NIW on time % | req/s |",
            "|---|---|---|---|---|---|---|"]
    for name, s in summary["systems"].items():
        rows.append(f"| {name} | {f(s['iw-f_violations'])} | {f(s['iw-n_violations'])} | "
                    f"{f(s['iw-f_q3_ttft_s'], 1, 2)} | {f(s['iw-n_q3_ttft_s'], 1, 2)} | {f(s['niw_on_time'])} | "
                    f"{f(s['throughput_rps'], 1, 1)} |")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    seeds, duration = seeds_and_length(args)
    jobs = [(system, load, seed, duration) for seed in range(seeds) for load in LOADS for system in SYSTEMS]
    return run_all("tiers", args, jobs, run_one, summarize, table,
                   f"{seeds} seeds, {duration:g} s each (median [95 % CI]); loads {LOADS} x capacity "
                   f"{capacity_rps():.2f} req/s")
