"""Scenario `ha-pair-agents`: two `lb` instances of one region over one redis-server against one
`lb`, on tool-using agent sessions past the fleet's capacity (bench/workloads/agent.py).

Each request goes to the next instance in turn (an L4 balancer or a Service in front), so every
session's steps alternate between the two: what one instance leased or recognized, the other
must know (lb.daemon.instances: pushes, prefixes, answers, KV leases and interactions). With
`--no-session-headers` the clients send no `x-lb-*` header, as the `openai` SDK, and the
instances know a session only by its prompts. Reported per variant, medians over interleaved
rounds with their ranges: req/s, TTFT, cached-token ratio, sessions finished a second and the
engines' waiting queue (summed over the replicas, sampled every 0.1 s); notes give the pair's
ratios to one `lb`. Engines and tool runs `SPEED`x faster, every `lb` time constant divided alike.
Needs redis-server; run alone.
"""
from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

from bench.fleet import CpuMeter, Fleet, saturation_warning
from bench.scenarios._compare import combine_runs, host_busy_jiffies, host_cores_busy
from bench.scenarios._lb import engine_time_config, start_lb
from bench.scenarios.ha_pair import _redis, _sampler

DESCRIPTION = "two lb instances sharing redis vs one, agent sessions past capacity, requests alternating"
REPLICAS = 4
PROFILE = "l4-llama3-8b"
SPEED = 4.0
CLIENTS = 48  # past the 4 replicas' capacity (compare-agent's 32 keep them at it)
VARIANTS = {"one lb": 1, "two lb + redis": 2}


async def _drive(targets: list[str], emus: list[str], clients: int, seconds: float, lb_headers: bool) -> dict:
    from bench.client import run_bench

    stop, waiting = asyncio.Event(), []
    sampler = asyncio.ensure_future(_sampler(emus, stop, waiting))
    try:
        result, _ = await run_bench(targets, "agent", clients=clients, duration=seconds, seed=0, time_scale=SPEED,
                                    lb_headers=lb_headers)
    finally:
        stop.set()
        await sampler
    result["engine_waiting_mean"] = sum(waiting) / len(waiting) if waiting else 0.0
    return result


def _one_run(out_dir: Path, name: str, rnd: int, clients: int, seconds: float, lb_headers: bool) -> dict:
    procs: list = []
    try:
        with Fleet(out_dir / "logs" / f"{name.replace(' ', '-')}-{rnd}") as fleet:
            emus = [e.url for e in fleet.emulators(REPLICAS, profile=PROFILE, speed=SPEED, model="m")]
            prefix = f"ha-agents-{VARIANTS[name]}-{rnd}:"
            config = engine_time_config(SPEED, {"state": {"backend": "redis", "url": _redis(procs), "prefix": prefix}})
            lbs = [start_lb(fleet, emus, name=f"lb{i}", config=config) for i in range(VARIANTS[name])]
            if len(lbs) > 1:
                _await_subscribers(config["state"]["url"], prefix + "pushes", len(lbs))
            meter, before = CpuMeter(fleet), host_busy_jiffies()
            result = asyncio.run(_drive([lb.url for lb in lbs], emus, clients, seconds, lb_headers))
            result["machine"] = meter.result()
            result["machine"]["host_cores_busy"] = host_cores_busy(before, host_busy_jiffies(),
                                                                   result["machine"]["cores"])
            return result
    finally:  # after the LBs stopped
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def _await_subscribers(url: str, channel: str, n: int) -> None:
    """Every instance listens before the first push (else the first ones go unheard)."""
    import time

    import redis

    client = redis.Redis.from_url(url)
    try:
        for _ in range(200):
            if dict(client.pubsub_numsub(channel)).get(channel.encode()) == n:
                return
            time.sleep(0.05)
        raise RuntimeError(f"not every lb subscribed to {channel}")
    finally:
        client.close()


def run(out_dir: Path, quick: bool, repeats: int | None = None, duration: float | None = None,
        clients: int | None = None, lb_headers: bool = True) -> dict:
    repeats = repeats or (1 if quick else 3)
    seconds = duration or (15.0 if quick else 90.0)
    clients = clients or (16 if quick else CLIENTS)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    warnings, notes = [], []
    for rnd in range(repeats):  # interleaved: drift on the machine hits both alike
        for name in VARIANTS:
            result = _one_run(out_dir, name, rnd, clients, seconds, lb_headers)
            if (w := saturation_warning(result["machine"], f"[{name} run {rnd + 1}] ")):
                warnings.append(w)
            runs[name].append(result)
    variants = {name: combine_runs(rs) for name, rs in runs.items()}
    spread = {}
    for name, rs in runs.items():
        for key, get in (("req_per_s", lambda r: r["throughput_rps"]),
                         ("sessions_per_s", lambda r: r["programs"]["finished_rps"]),
                         ("engine_waiting", lambda r: r["engine_waiting_mean"]),
                         ("cached", lambda r: r["cached_token_ratio"]),
                         ("cores_busy", lambda r: r["machine"]["host_cores_busy"])):
            xs = [get(r) for r in rs]
            spread.setdefault(name, {})[key] = (statistics.median(xs), min(xs), max(xs))
        variants[name]["sessions_finished_per_s"] = spread[name]["sessions_per_s"][0]
        variants[name]["engine_waiting_mean"] = spread[name]["engine_waiting"][0]
    one, two = spread["one lb"], spread["two lb + redis"]
    ratio = variants["two lb + redis"]["throughput_rps"] / max(variants["one lb"]["throughput_rps"], 1e-9)
    sessions = (f"{two['sessions_per_s'][0] / one['sessions_per_s'][0]:.2f}x" if one["sessions_per_s"][0] else "-")
    notes.append(f"pair / one: throughput {ratio:.2f}x, sessions finished {sessions}, engines' waiting "
                 f"{two['engine_waiting'][0]:.2f} vs {one['engine_waiting'][0]:.2f}")
    for name, s in spread.items():
        notes.append(f"{name}: " + ", ".join(f"{k} {m:.3f} [{lo:.3f}, {hi:.3f}]" for k, (m, lo, hi) in s.items())
                     + f" (median [min, max] of {repeats})")
    notes.append(f"{clients} closed-loop agent clients, requests alternating between the instances; {REPLICAS} "
                 f"{PROFILE} emulators, engines and tool runs {SPEED:g}x faster, lb's time constants / {SPEED:g}; "
                 f"{seconds:g} s per run, {repeats} interleaved rounds"
                 + ("" if lb_headers else "; clients send no x-lb-* header"))
    return {"baseline": "one lb", "variants": variants, "warnings": warnings, "notes": notes}
