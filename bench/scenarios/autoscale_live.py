"""Scenario `autoscale-live`: `lb`'s capacity loop scales emulated replicas up and down.

A day of ServeGen traffic (m-small, 43 clients summed; from the night trough through the
evening peak to the next night's trough; derived: compressed to the run's length, rates
scaled so the peak is `peak_rps`) is replayed open-loop with Azure-conversation request
sizes. Two variants over the same arrivals:

- `autoscaled` — one static emulator plus `lb serve` with `[scaling] strategy = "reactive"`
  and the `local` actuator: the capacity loop starts emulators as effective KV passes 70 %
  and drains and stops them below 30 %.
- `static-peak` — as many emulators as the autoscaled run reached at its peak, all the
  time: what provisioning for the peak costs.

Reported per variant: SLO attainment (TTFT ≤ `slo_ttft_s`), the client's latency figures,
instance-seconds (autoscaled: registered replicas integrated over the run, sampled from
`lb_pool_replicas`, so emulator start-up seconds are not counted), and the timeline of
replicas, desired replicas, effective KV and queue-latency p95 (`timeline.png`).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench import traces
from bench.client import Bench
from bench.fleet import CpuMeter, Fleet, free_port, saturation_warning
from bench.workloads.azure_conv import scaled
from bench.workloads.base import RequestSpec, pseudo_text

DESCRIPTION = "lb + local actuator scale emulators up/down under a compressed ServeGen day vs a static-peak fleet"
EMULATOR = ["--profile", "tiny", "--kv-tokens", "640"]  # a small KV: a handful of requests fill a replica
MAX_REPLICAS = 4
SAMPLE_S = 0.5


def day_shape(windows: int = 144) -> tuple[list[float], str]:
    """Relative request rate per 10-min window (peak 1.0), trough to trough of a ServeGen day."""
    clients = traces.servegen_clients()
    total = [0.0] * (2 * windows)
    for ws in clients.values():
        for w in ws[: 2 * windows]:
            total[int(w.start // traces.SERVEGEN_WINDOW_S)] += w.rate
    trough = min(range(windows), key=total.__getitem__)
    day = total[trough: trough + windows]
    peak = max(day)
    return [v / peak for v in day], f"ServeGen m-small aggregate, windows {trough}..{trough + windows - 1} (derived)"


@dataclass
class Ramp:
    """Open-loop Poisson arrivals following `shape`, compressed into `duration_s`."""

    shape: list[float]
    duration_s: float
    peak_rps: float
    seed: int = 0
    name: str = "servegen-day-ramp"

    def arrivals(self) -> Iterator[RequestSpec]:
        rng = random.Random(self.seed)
        sizes = [(r.context_tokens, r.generated_tokens) for r in traces.azure_conv()]
        step = self.duration_s / len(self.shape)
        t, i = 0.0, 0
        for w, rel in enumerate(self.shape):
            end, rate = (w + 1) * step, max(1e-6, rel * self.peak_rps)
            t = max(t, w * step)
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    t = end
                    break
                prompt, output = rng.choice(sizes)
                yield RequestSpec(request_id=f"ramp-{i}", at=t, user="ramp", app="ramp",
                                  messages=[{"role": "user", "content": pseudo_text(f"ramp/{self.seed}/{i}",
                                                                                    scaled(prompt, 0.1, 200))}],
                                  max_tokens=scaled(output, 0.3, 64))
                i += 1


def scaling_toml(python: str) -> str:
    argv = [python, "-m", "bench.cli", "emulate", "--host", "{host}", "--port", "{port}", "--model", "{model}",
            *EMULATOR]
    return f"""[scaling]
strategy = "reactive"
interval_s = 0.5
min_interval_s = 1.0
[scaling.params]
min_replicas = 1
max_replicas = {MAX_REPLICAS}
high = 0.7
low = 0.3
cooldown_s = 3.0
[[scaling.actuators]]
type = "local"
argv = {json.dumps(argv)}
"""


def start_lb(fleet: Fleet, urls: list[str], config: Path | None, name: str):
    port = free_port()
    args = [sys.executable, "-m", "lb.daemon.cli", "serve", "--port", str(port), "--engine", "sglang",
            *[a for u in urls for a in ("--replica", u)]]
    if config is not None:
        args += ["--config", str(config)]
    return fleet.start(name, args, "/ready", port)


async def sample(url: str, t0: float, timeline: list[dict], stop: asyncio.Event) -> None:
    """Pool gauges from the LB's /metrics every SAMPLE_S seconds."""
    wanted = {"lb_pool_replicas": "replicas", "lb_desired_replicas": "desired",
              "lb_pool_effective_kv_usage": "kv", "lb_queue_latency_p95_seconds": "queue_p95_s",
              "lb_tokens_in_flight": "tokens_in_flight"}
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while not stop.is_set():
            try:
                async with s.get(url + "/metrics") as r:
                    text = await r.text()
                row = {"t": round(loop.time() - t0, 2)}
                for fam in text_string_to_metric_families(text):
                    if fam.name in wanted and fam.samples:
                        row[wanted[fam.name]] = sum(x.value for x in fam.samples)
                timeline.append(row)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_S)
            except asyncio.TimeoutError:
                pass


async def drive(lb_url: str, ramp: Ramp, timeline: list[dict]):
    bench = Bench([lb_url], ramp, model="m", clients=1, duration=ramp.duration_s, requests=None,
                  time_scale=1.0, deadline=ramp.duration_s + 60.0, progress=False)
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample(lb_url, asyncio.get_running_loop().time(), timeline, stop))
    try:
        return await bench.run()
    finally:
        stop.set()
        await sampler


def instance_seconds(timeline: list[dict], duration_s: float) -> float:
    """Replicas integrated over [0, duration_s], step-wise between samples."""
    rows = [r for r in timeline if "replicas" in r and r["t"] <= duration_s]
    if rows:  # before the loop's first round the pool already had its first replica
        rows = [{"t": 0.0, "replicas": rows[0]["replicas"]}, *rows]
    total = 0.0
    for a, b in zip(rows, rows[1:] + [{"t": duration_s}]):
        total += a["replicas"] * max(0.0, b["t"] - a["t"])
    return total


def variant(fleet: Fleet, lb_url: str, ramp: Ramp, slo_ttft_s: float, warnings: list[str], label: str) -> dict:
    meter = CpuMeter(fleet)
    timeline: list[dict] = []
    result, records = asyncio.run(drive(lb_url, ramp, timeline))
    result["machine"] = meter.result()
    warning = saturation_warning(result["machine"], f"[{label}] ")
    if warning:
        warnings.append(warning)
    met = sum(1 for r in records if r.ok and r.ttft is not None and r.ttft <= slo_ttft_s)
    result["slo_attainment"] = round(met / len(records), 4) if records else None
    result["timeline"] = timeline
    per_s = [0] * (int(ramp.duration_s) + 1)
    for r in records:
        per_s[min(len(per_s) - 1, int(r.start))] += 1
    result["arrivals_per_s"] = per_s
    return result


def settings(quick: bool) -> dict:
    return {"duration_s": 30.0 if quick else 120.0, "peak_rps": 24.0, "slo_ttft_s": 1.0}


def run(out_dir: Path, quick: bool) -> dict:
    s = settings(quick)
    shape, source = day_shape()
    ramp = Ramp(shape, s["duration_s"], s["peak_rps"])
    out_dir.mkdir(parents=True, exist_ok=True)
    variants, warnings = {}, []
    with Fleet(out_dir / "logs" / "autoscaled") as fleet:
        config = fleet.log_dir / "scaling.toml"
        config.write_text(scaling_toml(sys.executable))
        emu = fleet.emulator("static0", model="m", extra=EMULATOR[2:], profile="tiny")
        lb = start_lb(fleet, [emu.url], config, "lb")
        auto = variant(fleet, lb.url, ramp, s["slo_ttft_s"], warnings, "autoscaled")
    peak = int(max((r.get("replicas", 1) for r in auto["timeline"]), default=1))
    auto["instance_seconds"] = round(instance_seconds(auto["timeline"], auto["duration_s"]), 1)
    auto["peak_replicas"] = peak
    variants["autoscaled"] = auto
    with Fleet(out_dir / "logs" / "static-peak") as fleet:
        emus = [fleet.emulator(f"emu{i}", model="m", seed=i, extra=EMULATOR[2:], profile="tiny") for i in range(peak)]
        lb = start_lb(fleet, [e.url for e in emus], None, "lb")
        static = variant(fleet, lb.url, ramp, s["slo_ttft_s"], warnings, "static-peak")
    static["instance_seconds"] = round(peak * static["duration_s"], 1)
    static["peak_replicas"] = peak
    variants["static-peak"] = static
    saved = 1 - auto["instance_seconds"] / static["instance_seconds"] if static["instance_seconds"] else 0.0
    notes = [f"arrivals: {source}, compressed to {s['duration_s']:.0f} s, peak {s['peak_rps']:.0f} req/s "
             f"(trough {min(shape) * s['peak_rps']:.1f}); sizes from Azure conv ×0.1 prompt (≤200), ×0.3 output (≤64)",
             f"emulators: {' '.join(EMULATOR)}; reactive strategy (70 %/30 % effective KV, 3 s cooldown, "
             f"1..{MAX_REPLICAS} replicas), local actuator; SLO: TTFT ≤ {s['slo_ttft_s']} s",
             f"measured: autoscaled {auto['instance_seconds']:.0f} instance-s at SLO attainment "
             f"{auto['slo_attainment']:.1%} vs static-peak ({peak} replicas) {static['instance_seconds']:.0f} "
             f"instance-s at {static['slo_attainment']:.1%}: {saved:.0%} fewer instance-seconds",
             "PreServe reports −49 % resources vs static provisioning with minimal SLO violations"]
    plot(variants, out_dir / "timeline.png")
    return {"scenario": "autoscale-live", "baseline": "static-peak", "variants": variants,
            "warnings": warnings, "notes": notes, "instance_seconds_saved": round(saved, 3)}


def plot(variants: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    auto = variants["autoscaled"]
    tl = auto["timeline"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step([r["t"] for r in tl], [r.get("replicas", 0) for r in tl], where="post", label="replicas (autoscaled)")
    ax.step([r["t"] for r in tl], [r.get("desired", 0) for r in tl], where="post", linestyle=":", label="desired")
    ax.axhline(variants["static-peak"]["peak_replicas"], color="grey", linestyle="--", label="static peak")
    ax.set_xlabel("seconds")
    ax.set_ylabel("replicas")
    ax2 = ax.twinx()
    ax2.plot(range(len(auto["arrivals_per_s"])), auto["arrivals_per_s"], color="tab:red", alpha=0.4, label="arrivals/s")
    ax2.set_ylabel("arrivals per second")
    ax.legend(loc="upper left")
    ax.set_title("autoscale-live: lb capacity loop + local actuator")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
