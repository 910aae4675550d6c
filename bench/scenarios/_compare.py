"""The comparison loop shared by the `compare-*` scenarios: one fleet shape, one workload,
each system in turn (bench/systems.py), the same numbers for all, and `report.md`.

Every system gets fresh emulators built from the same profile, replica count and seeds (so no
system inherits another's prefix cache) and the same bounded workload. While it runs, a
sampler reads every replica's `/get_load` (running + waiting) and the run records the mean
spread between the busiest and idlest replica. A system that is not installed, or fails to
start, is listed under `skipped` with the reason; nothing is dropped silently.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench import report, report_md
from bench.cluster import ClusterSpec, RegionSpec
from bench.fleet import SATURATION, CpuMeter, Fleet, saturation_warning
from bench.profiles import on_schedule_policy, on_sglang
from bench.systems import (DIRECT, System, lb, nginx, pick_names, sglang_router, start, start_regional, unavailable,
                           vllm_router)
from lb.core.policies import DEFAULT_POLICY

SAMPLE_EVERY_S = 0.25
# Each system runs this many times, the rounds interleaved (A B C, A B C, ...), so drift on a
# shared machine hits every system alike; figures are the median with the range.
DEFAULT_REPEATS = 3
# Other work than the run's own processes above this many cores during a run: say so.
FOREIGN_CORES_WARN = 0.3
REPEATED = (("throughput_rps",), ("ttft_s", "p50"), ("ttft_s", "p90"), ("e2e_s", "p50"),
            ("steady", "throughput_rps"), ("steady", "ttft_s", "p50"), ("steady", "ttft_s", "p90"),
            ("steady", "cached_token_ratio"), ("tenants", "p90_median_s"), ("tenants", "p90_worst_s"))
PAPER_REGIONS = ("us", "eu", "asia")
# SkyWalker's inter-region one-way latencies (as in scenario regional-skew), before time compression
PAPER_LATENCY_MS = {"us-eu": 40, "us-asia": 80, "eu-asia": 90}
SKYWALKER = ("SkyWalker (EuroSys'26) vs its baselines: 1.12–2.06× throughput, 1.74–6.30× lower latency")

# Third-party routers users would pick instead; `--quick` keeps one of each kind.
PEERS = [sglang_router("cache_aware"), sglang_router("round_robin"), sglang_router("power_of_two"),
         vllm_router("cache_aware"), vllm_router("power_of_two"), vllm_router("consistent_hash"),
         nginx("least_conn"), nginx("hash-session"), DIRECT]
QUICK_PEERS = [sglang_router("cache_aware"), nginx("least_conn"), DIRECT]


def systems(quick: bool, *, regional: bool) -> list[System]:
    """lb's variants worth showing, then the peers. Multi-region: lb per region with peering,
    and lb as one central coordinator like the peers; single region: SP-P and blind pushing."""
    if regional:
        ours = [lb(regional=True)] + ([] if quick else [lb(name=f"lb-central {DEFAULT_POLICY}/sp-pending")])
    else:
        ours = [lb()] + ([] if quick else [lb(pushing="blind")])
    return ours + (QUICK_PEERS if quick else PEERS)


def regions(clients: dict[str, int], replicas_per_region: int) -> list[RegionSpec]:
    return [RegionSpec(name, replicas_per_region, n) for name, n in clients.items()]


def compressed_latency(speed: float) -> dict[str, float]:
    """WAN latency in the same compressed time as the engines."""
    return {k: v / speed for k, v in PAPER_LATENCY_MS.items()}


@dataclass
class Compare:
    """One comparison: the fleet, the workload and the systems to put in front of it."""

    title: str
    scenario: str  # its `lb-bench scenario` name, for the report's command line
    workload: str
    systems: list[System]
    duration_s: float
    profile: str = "l4-llama3-8b"
    # None: every replica runs `profile`. Else every second one runs this instead (--mixed-engines:
    # SGLang's scheduler beside vLLM's on the same hardware)
    alt_profile: str | None = None
    speed: float = 1.0
    seed: int = 0
    params: dict = field(default_factory=dict)
    emulator_args: list[str] = field(default_factory=list)
    # single region
    replicas: int = 4
    clients: int = 8
    time_scale: float = 1.0  # open-loop replays and agents' tool runs
    # multi-region (when set): clients per region, replicas per region, one-way WAN latency
    regions: list[RegionSpec] | None = None
    latency_ms: dict[str, float] = field(default_factory=dict)
    central: str = "us"
    region_params: dict[str, dict] = field(default_factory=dict)  # per-region workload params
    quick: bool = False
    repeats: int = 1  # interleaved runs per system (lb-bench scenario compare-* --repeats N)
    stream: bool = True  # False: clients ask for whole answers (--no-stream)
    lb_headers: bool = True  # False: clients send none of lb's headers (--no-session-headers)
    options: list[str] = field(default_factory=list)  # the command line's other options, for the report
    notes: list[str] = field(default_factory=list)
    paper: list[str] = field(default_factory=list)  # the seed papers' headline numbers
    derived_notes: Callable[[dict[str, dict]], list[str]] | None = None  # variants → measured headline notes

    @property
    def deadline_s(self) -> float:
        return self.duration_s + max(10.0, self.duration_s / 2)


class LoadSampler:
    """Polls every replica's /get_load in a thread; `imbalance()` is the mean over samples of
    (max − min) running + waiting requests across replicas, `mean_outstanding()` their mean."""

    def __init__(self, replica_urls: list[str], every_s: float = SAMPLE_EVERY_S):
        self.urls, self.every_s = replica_urls, every_s
        self.samples: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def outstanding(url: str) -> int | None:
        try:
            with urllib.request.urlopen(url + "/get_load", timeout=1.0) as r:
                body = json.loads(r.read())
        except (OSError, ValueError):
            return None
        entries = body if isinstance(body, list) else [body]
        return sum(int(e.get("num_reqs", 0)) for e in entries if isinstance(e, dict))

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            loads = [self.outstanding(u) for u in self.urls]
            if all(x is not None for x in loads):
                self.samples.append(loads)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def result(self) -> dict:
        if not self.samples:
            return {"imbalance": None, "mean_outstanding": None, "samples": 0}
        spread = [max(s) - min(s) for s in self.samples]
        return {"imbalance": sum(spread) / len(spread),
                "mean_outstanding": sum(sum(s) / len(s) for s in self.samples) / len(self.samples),
                "samples": len(self.samples)}


def host_busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot (/proc/stat), so a run can
    tell that *other* work on a shared machine, not only its own fleet, ate the cores."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def host_cores_busy(before: tuple[int, int], after: tuple[int, int], cores: int) -> float:
    total = after[1] - before[1]
    return round(cores * (after[0] - before[0]) / total, 3) if total > 0 else 0.0


def _slug(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]+", "-", name).strip("-")


def cluster_spec(c: Compare) -> ClusterSpec:
    return ClusterSpec(regions=c.regions, latency_ms=c.latency_ms, duration_s=c.duration_s, profile=c.profile,
                       speed=c.speed, emulator_args=list(c.emulator_args), workload=c.workload, params=c.params,
                       seed=c.seed, central=c.central)


async def _regional_clients(c: Compare, targets: dict[str, list[str]]) -> dict:
    """Every region's population at once against its own targets (seeds as in bench.cluster)."""
    from bench.client import run_bench
    from bench.stats import run_report

    jobs = {r.name: run_bench(targets[r.name], c.workload, clients=r.clients, duration=c.duration_s,
                              deadline=c.deadline_s, seed=c.seed + i,
                              params={**c.params, **c.region_params.get(r.name, {})}, stream=c.stream,
                              lb_headers=c.lb_headers)
            for i, r in enumerate(c.regions) if r.clients > 0}
    results = await asyncio.gather(*jobs.values())
    records = [rec for _, recs in results for rec in recs]
    combined = run_report(records, max(res["duration_s"] for res, _ in results), c.duration_s, workload=c.workload,
                          clients=sum(r.clients for r in c.regions))
    combined["per_region"] = {name: {k: res[k] for k in ("ok", "errors", "throughput_rps", "ttft_s", "e2e_s")}
                              for name, (res, _) in zip(jobs, results)}
    return combined


def measure(c: Compare, system: System, log_dir: Path) -> dict:
    """One system on a fresh fleet: the run JSON plus `machine` and `load`."""
    with Fleet(log_dir) as fleet:
        if c.regions:
            regional = start_regional(system, fleet, cluster_spec(c), c.central)
            replica_urls = [u for urls in regional.replicas.values() for u in urls]
            run = lambda: _regional_clients(c, regional.client_targets)
        else:
            emus = fleet.emulators(c.replicas, profile=c.profile, alt_profile=c.alt_profile, speed=c.speed,
                                   seed=c.seed, extra=list(c.emulator_args))
            replica_urls = [e.url for e in emus]
            targets = start(system, fleet, replica_urls, speed=c.speed)
            run = lambda: _single(c, targets)
        meter, host_before = CpuMeter(fleet), host_busy_jiffies()
        with LoadSampler(replica_urls) as sampler:
            result = asyncio.run(run())
        result["machine"] = meter.result()
        result["machine"]["host_cores_busy"] = host_cores_busy(host_before, host_busy_jiffies(),
                                                               result["machine"]["cores"])
        result["load"] = sampler.result()
    result["system"] = {"family": system.family, "policy": system.policy, "pushing": system.pushing,
                        "regional": system.regional}
    return result


async def _single(c: Compare, targets: list[str]) -> dict:
    from bench.client import run_bench

    result, _ = await run_bench(targets, c.workload, clients=c.clients, duration=c.duration_s, deadline=c.deadline_s,
                                seed=c.seed, time_scale=c.time_scale, params=c.params, stream=c.stream,
                                lb_headers=c.lb_headers)
    return result


def _figure(result: dict, path: tuple[str, ...]) -> float | None:
    x = result
    for k in path:
        x = x.get(k) if isinstance(x, dict) else None
    return x if isinstance(x, (int, float)) else None


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def combine_runs(runs: list[dict]) -> dict:
    """One system's repeated runs as one variant: the run with the median throughput (its
    TTFT CDF is what the plot shows), with throughput, TTFT p50/p90 and E2E p50 replaced by
    the medians over the runs, and `repeats` holding each figure's median, min and max and
    every run's figures (so ratios to other systems are ratios of medians)."""
    ranked = sorted(runs, key=lambda r: r.get("throughput_rps") or 0.0)
    out = json.loads(json.dumps(ranked[(len(ranked) - 1) // 2]))  # a copy
    figures = {}
    for path in REPEATED:
        values = [_figure(r, path) for r in runs]
        known = [v for v in values if v is not None]
        figures[".".join(path)] = {"median": _median(known), "min": min(known, default=None),
                                   "max": max(known, default=None), "runs": values}
        target = out
        for k in path[:-1]:
            target = target.setdefault(k, {})
        target[path[-1]] = _median(known)
    out["repeats"] = {"runs": len(runs), "figures": figures,
                      "foreign_cores": [r["machine"].get("foreign_cores") for r in runs]}
    return out


def foreign_cores(machine: dict) -> float:
    """Cores busy with work outside the run's own processes (fleet, LBs, clients)."""
    return round(max(0.0, machine.get("host_cores_busy", 0.0) - machine.get("cores_used", 0.0)), 3)


# The system `--lb-config FILE` adds (as `lb-bench sim-compare --lb-config` does)
LB_FROM_FILE = "lb config"
# Sections of an operator's file the scenario sets itself: its replicas, ports and logs
SCENARIO_SECTIONS = ("server", "replicas", "discovery", "peers")


def lb_from_file(path: str, *, regional: bool) -> System:
    """`lb` with an operator's own daemon config (checked as `lb check-config` checks it):
    every section but the scenario's own (`SCENARIO_SECTIONS`); its durations are taken as
    engine time and divided by the emulators' speed-up like the defaults (bench.systems)."""
    import tomllib

    from lb.daemon.config import load
    try:
        cfg = load(path)
        with open(path, "rb") as f:
            sections = tomllib.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--lb-config {path}: {exc}") from None
    sections = {k: v for k, v in sections.items() if k not in SCENARIO_SECTIONS and isinstance(v, dict)}
    return lb(cfg.routing.policy, cfg.pushing.mode, regional=regional, name=LB_FROM_FILE, config=sections)


def with_run_options(c: Compare, repeats: int | None, stream: bool = True, duration: float | None = None,
                     systems: str | None = None, clients: int | None = None, lb_config: str | None = None,
                     lb_headers: bool = True, schedule_policy: str | None = None,
                     mixed_engines: bool = False) -> Compare:
    """The command line's run options. `--repeats N`; unset: DEFAULT_REPEATS for a full run, 1
    for a --quick smoke run. `--no-stream` (stream False): every client asks for whole answers.
    `--duration S`: each run's length (a longer one has a longer steady state after its
    warm-up). `--systems A,B`: only the systems of those names (as the report lists them).
    `--clients N`: closed-loop clients (one region's scenarios; past the default the fleet
    runs past its capacity). `--lb-config FILE`: also `lb` with that daemon config, as the
    system `lb config`. `--no-session-headers` (lb_headers False): clients send none of lb's
    headers, as third-party clients (the peers that hash `X-LB-Session` then hash nothing).
    `--schedule-policy P`: a scenario on SGLang's scheduler runs its engines with their waiting
    queue in P's order (bench.profiles.on_schedule_policy). `--mixed-engines`: every second
    replica on SGLang's scheduler (arrival order, as it ships), the rest as the scenario has them."""
    n = repeats if repeats is not None else (1 if c.quick else DEFAULT_REPEATS)
    if n < 1:
        raise SystemExit("--repeats must be >= 1")
    c.repeats = n
    c.stream = stream
    if duration is not None:
        if duration <= 0:
            raise SystemExit("--duration must be > 0")
        c.duration_s = duration
        c.options.append(f"--duration {duration:g}")
    if schedule_policy is not None:
        try:
            profile = on_schedule_policy(c.profile, schedule_policy)
        except ValueError as e:
            raise SystemExit(f"--schedule-policy: {c.scenario}: {e}") from None
        if profile != c.profile:
            c.notes = [*c.notes, f"--schedule-policy {schedule_policy}: the replicas are {profile} (waiting queue "
                                 f"{'longest cached prefix first' if schedule_policy == 'lpm' else 'in arrival order'}), "
                                 f"not {c.profile}; the load is the scenario's, so its share of capacity differs"]
            c.profile = profile
        c.options.append(f"--schedule-policy {schedule_policy}")
    if mixed_engines:
        if c.regions is not None:
            raise SystemExit(f"--mixed-engines: {c.scenario} runs three regions; it takes --mixed-engines only in one")
        try:
            alt = on_sglang(c.profile)
        except ValueError as e:
            raise SystemExit(f"--mixed-engines: {c.scenario}: {e}") from None
        c.alt_profile = alt
        c.options.append("--mixed-engines")
        c.notes = [*c.notes, f"--mixed-engines: every second replica is {alt} (SGLang's scheduler), the rest {c.profile}"]
    if clients is not None:
        from bench.client import is_open_loop
        from bench.workloads import make_workload
        if c.regions is not None:
            raise SystemExit(f"--clients: {c.scenario} sets its clients per region; it takes --clients only in one region")
        if is_open_loop(make_workload(c.workload, seed=c.seed, **c.params)):
            raise SystemExit(f"--clients: {c.scenario} replays its trace open loop; it has no closed-loop clients")
        if clients < 1:
            raise SystemExit("--clients must be >= 1")
        if clients != c.clients:
            c.notes = [*c.notes, f"--clients {clients}: {clients} closed-loop clients, not the scenario's {c.clients}"]
        c.clients = clients
        c.options.append(f"--clients {clients}")
    if systems:
        known = {s.name: s for s in c.systems}
        wanted = pick_names(systems, list(known))
        c.systems = [known[name] for name in wanted]
        c.options.append(f"--systems '{','.join(wanted)}'")
    if lb_config:
        c.systems = [*c.systems, lb_from_file(lb_config, regional=c.regions is not None)]
        c.options.append(f"--lb-config {lb_config}")
    if not lb_headers:
        c.lb_headers = False
        c.options.append("--no-session-headers")
        c.notes = [*c.notes, "clients send no x-lb-* header (the openai SDK's way): the OpenAI `user` field only"]
    if not stream:
        c.options.append("--no-stream")
        c.notes = [*c.notes, "clients ask for whole answers (stream: false): no TTFT, compare E2E"]
    return c


def scenario_runner(compare: Callable[[bool], Compare]) -> Callable[..., dict]:
    """A compare-* scenario's `run`, as `lb-bench scenario NAME [options]` calls it."""
    def run(out_dir: Path, quick: bool, repeats: int | None = None, stream: bool = True,
            duration: float | None = None, systems: str | None = None, clients: int | None = None,
            lb_config: str | None = None, lb_headers: bool = True, schedule_policy: str | None = None,
            mixed_engines: bool = False, speed: float | None = None) -> dict:
        return run_compare(with_run_options(at_speed(compare, quick, speed), repeats, stream, duration, systems,
                                            clients, lb_config, lb_headers, schedule_policy, mixed_engines), out_dir)
    return run


def at_speed(compare: Callable[..., Compare], quick: bool, speed: float | None) -> Compare:
    """The scenario at `--speed F` (None: its own). The scenario builds everything that follows
    the speed-up from it (engines, replays and tool runs, lb's time constants, WAN latency), so
    a slower run keeps the same experiment in engine time, with less of it in a run's seconds."""
    if speed is None:
        return compare(quick)
    if not (speed > 0 and math.isfinite(speed)):
        raise SystemExit(f"--speed must be a finite number > 0 (got {speed:g}); e.g. --speed 2")
    c = compare(quick, speed)
    c.options.append(f"--speed {speed:g}")
    return c


def run_compare(c: Compare, out_dir: Path) -> dict:
    """Every system of `c`, `c.repeats` interleaved rounds; writes report.md and plots;
    returns the scenario summary."""
    runs: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    warnings: list[str] = []
    rounds = max(1, c.repeats)
    for k in range(rounds):
        for system in c.systems:
            if system.name in skipped:
                continue
            reason = unavailable(system)
            if reason:
                skipped[system.name] = reason
                print(f"[{system.name}] skipped: {reason}", flush=True)
                continue
            log_dir = out_dir / "logs" / _slug(system.name) / (f"run-{k + 1}" if rounds > 1 else "")
            print(f"[{system.name}] run {k + 1}/{rounds}: {c.duration_s:g} s …", flush=True)
            try:
                result = measure(c, system, log_dir)
            except Exception as e:  # one system failing to start must not hide the others
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                skipped[system.name] = f"failed: {first} (logs: {log_dir})"
                runs.pop(system.name, None)
                print(f"[{system.name}] {skipped[system.name]}", flush=True)
                continue
            m = result["machine"]
            m["foreign_cores"] = foreign_cores(m)
            runs.setdefault(system.name, []).append(result)
            warning = saturation_warning(m, f"[{system.name} run {k + 1}] ")
            if warning:
                warnings.append(warning + slower_hint(c.speed))
            if m["foreign_cores"] > FOREIGN_CORES_WARN:
                warnings.append(f"[{system.name} run {k + 1}] other work took {m['foreign_cores']:.2f} cores "
                                f"(> {FOREIGN_CORES_WARN}) while it ran (the machine {m['host_cores_busy']:.2f} of "
                                f"{m['cores']} busy): its numbers carry that noise")
            ttft = result.get("ttft_s") or {}
            print(f"[{system.name}] {result['ok']} ok, {result['errors']} errors, {result['throughput_rps']:.2f} req/s, "
                  f"TTFT p50 {ttft.get('p50')} p90 {ttft.get('p90')}, imbalance {result['load']['imbalance']}, "
                  f"foreign cores {m['foreign_cores']:.2f}", flush=True)
    variants = {name: combine_runs(rs) for name, rs in runs.items()}
    notes = list(c.notes)
    if rounds > 1:
        notes.append(f"each system ran {rounds} times, rounds interleaved; figures are medians over the runs "
                     f"(ratios are ratios of medians), ranges below; the TTFT CDF is each system's median-throughput run")
        for name, v in variants.items():
            f = v["repeats"]["figures"]
            thr, p90 = f["throughput_rps"], f["ttft_s.p90"]
            notes.append(f"{name}: throughput {_fmt(thr)} req/s, TTFT p90 {_fmt(p90, 1000)} ms "
                         f"(median [min, max] of {len(f['throughput_rps']['runs'])})")
    summary = {"title": c.title,
               "command": f"lb-bench scenario {c.scenario}{' --quick' if c.quick else ''} --repeats {rounds} "
                          + "".join(f"{o} " for o in c.options) + f"--out {out_dir}",
               "baseline": next((n for n in variants if variants[n]["system"]["family"] == "lb"),
                                                   next(iter(variants), None)),
               "variants": variants, "skipped": skipped, "warnings": warnings,
               "notes": notes + (c.derived_notes(variants) if c.derived_notes else []), "paper": list(c.paper), "setup": setup(c)}
    if variants:
        report.plot_ttft_cdfs(variants, out_dir / "ttft_cdf.png")
        report.plot_throughput(variants, out_dir / "throughput.png")
    (out_dir / "report.md").write_text(report_md.scenario_markdown(summary, plots={"TTFT CDF": "ttft_cdf.png",
                                                                                   "throughput": "throughput.png"}))
    return summary


def slower_hint(speed: float) -> str:
    """What a run that kept the machine's cores busy can do about it: every millisecond an
    emulator waits for a core counts `speed` times in engine time, so a slower run measures
    the same experiment with cores to spare."""
    if speed <= 1:
        return ""
    return f"; run it slower to see past the CPU: --speed {max(1.0, speed / 2):g} (the same engine time)"


def _fmt(fig: dict, scale: float = 1.0) -> str:
    if fig["median"] is None:
        return "-"
    return f"{fig['median'] * scale:.2f} [{fig['min'] * scale:.2f}, {fig['max'] * scale:.2f}]"


def setup(c: Compare) -> dict:
    base = {"workload": c.workload, "params": c.params, "profile": c.profile, "alt_profile": c.alt_profile,
            "speed": c.speed, "seed": c.seed,
            "duration_s": c.duration_s, "emulator_args": c.emulator_args}
    if c.regions:
        return {**base, "regions": {r.name: {"replicas": r.replicas, "clients": r.clients} for r in c.regions},
                "latency_ms": c.latency_ms, "central": c.central, "region_params": c.region_params}
    return {**base, "replicas": c.replicas, "clients": c.clients, "time_scale": c.time_scale}
