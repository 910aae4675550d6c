"""`lb-bench cluster --config FILE`: a multi-region testbed on loopback.

N regions, each with its `lb`, its emulated replicas and (optionally) a client population;
between regions a one-way latency injected by `bench.delay_proxy` (peers are configured at
the proxy's ports; no production code path knows). Prints where everything listens, runs the
clients (or just stays up) for `duration_s`, prints each region's results and stops.

Config (TOML; see config/cluster-example.toml):

    duration_s = 60          # stops by itself
    one_way_ms = 50          # between any two regions unless [latency_ms] says otherwise
    mode = "peering"         # peering | region-local | central
    central = "us"           # mode central: the one LB, fronting every region's replicas
    [latency_ms]
    "us-asia" = 100          # one way, both directions
    [defaults]               # for every region: profile, speed, engine, policy, pushing,
    profile = "tiny"         #   peer_policy, tau, workload, params, emulator_args, lb (extra TOML sections)
    [[regions]]
    name = "us"
    replicas = 4
    clients = 30
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from bench.fleet import Fleet, Service, free_port
from bench.scenarios._lb import engine_time_config, merge_sections
from lb.core.peering import DEFAULT_TAU
from lb.core.policies import DEFAULT_POLICY

MODES = ("peering", "region-local", "central")


@dataclass
class RegionSpec:
    name: str
    replicas: int
    clients: int = 0


@dataclass
class ClusterSpec:
    regions: list[RegionSpec]
    one_way_ms: float = 50.0
    latency_ms: dict[str, float] = field(default_factory=dict)  # "a-b" → one-way ms
    mode: str = "peering"
    central: str | None = None
    duration_s: float = 60.0
    profile: str = "tiny"
    speed: float = 1.0
    engine: str = "sglang"
    policy: str = DEFAULT_POLICY
    peer_policy: str = "prefix-trie"
    pushing: str = "sp-pending"
    tau: int = DEFAULT_TAU
    workload: str = "multiturn"
    params: dict = field(default_factory=dict)
    lb: dict = field(default_factory=dict)  # extra TOML sections for every LB, e.g. {"queue": {...}}
    emulator_args: list[str] = field(default_factory=list)  # e.g. ["--max-running", "4"]
    seed: int = 0

    def latency(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        return float(self.latency_ms.get(f"{a}-{b}", self.latency_ms.get(f"{b}-{a}", self.one_way_ms)))


def load_spec(path: Path) -> ClusterSpec:
    data = tomllib.loads(Path(path).read_text())
    regions = [RegionSpec(r["name"], int(r.get("replicas", 1)), int(r.get("clients", 0))) for r in data.get("regions", [])]
    if not regions:
        raise ValueError(f"{path}: add at least one [[regions]] with name and replicas")
    known = {f for f in ClusterSpec.__dataclass_fields__} - {"regions"}
    kwargs = {k: v for k, v in data.get("defaults", {}).items() if k in known}
    kwargs.update({k: v for k, v in data.items() if k in known})
    spec = ClusterSpec(regions=regions, **kwargs)
    if spec.mode not in MODES:
        raise ValueError(f"{path}: mode {spec.mode!r}; use one of {', '.join(MODES)}")
    if spec.mode == "central" and spec.central not in {r.name for r in regions}:
        raise ValueError(f"{path}: mode central needs central = one of the region names")
    return spec


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def lb_toml(sections: dict, replicas: list[tuple[str, str]], peers: list[dict]) -> str:
    out = []
    for name, values in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        out.append("")
    for url, engine in replicas:
        out += ["[[replicas]]", f"url = {_toml_value(url)}", f"engine = {_toml_value(engine)}", ""]
    for p in peers:
        out.append("[[peers]]")
        out += [f"{k} = {_toml_value(v)}" for k, v in p.items()]
        out.append("")
    return "\n".join(out)


@dataclass
class Testbed:
    spec: ClusterSpec
    lbs: dict[str, Service]  # region → its LB (central mode: only the central one)
    client_targets: dict[str, str]  # region → the URL its clients use
    replicas: dict[str, list[Service]]
    routes: list[str]  # what the delay proxy does, for the printout

    def describe(self) -> str:
        lines = [f"testbed: mode {self.spec.mode}, {len(self.spec.regions)} regions, "
                 f"one-way latency {self.spec.one_way_ms:g} ms (overrides {self.spec.latency_ms or 'none'})"]
        for r in self.spec.regions:
            lb = self.lbs.get(r.name)
            lines.append(f"  {r.name:8s} lb {lb.url if lb else '(none: central)'}  clients → {self.client_targets[r.name]}"
                         f"  replicas {' '.join(s.url for s in self.replicas[r.name])}")
        lines += [f"  {route}" for route in self.routes]
        return "\n".join(lines)


def start_testbed(fleet: Fleet, spec: ClusterSpec) -> Testbed:
    """Start emulators, the delay proxy and the LBs of `spec` inside `fleet` (which stops them)."""
    secret = secrets.token_hex(16)
    replicas = {r.name: [fleet.emulator(f"{r.name}-emu{i}", profile=spec.profile, speed=spec.speed,
                                        seed=spec.seed + 100 * j + i, extra=list(spec.emulator_args))
                         for i in range(r.replicas)] for j, r in enumerate(spec.regions)}
    names = [r.name for r in spec.regions]
    lb_ports = {n: free_port() for n in names}
    routes: list[str] = []  # delay proxy --route args
    labels: list[str] = []

    def via_proxy(a: str, b: str, port: int) -> str:
        """URL at which `a` reaches 127.0.0.1:`port` in region `b`."""
        ms = spec.latency(a, b)
        if ms <= 0:
            return f"http://127.0.0.1:{port}"
        listen = free_port()
        routes.append(f"{listen}=127.0.0.1:{port}@{ms:g}")
        labels.append(f"{a} → {b}: 127.0.0.1:{listen} → :{port} (+{ms:g} ms each way)")
        return f"http://127.0.0.1:{listen}"

    probe_s = 0.1 / spec.speed  # the emulators run `speed`× faster: so does the 100 ms probe
    # and every other engine-time duration, `spec.lb`'s too
    base = engine_time_config(spec.speed, merge_sections(
        {"pushing": {"mode": spec.pushing}, "routing": {"policy": spec.policy}}, spec.lb))
    # A status crosses the link twice (three times on a fresh connection): wait for that,
    # and call a status stale only after a probe that slow has had time to fail and retry.
    rtt_s = 2 * max((spec.latency(a, b) for a in names for b in names), default=0.0) / 1000
    timeout_s = max(probe_s, 1.5 * rtt_s + 0.1)
    configs: dict[str, str] = {}
    client_targets: dict[str, str] = {}
    if spec.mode == "central":
        c = spec.central
        reps = [(via_proxy(c, r, int(s.url.rsplit(":", 1)[1])), spec.engine) for r in names for s in replicas[r]]
        configs[c] = lb_toml({**base, "server": {**base["server"], "port": lb_ports[c]}}, reps, [])
        client_targets = {r: via_proxy(r, c, lb_ports[c]) for r in names}
    else:
        for n in names:
            peers = [] if spec.mode == "region-local" else [
                {"region": p, "url": via_proxy(n, p, lb_ports[p]), "allowed_residency": ["*"]} for p in names if p != n]
            sections = {**base, "server": {**base["server"], "port": lb_ports[n]},
                        "peering": {"region": n, "policy": spec.peer_policy, "tau": spec.tau,
                                    "probe_interval_s": probe_s, "probe_timeout_s": timeout_s,
                                    "probe_timeout_max_s": max(2.0, timeout_s),
                                    "stale_intervals": math.ceil((timeout_s + rtt_s) / probe_s) + 1}}
            configs[n] = lb_toml(sections, [(s.url, spec.engine) for s in replicas[n]], peers)
            client_targets[n] = f"http://127.0.0.1:{lb_ports[n]}"
    if routes:
        health = free_port()
        fleet.start("delay-proxy", [sys.executable, "-m", "bench.delay_proxy", "--health-port", str(health),
                                    *[a for r in routes for a in ("--route", r)]], "/", health)
    lbs = {}
    for n, text in configs.items():
        path = fleet.log_dir / f"lb-{n}.toml"
        path.write_text(text)
        lbs[n] = fleet.start(f"lb-{n}", [sys.executable, "-m", "lb.daemon.cli", "serve", "--config", str(path)],
                             "/ready", lb_ports[n], env={"LB_PEER_SECRET": secret})
    if spec.mode == "peering":
        _wait_peers(lbs, len(names) - 1)
    return Testbed(spec, lbs, client_targets, replicas, [f"delay-proxy {label}" for label in labels])


def _wait_peers(lbs: dict[str, Service], n_peers: int, timeout: float = 30.0) -> None:
    """Until every LB has heard from every peer (so a run does not start half-connected)."""
    import urllib.request
    deadline = time.monotonic() + timeout
    for name, svc in lbs.items():
        while True:
            with urllib.request.urlopen(svc.url + "/metrics", timeout=5) as r:
                text = r.read().decode()
            healthy = sum(1 for line in text.splitlines() if line.startswith("lb_peer_healthy{") and line.endswith(" 1.0"))
            if healthy >= n_peers:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"lb-{name} sees {healthy} of {n_peers} peers after {timeout:.0f}s")
            time.sleep(0.05)


async def run_clients(tb: Testbed, duration_s: float, *, progress: bool = False) -> tuple[dict[str, dict], dict]:
    """Every region's client population at once against its own target: (per region, all together)."""
    from bench.client import run_bench
    from bench.stats import run_report

    spec = tb.spec
    jobs = {r.name: run_bench([tb.client_targets[r.name]], spec.workload, clients=r.clients, duration=duration_s,
                              seed=spec.seed + i, params=spec.params, progress=progress)
            for i, r in enumerate(spec.regions) if r.clients > 0}
    results = await asyncio.gather(*jobs.values())
    per_region = {name: result for name, (result, _) in zip(jobs, results)}
    records = [rec for _, recs in results for rec in recs]
    combined = run_report(records, max(res["duration_s"] for res in per_region.values()), duration_s, workload=spec.workload,
                          clients=sum(r.clients for r in spec.regions))
    return per_region, combined


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="testbed TOML (see config/cluster-example.toml)")
    parser.add_argument("--duration", type=float, help="override duration_s")
    parser.add_argument("--out", type=Path, help="write per-region results (JSON) here")


def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.config)
    duration = args.duration or spec.duration_s
    with Fleet() as fleet:
        tb = start_testbed(fleet, spec)
        print(tb.describe(), flush=True)
        print(f"logs in {fleet.log_dir}; running {duration:g}s", flush=True)
        if any(r.clients for r in spec.regions):
            results, combined = asyncio.run(run_clients(tb, duration))
            for name, res in {**results, "all": combined}.items():
                ttft = res.get("ttft_s") or {}
                print(f"  {name:8s} ok {res['ok']:5d}  {res['throughput_rps']:.2f} req/s  "
                      f"TTFT p50 {ttft.get('p50', float('nan')):.3f}s p90 {ttft.get('p90', float('nan')):.3f}s")
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=2) + "\n")
        else:
            time.sleep(duration)
    print("testbed stopped")
    return 0


def run_variant(log_dir: Path, spec: ClusterSpec, *, label: str, warnings: list[str]) -> dict:
    """One scenario variant on a fresh testbed: the combined run JSON with `per_region` and
    `machine` (CPU per process; a saturated machine is called out in `warnings`)."""
    from bench.fleet import CpuMeter, saturation_warning

    with Fleet(log_dir) as fleet:
        tb = start_testbed(fleet, spec)
        print(tb.describe(), flush=True)
        meter = CpuMeter(fleet)
        per_region, combined = asyncio.run(run_clients(tb, spec.duration_s))
        combined["machine"] = meter.result()
    combined["per_region"] = {name: {k: res[k] for k in ("ok", "errors", "throughput_rps", "ttft_s", "e2e_s")}
                              for name, res in per_region.items()}
    combined["replicas"] = {r.name: r.replicas for r in spec.regions}
    warning = saturation_warning(combined["machine"], f"[{label}] ")
    if warning:
        warnings.append(warning)
    print(f"[{label}] {combined['ok']} ok, {combined['throughput_rps']:.2f} req/s, TTFT p50 "
          f"{(combined['ttft_s'] or {}).get('p50')} p90 {(combined['ttft_s'] or {}).get('p90')}", flush=True)
    return combined
