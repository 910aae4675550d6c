"""SkyWalker §5.2 in the simulator: selective pushing (SP-P) against blind pushing.

The paper's setting: 4 replicas, 30 closed-loop Tree-of-Thoughts clients, BP baseline =
SGLang Router `cache_aware`. Systems: `lb` (prefix routing + SP-P, the default), `lb blind`
(the same routing, blind pushing) and `sglang-router cache_aware` (its model, blind pushing).
Every system runs the same clients for each seed; next to the client-side figures it reports
the engine-side evidence per replica (waiting-queue length sampled every 100 ms, evicted
cache tokens, prompt tokens lost from the cache while waiting, preemptions, cache hit).

    python -m bench.sim.spp --seeds 5 --duration 120 --engine l4-llama3-8b-sglang --out /tmp/spp
"""
from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from dataclasses import replace

from bench.sim.clients import Programs
from bench.sim.arena import as_records
from bench.sim.compare import chosen_systems, make_arena, median_ci
from bench.sim.enginestats import WaitingSampler, replica_stats
from bench.sim.workloads_sim import TOT, get
from bench.stats import WARM_SHARE, steady_summary
from bench.workloads import make_workload

SYSTEMS = ("lb", "lb blind", "sglang-router cache_aware")
CLIENTS = 30


def run_one(args: tuple) -> dict:
    """args: (system, seed, duration_s, clients, profile, output_tokens[, warm_share])."""
    system, seed, duration_s, clients, profile, output_tokens, *rest = args
    warm_share = rest[0] if rest else WARM_SHARE
    workload = get("tot")
    fleet = replace(workload.fleet, profile=profile)
    arena = make_arena("tot", system, seed, fleet=fleet)
    params = {k: v for k, v in TOT.items() if k != "workload"}
    programs = make_workload("tot", seed=seed, **{**params, "output_tokens": output_tokens})
    Programs(arena, programs, stop_at=duration_s).clients({"local": clients})
    waiting = WaitingSampler(arena, duration_s)
    arena.loop.run(duration_s)
    # the trees of all clients start in step: the first fifth is left out (bench.stats.steady_summary)
    steady = steady_summary(as_records(arena.done), duration_s, warm_share)
    warm = steady["from_s"]
    # Throughput counts every completion in the window. The latency figures take only requests
    # sent inside it (whole), which undercounts completions by what is in flight at the end:
    # with 256-token thoughts (~125 in flight for ~23 s) that was 15 %, and edge effects of a
    # short window still move the count by L / (lambda x window) (~10 % at 240 s): compare
    # systems over long runs, with the engines' running batch next to it.
    ended = [d for d in arena.done if warm <= d.sent_at + d.e2e <= duration_s]
    replicas = replica_stats(arena, waiting, skip=0.2)
    return {
        "system": system, "seed": seed,
        "throughput_rps": steady["throughput_rps"],
        "e2e_mean_s": float(np.mean([d.e2e for d in ended])) if ended else None,
        "ttft_p50_s": steady["ttft_s"]["p50"],
        "ttft_p90_s": steady["ttft_s"]["p90"],
        "cached_ratio": steady["cached_token_ratio"],
        "waiting_mean": sum(r["waiting_mean"] for r in replicas),
        "running_mean": sum(r["running_mean"] for r in replicas),
        "waiting_max": max(r["waiting_max"] for r in replicas),
        "evicted_tokens": sum(r["evicted_tokens"] for r in replicas),
        "lost_while_waiting": sum(r["lost_while_waiting"] for r in replicas),
        "preemptions": sum(r["preemptions"] for r in replicas),
        "replicas": replicas,
    }


FIGURES = ("throughput_rps", "e2e_mean_s", "ttft_p50_s", "ttft_p90_s", "cached_ratio", "running_mean", "waiting_mean",
           "waiting_max", "evicted_tokens", "lost_while_waiting", "preemptions")


def summarize(runs: list[dict], systems: tuple[str, ...] = SYSTEMS) -> dict:
    return {s: {f: median_ci([r[f] for r in runs if r["system"] == s]) for f in FIGURES}
            for s in systems}


def table(summary: dict) -> str:
    head = ("| system | req/s | E2E mean s | TTFT p50 s | TTFT p90 s | cached | running (sum of means) | "
            "waiting (sum of means) | waiting max | evicted tok | lost while waiting | preemptions |")
    lines = [head, "|" + "---|" * 12]
    for s, f in summary.items():
        def cell(k: str, fmt: str) -> str:
            m, (lo, hi) = f[k]["median"], f[k]["ci95"]
            if m is None:
                return "n/a"
            return f"{m:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"
        lines.append(f"| {s} | {cell('throughput_rps', '.2f')} | {cell('e2e_mean_s', '.2f')} | "
                     f"{cell('ttft_p50_s', '.2f')} | {cell('ttft_p90_s', '.2f')} | {cell('cached_ratio', '.2f')} | "
                     f"{cell('running_mean', '.1f')} | {cell('waiting_mean', '.1f')} | {f['waiting_max']['median']:.0f} | "
                     f"{f['evicted_tokens']['median']:.0f} | {f['lost_while_waiting']['median']:.0f} | "
                     f"{f['preemptions']['median']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=120.0, help="virtual seconds per run")
    ap.add_argument("--clients", type=int, default=CLIENTS)
    ap.add_argument("--engine", choices=("l4-llama3-8b", "l4-llama3-8b-sglang"), default="l4-llama3-8b-sglang",
                    help="engine profile: SGLang's scheduler (the paper's engine) or the fixed-reserve FCFS one")
    ap.add_argument("--output-tokens", type=int, default=TOT["output_tokens"], help="max_tokens of each thought")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated (default {','.join(SYSTEMS)}; any of `lb-bench sim-compare`'s)")
    ap.add_argument("--warm-share", type=float, default=WARM_SHARE,
                    help="share of the run left out as warm-up (default 0.2; 0: the whole run, as a live "
                         "run of that length from an empty fleet measures it)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    chosen = tuple(chosen_systems(a.systems))  # an unknown name exits naming the known ones
    if not chosen:
        ap.error("--systems named none")
    if not 0 <= a.warm_share < 1:
        ap.error("--warm-share must be in [0, 1)")
    jobs = [(s, seed, a.duration, a.clients, a.engine, a.output_tokens, a.warm_share)
            for seed in range(a.seeds) for s in chosen]
    with ProcessPoolExecutor(a.workers) as pool:
        runs = list(pool.map(run_one, jobs))
    summary = summarize(runs, chosen)
    text = table(summary)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "runs.json").write_text(json.dumps(runs, indent=1))
        (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
        (a.out / "table.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
