"""`lb-bench sim-compare WORKLOAD`: every system on the same arrivals, in virtual time.

For each seed, each system (lb's default configuration `lb`, its variants `lb VARIANT`, and
every peer model in bench/sim/peer_policies.py) gets a fresh fleet and exactly the same
offered load (the same program or trace arrivals, drawn from the seed). Offered load is
`--load` × the fleet's capacity, measured once per workload and run length in the
simulator (saturation throughput behind `lb`, bench/sim/workloads_sim.py).

Per seed a run issues for the run length, then stops: requests still in flight then are
`cut_at_deadline`, reported apart from `errors` (requests that failed: none in the
simulator unless a prompt can never fit). Across seeds each figure is the median of the
per-seed values with a 95 % percentile-bootstrap interval of that median (10,000
resamples of the seeds); with few seeds the interval is close to the seeds' range.

Writes DIR/summary.json (schema in docs/proving-ground.md), DIR/report.md (table, ratios
to the best peer), DIR/ttft_cdf.png and DIR/throughput.png; `--sweep` runs loads 0.5, 0.7,
0.9, 1.1, 1.3 into DIR/load-F/ and plots throughput and P90 TTFT against load.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bench.sim.arena import Arena, FleetSpec, as_records, lb_config
from bench.sim.clients import Surge
from bench.sim.enginestats import WaitingSampler, replica_stats
from bench.sim.model import LBConfig
from bench.sim.peer_policies import PEERS
from bench.sim.workloads_sim import ENGINES, MIXED, PROGRAMS_PER_REPLICA, REPLAY_CLIENTS_PER_REPLICA, WORKLOADS, get
from bench.stats import programs_finished_rps, steady_summary, tenant_summary
from bench.systems import pick_names
from bench.workloads.base import EXACT, check_max_tokens

DEFAULT_SEEDS = 5
DEFAULT_LOAD = 0.9
SWEEP = (0.5, 0.7, 0.9, 1.1, 1.3)
# lb's variants worth showing next to its default: what selective pushing buys over blind
# pushing (it only acts once engines queue), and what prefix-aware routing buys over load alone.
LB_VARIANTS = {"lb": {}, "lb blind": {"pushing": "blind"}, "lb least-load": {"policy": "least-load"},
               "lb prefix-trie": {"policy": "prefix-trie"}}
QUICK_SEEDS = 3
BOOTSTRAP = 10_000


def systems() -> list[str]:
    return list(LB_VARIANTS) + list(PEERS)


# The system `--lb-config FILE` adds: lb with an operator's own daemon config.
LB_FROM_FILE = "lb config"


def chosen_systems(spec: str | None) -> list[str]:
    """`--systems A,B`: those systems in the order given (all when not given); an unknown name
    fails with the known ones."""
    return systems() if spec is None else pick_names(spec, systems())


def make_arena(workload: str, system: str, seed: int, fleet: FleetSpec | None = None, *, stream: bool = True,
               lb_cfg: LBConfig | None = None, max_tokens: str | int = EXACT, headers: bool = True,
               join_at_s: float | None = None) -> Arena:
    fleet = fleet or get(workload).fleet
    if join_at_s is not None:
        fleet = dataclasses.replace(fleet, join_at_s=join_at_s)
    client = {"stream": stream, "max_tokens": max_tokens, "headers": headers}
    if lb_cfg is not None:
        return Arena(fleet, system, seed=seed, lb_cfg=lb_cfg, **client)
    if system in LB_VARIANTS:
        return Arena(fleet, system, seed=seed, lb_cfg=lb_config(**LB_VARIANTS[system]), **client)
    return Arena(fleet, system, seed=seed, peer=PEERS[system].build(seed), **client)


def measure_capacity(workload: str, duration_s: float, seed: int = 0) -> float:
    """Requests/s the fleet completes when saturated (behind lb's default), after a warm-up
    of a fifth of the run: the most over the workload kind's client counts
    (`workloads_sim.PROGRAMS_PER_REPLICA`, `REPLAY_CLIENTS_PER_REPLICA`)."""
    w = get(workload)
    counts = PROGRAMS_PER_REPLICA if w.kind == "programs" else REPLAY_CLIENTS_PER_REPLICA
    best = 0.0
    for per_replica in counts:
        arena = make_arena(workload, "lb", seed)
        w.saturate(arena, seed=seed, stop_at=duration_s, per_replica=per_replica)
        arena.loop.run(duration_s)
        best = max(best, steady_summary(as_records(arena.done), duration_s)["throughput_rps"])
    return best


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How one run differs from the default: clients that do not `stream`; `lb_cfg` (an
    `LBConfig`) runs lb with those settings under the system's name; `max_tokens`: what the
    clients declare (bench.workloads.base.EXACT); `headers` False: clients send no lb header
    (`Arena.headers`); `join_at_s`: each region's last replica joins then
    (`FleetSpec.join_at_s`); `surge`: the offered load's surge (`bench.sim.clients.Surge`)."""
    stream: bool = True
    lb_cfg: LBConfig | None = None
    max_tokens: str | int = EXACT
    headers: bool = True
    join_at_s: float | None = None
    surge: Surge | None = None


def run_one(args: tuple) -> dict:
    """One system, one seed: the per-seed figures (and raw TTFTs for the CDF).
    args: (workload, system, seed, rate_rps, duration_s[, RunOptions])."""
    workload, system, seed, rate_rps, duration_s, *rest = args
    opts = rest[0] if rest else RunOptions()
    wall = time.perf_counter()
    arena = make_arena(workload, system, seed, stream=opts.stream, lb_cfg=opts.lb_cfg, max_tokens=opts.max_tokens,
                       headers=opts.headers, join_at_s=opts.join_at_s)
    driver = get(workload).drive(arena, seed=seed, rate_rps=rate_rps, stop_at=duration_s, surge=opts.surge)
    waiting = WaitingSampler(arena, duration_s)
    arena.loop.run(duration_s)
    # Steady state only: completions inside [warm, end] for throughput (as capacity is
    # measured), requests sent after the warm-up for latencies and cache hits. A run that
    # counted its own ramp from an empty fleet would report a lighter load than it offered.
    # `served_rps` counts the whole run instead: closed-loop programs issue a request when its
    # parent ends, so a system that ramps faster completes more before the window opens and
    # pays it back inside it (Mixed Tree at 0.9, seed 0: lb 2,162 completions in the first
    # 60 s against llm-d's 1,714, then fewer in each of the next two minutes; 16,231 against
    # 16,276 over the run); every system starts empty on the same arrivals, so what it has
    # completed by the end is its work done (below capacity, less only by what is in flight).
    # (bench.stats.steady_summary: the live runs' `steady` figures, the same definitions)
    steady = steady_summary(as_records(arena.done), duration_s)
    ended = [d for d in arena.done if d.sent_at + d.e2e <= duration_s]
    warm = steady["from_s"]
    ttft = np.array([d.ttft for d in ended if d.sent_at >= warm])
    waited = arena.waited(warm)  # also the requests still waiting at the end (Arena.waited)
    tenants = tenant_summary(arena.waited_by_user(warm))
    finished = getattr(driver, "finished", None)  # program workloads only (bench.sim.clients.Programs)
    programs = None if finished is None else programs_finished_rps(finished, warm, duration_s)
    return {
        "system": system, "seed": seed,
        "throughput_rps": steady["throughput_rps"],
        "served_rps": len(ended) / duration_s,
        "ttft_p50_s": steady["ttft_s"]["p50"],
        "ttft_p90_s": steady["ttft_s"]["p90"],
        "ttft_p90_waited_s": float(np.percentile(waited, 90)) if len(waited) else None,
        "tenant_p90_median_s": tenants["p90_median_s"],
        "tenant_p90_worst_s": tenants["p90_worst_s"],
        "programs_rps": programs,
        "e2e_p50_s": steady["e2e_s"]["p50"],
        "cached_ratio": steady["cached_token_ratio"],
        "errors": 0,
        "cut_at_deadline": arena.sent - len(ended),
        "sent": arena.sent,
        "ttft": ttft.round(4).tolist(),
        "replicas": replica_stats(arena, waiting),
        "joined_busy": joined_busy(arena, duration_s),
        **surge_p90s(arena, opts.surge, duration_s),
        "wall_s": time.perf_counter() - wall,
    }


def joined_busy(arena: Arena, duration_s: float) -> float | None:
    """With `--join-at`: the joining replicas' share of time in engine steps after they joined,
    over the other replicas' over the run (1.0: as busy as the rest from the moment they
    joined). Busy time, not requests: a replica that takes the long prompts answers fewer."""
    at = arena.fleet.join_at_s
    if at is None or at >= duration_s:
        return None
    late = [r for r in arena.replicas if r.ready_at == at]
    early = [r for r in arena.replicas if r.ready_at < at]
    if not late or not early:
        return None
    joined = sum(r.busy_s for r in late) / len(late) / (duration_s - at)
    rest = sum(r.busy_s for r in early) / len(early) / duration_s
    return joined / rest if rest else None


def surge_p90s(arena: Arena, surge: Surge | None, duration_s: float) -> dict:
    """With `--surge`: the TTFT p90 (the requests still waiting at the end counted at what
    they waited, as `ttft_p90_waited_s`) of the requests sent during the surge, and of those
    sent in as long a window right after it: how far a system lets the surge's queue reach
    the traffic that follows."""
    if surge is None:
        return {}
    after_end = min(duration_s, surge.end_s + (surge.end_s - surge.start_s))
    out = {}
    for key, (since, until) in (("surge_p90_s", (surge.start_s, surge.end_s)), ("after_surge_p90_s", (surge.end_s, after_end))):
        waited = arena.waited_between(since, until)
        out[key] = float(np.percentile(waited, 90)) if waited else None
    return out


def median_ci(values: list[float], seed: int = 0) -> dict:
    vals = np.array([v for v in values if v is not None], dtype=float)
    if not len(vals):
        return {"median": None, "ci95": [None, None]}
    rng = np.random.default_rng(seed)
    boot = np.median(rng.choice(vals, size=(BOOTSTRAP, len(vals)), replace=True), axis=1)
    return {"median": float(np.median(vals)), "ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]}


METRICS = ("throughput_rps", "served_rps", "ttft_p50_s", "ttft_p90_s", "ttft_p90_waited_s", "tenant_p90_median_s",
           "tenant_p90_worst_s", "programs_rps", "e2e_p50_s", "cached_ratio", "joined_busy", "surge_p90_s",
           "after_surge_p90_s")


def summarize(workload: str, seeds: int, runs: list[dict], extra: dict, names: list[str] | None = None) -> dict:
    out = {"workload": workload, "seeds": seeds, "systems": {}}
    for system in systems() if names is None else names:
        mine = [r for r in runs if r["system"] == system]
        if not mine:
            continue
        entry = {m: median_ci([r.get(m) for r in mine]) for m in METRICS}
        entry["errors"] = sum(r["errors"] for r in mine)
        entry["cut_at_deadline"] = sum(r["cut_at_deadline"] for r in mine)
        out["systems"][system] = entry
    out.update(extra)
    return out


def run_load(workload: str, *, seeds: int, load: float, capacity: float, duration_s: float,
             workers: int, out: Path, stream: bool = True, names: list[str] | None = None,
             lb_file: LBConfig | None = None, max_tokens: str | int = EXACT, headers: bool = True,
             join_at_s: float | None = None, surge: Surge | None = None) -> dict:
    """Every system of `names` (default all) on the same arrivals, and with `lb_file` lb with
    those settings as `LB_FROM_FILE`."""
    rate = load * capacity
    names = list(systems() if names is None else names) + ([LB_FROM_FILE] if lb_file is not None else [])
    options = RunOptions(stream=stream, max_tokens=max_tokens, headers=headers, join_at_s=join_at_s, surge=surge)
    jobs = [(workload, system, seed, rate, duration_s,
             dataclasses.replace(options, lb_cfg=lb_file) if system == LB_FROM_FILE else options)
            for seed in range(seeds) for system in names]
    wall = time.perf_counter()
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            runs = list(pool.map(run_one, jobs))
    else:
        runs = list(map(run_one, jobs))
    summary = summarize(workload, seeds, runs, {
        "load": load, "capacity_rps": capacity, "offered_rps": rate, "duration_s": duration_s, "stream": stream,
        "max_tokens": max_tokens, "headers": headers, "join_at_s": join_at_s,
        "surge": None if surge is None else dataclasses.asdict(surge),
        "ci": "median of per-seed values; 95 % percentile bootstrap of the median over seeds",
        "counts": "errors and cut_at_deadline are totals over all seeds",
        "wall_s": time.perf_counter() - wall,
    }, names)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    engines = [{"system": r["system"], "seed": r["seed"], "replicas": r["replicas"]} for r in runs]
    (out / "engines.json").write_text(json.dumps(engines, indent=1))  # engine-side evidence
    from bench.sim.compare_report import plots, report_md

    plots(summary, runs, out)
    (out / "report.md").write_text(report_md(summary))
    return summary


def capacity_for(workload: str, out: Path) -> float:
    """Measured once per workload over its full run length (a quick run is shorter, but the
    fleet's capacity is not: measured over a short run it would count the ramp and call a
    light load 0.9); kept in DIR/capacity.json for reruns."""
    duration_s = get(workload).duration_s
    path = out / "capacity.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    key = f"{workload}@{duration_s:g}s"
    if key not in known:
        known[key] = measure_capacity(workload, duration_s)
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=2))
    return known[key]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", nargs="?", help="workload name (--list names them)")
    parser.add_argument("--seeds", type=int, help=f"seeds per system (default {DEFAULT_SEEDS}; --quick {QUICK_SEEDS})")
    parser.add_argument("--quick", action="store_true", help="shorter runs and fewer seeds (each workload < 2 min on 2 cores)")
    parser.add_argument("--out", default="out/sim-compare", help="output folder (default out/sim-compare)")
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD, help="offered load as a share of measured capacity (default 0.9)")
    parser.add_argument("--sweep", action="store_true", help=f"run loads {', '.join(map(str, SWEEP))} and plot against load")
    parser.add_argument("--list", action="store_true", help="name the workloads and exit")
    parser.add_argument("--no-stream", action="store_true",
                        help="clients ask for whole answers (stream: false), as batch and third-party clients "
                             "often do: no system sees a first token before the answer ends (TTFT is still "
                             "reported as the engine's first token)")
    parser.add_argument("--max-tokens", default=EXACT, metavar="exact|none|N",
                        help="what clients declare as max_tokens: exact (the answer's length, the default: an "
                             "oracle), none (nothing, as chat clients), or N tokens (a loose cap, as reasoning "
                             "clients); the answers are as long either way")
    parser.add_argument("--no-session-headers", action="store_true",
                        help="clients send none of lb's headers (x-lb-session, x-lb-interaction-id, its stage and "
                             "last call, x-lb-app), as third-party clients (the openai SDK) do; the OpenAI `user` "
                             "field stays. lb then knows an interaction by its prompts (lb.core.continuations)")
    parser.add_argument("--duration", type=float,
                        help="virtual seconds per run (default: the workload's, 300; --quick 150). Longer runs show "
                             "what only a steady state shows: a learned rate that drifts took ~10 minutes to appear")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes (default 2)")
    parser.add_argument("--systems", help="comma-separated systems to run (default: all; `--systems list` names "
                                          "them), e.g. lb,llm-d default-scorers")
    parser.add_argument("--fleet-scale", type=int, default=1, metavar="K",
                        help="run the workload on a fleet K times larger (every region's replicas K times over; "
                             "capacity measured on that fleet, so --load keeps its meaning); also written "
                             "WORKLOAD*K")
    parser.add_argument("--engine", choices=[*ENGINES, MIXED],
                        help="the replicas' scheduler: vllm (the default: admits by prompt blocks, preempts the "
                             "newest), sglang (arrival order, reserves for answers, retracts), sglang-lpm (the "
                             "same, its queue longest cached prefix first) or mixed (every second replica of each "
                             "region on sglang, the rest on vllm); also WORKLOAD@ENGINE. Capacity is "
                             "measured on those engines")
    parser.add_argument("--join-at", type=float, metavar="S",
                        help="a scale-out under load: each region's last replica joins, cold, at S virtual seconds "
                             "(capacity is still the whole fleet's, so the others run past theirs until then); "
                             "the table is followed by how busy the new replicas were once there")
    parser.add_argument("--surge", metavar="START:END:FACTOR",
                        help="offer FACTOR times --load's rate from START to END virtual seconds (a launch, or "
                             "another region's outage landing here), the same arrivals for every system; the table "
                             "is followed by each system's TTFT p90 for the requests sent during the surge and in "
                             "as long a window after it")
    parser.add_argument("--lb-config", metavar="FILE",
                        help=f"also run lb with this daemon config file (its [routing], [pushing], [queue], "
                             f"[probes], [affinity] and [peering] settings) as the system '{LB_FROM_FILE}': "
                             "your own settings on the same arrivals as the default and the peers")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "systems", None) == "list":
        print("\n".join(systems()))
        return 0
    if args.list or not args.workload:
        for name, w in WORKLOADS.items():
            print(f"{name:14s} {w.description}")
        return 0 if args.list else 2
    if args.load <= 0:
        raise SystemExit("--load must be > 0 (a share of the fleet's capacity, e.g. 0.9)")
    name = args.workload
    engine = getattr(args, "engine", None)
    if engine is not None and "@" in name:
        raise SystemExit(f"--engine: {name} names its engine already; give one or the other")
    scale = getattr(args, "fleet_scale", 1)
    if scale != 1:
        if scale < 1:
            raise SystemExit(f"--fleet-scale must be a whole number >= 1, got {scale}")
        if "*" in name:
            raise SystemExit(f"--fleet-scale: {name} names its scale already; give one or the other")
        name = f"{name}*{scale}"
    if engine not in (None, "vllm"):
        name = f"{name}@{engine}"
    try:
        workload = get(name)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if workload.runner is not None and ("*" in name or "@" in name):
        raise SystemExit(f"{name}: {name.partition('@')[0].partition('*')[0]} runs its own scenario; "
                         "--fleet-scale and --engine apply to the suite's workloads")
    if workload.runner is not None:  # its own systems and columns (e.g. fairness)
        if getattr(args, "duration", None) is not None:
            raise SystemExit(f"--duration does not apply to {name} (its runs keep the live scenario's length)")
        return workload.runner(args)
    seeds = args.seeds or (QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    if seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    duration = args.duration if args.duration is not None else (
        workload.quick_duration_s if args.quick else workload.duration_s)
    if duration <= 0:
        raise SystemExit("--duration must be > 0 (virtual seconds, e.g. 1500)")
    join_at = getattr(args, "join_at", None)
    if join_at is not None and not 0 < join_at < duration:
        raise SystemExit(f"--join-at must be inside the run (0 < S < {duration:g} virtual seconds), got {join_at:g}")
    if join_at is not None and any(r.replicas < 2 for r in workload.fleet.regions):
        raise SystemExit(f"--join-at: {name} has a region of one replica; nothing would serve before the join")
    surge = None
    if getattr(args, "surge", None):
        try:
            surge = Surge.parse(args.surge)
        except ValueError as exc:
            raise SystemExit(f"--surge {exc}") from None
        if surge.end_s > duration:
            raise SystemExit(f"--surge {args.surge!r}: the window must end inside the run (END <= {duration:g} "
                             "virtual seconds)")
    try:
        max_tokens = check_max_tokens(getattr(args, "max_tokens", EXACT))
    except ValueError as exc:
        raise SystemExit(f"--max-tokens: {str(exc).removeprefix('max_tokens: ')}") from None
    names = chosen_systems(getattr(args, "systems", None))
    lb_file = None
    if getattr(args, "lb_config", None):
        try:  # the daemon's own parser and checks: the same messages as `lb check-config`
            lb_file = LBConfig.from_daemon_config(args.lb_config)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--lb-config {args.lb_config}: {exc}") from None
    if not names and lb_file is None:
        raise SystemExit("--systems named none: give at least one (`--systems list` names them) or --lb-config")
    out = Path(args.out)
    wall = time.perf_counter()
    capacity = capacity_for(name, out)
    loads = SWEEP if args.sweep else (args.load,)
    summaries = {}
    for load in loads:
        where = out / f"load-{load:g}" if args.sweep else out
        summaries[load] = run_load(name, seeds=seeds, load=load, capacity=capacity, duration_s=duration,
                                   workers=args.workers, out=where, stream=not args.no_stream, names=names,
                                   lb_file=lb_file, max_tokens=max_tokens,
                                   headers=not getattr(args, "no_session_headers", False), join_at_s=join_at, surge=surge)
        from bench.sim.compare_report import table

        print(f"\n{name}: load {load:g} x capacity {capacity:.2f} req/s, {seeds} seeds, {duration:g} s each"
              + (" (clients not streaming: TTFT is the engine's first token)" if args.no_stream else "")
              + (f" (clients declare max_tokens {max_tokens})" if max_tokens != EXACT else "")
              + (" (clients send no lb headers)" if getattr(args, "no_session_headers", False) else "")
              + (f" (each region's last replica joins at {join_at:g} s)" if join_at is not None else "")
              + (f" (offered x{surge.factor:g} from {surge.start_s:g} to {surge.end_s:g} s)" if surge else ""))
        print(table(summaries[load]))
    if args.sweep:
        from bench.sim.compare_report import sweep_plot

        sweep_plot(name, summaries, out)
    print(f"\n{name}: done in {time.perf_counter() - wall:.1f} s of wall time -> {out}")
    return 0
