"""SkyWalker §5.2 in the simulator: selective pushing (SP-P) against blind pushing.

The paper's setting: 4 replicas, 30 closed-loop Tree-of-Thoughts clients, BP baseline =
SGLang Router `cache_aware`. Systems: `lb` (prefix routing + SP-P, the default), `lb blind`
(the same routing, blind pushing) and `sglang-router cache_aware` (its model, blind pushing).
Every system runs the same clients for each seed; next to the client-side figures it reports
the engine-side evidence per replica (waiting-queue length sampled every 100 ms, evicted
cache tokens, prompt tokens lost from the cache while waiting, preemptions, cache hit).

    python -m bench.sim.spp --seeds 5 --duration 120 --engine l4-llama3-8b-sglang --out /tmp/spp

The engines' working point can be moved off the profile's, as `bench/real_vllm/fleet.py` moves a
real vLLM's (`KV_GIB`, `MAX_NUM_SEQS`): `--kv-tokens`, `--max-running` and `--decode-reserve`
(vLLM's V1 scheduler reserves no decode KV at admission and preempts when a decode step finds
no free block), and `--probe-ms` charges each probe what reading the engine's load endpoint
takes (the suite's probes are free), e.g. the real-vLLM run's small KV:

    python -m bench.sim.spp --engine h100-llama3-8b --kv-tokens 4096 --decode-reserve 0 --probe-ms 8
"""
from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from dataclasses import replace

from bench.profiles import PROFILES
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
    """args: (system, seed, duration_s, clients, profile, output_tokens[, warm_share[, overrides]]);
    overrides: Profile fields to change (kv_tokens, max_running, decode_reserve, probe_s)."""
    system, seed, duration_s, clients, profile, output_tokens, *rest = args
    warm_share = rest[0] if rest else WARM_SHARE
    overrides = rest[1] if len(rest) > 1 else {}
    if overrides:
        profile = working_point(profile, overrides)
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


def working_point(profile: str, overrides: dict) -> str:
    """Register (in this process) the profile with `overrides` applied, under a name saying so."""
    name = profile + "".join(f"@{k}={v}" for k, v in sorted(overrides.items()))
    if name not in PROFILES:
        PROFILES[name] = replace(PROFILES[profile], name=name, **overrides)
    return name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=120.0, help="virtual seconds per run")
    ap.add_argument("--clients", type=int, default=CLIENTS)
    ap.add_argument("--engine", choices=sorted(PROFILES), default="l4-llama3-8b-sglang",
                    help="engine profile: SGLang's scheduler on an L4 (the paper's engine), the fixed-reserve "
                         "FCFS one (l4-llama3-8b), an H100's (h100-llama3-8b), ...")
    ap.add_argument("--kv-tokens", type=int, help="each replica's KV cache in tokens (default: the profile's)")
    ap.add_argument("--max-running", type=int, help="each replica's batch cap (vLLM --max-num-seqs)")
    ap.add_argument("--decode-reserve", type=int,
                    help="KV tokens reserved per request at admission (vLLM V1: 0; default: the profile's)")
    ap.add_argument("--probe-ms", type=float,
                    help="what one probe of an engine's load endpoint takes, ms (vLLM's /metrics: ~8 on an "
                         "H200's host; default: the profile's, 0 for the suite's: free and instant)")
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
    overrides = {k: v for k, v in (("kv_tokens", a.kv_tokens), ("max_running", a.max_running),
                                   ("decode_reserve", a.decode_reserve),
                                   ("probe_s", None if a.probe_ms is None else a.probe_ms / 1000)) if v is not None}
    if (overrides.get("kv_tokens", 1) <= 0 or overrides.get("max_running", 1) <= 0
            or overrides.get("decode_reserve", 0) < 0 or overrides.get("probe_s", 0) < 0):
        ap.error("--kv-tokens and --max-running must be positive, --decode-reserve and --probe-ms not negative")
    jobs = [(s, seed, a.duration, a.clients, a.engine, a.output_tokens, a.warm_share, overrides)
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
