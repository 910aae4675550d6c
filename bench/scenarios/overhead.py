"""Scenario `overhead`: what a hop through `lb` costs, next to going direct and SGLang Router.

One fast emulator (the `tiny` profile sped up, so the engine's own time is small), reached
three ways over keep-alive connections: directly, through `lb` (default policy and pushing),
and through SGLang Router (`cache_aware`) when it is installed. Measured in interleaved rounds
so drift on the shared machine hits every target alike:
  - JSON latency: non-streaming requests one at a time (`e2e_s` p50/p99),
  - streaming TTFT: streaming requests one at a time (`ttft_s` p50/p99),
  - max req/s: non-streaming requests at a fixed concurrency (`throughput_rps`),
  - CPU per request: the proxy process's CPU time (/proc) over those requests, in µs
    (`cpu_us_per_request`, the median of the rounds): what a request costs the proxy, far
    steadier on a shared machine than its latency or its peak rate.
Notes give the added p50/p99 milliseconds over direct.
"""
from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

import aiohttp

from bench.fleet import CpuMeter, Fleet, cpu_seconds, saturation_warning
from bench.scenarios._lb import start_lb

DESCRIPTION = "added latency (JSON, streaming TTFT p50/p99) and max req/s: direct vs lb vs SGLang Router"
CONCURRENCY = 32  # as the issue measures max req/s
BODY = {"messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 4, "ignore_eos": True}


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def one(session: aiohttp.ClientSession, url: str, model: str, stream: bool) -> float:
    """Seconds to the first body byte (streaming) or to the whole body (JSON)."""
    t0 = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json={**BODY, "model": model, "stream": stream}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
        if stream:
            await r.content.readany()
            first = time.perf_counter() - t0
            await r.read()
            return first
        await r.read()
        return time.perf_counter() - t0


async def sequential(session, url: str, model: str, stream: bool, n: int) -> list[float]:
    return [await one(session, url, model, stream) for _ in range(n)]


async def max_rate(session, url: str, model: str, seconds: float) -> tuple[float, int, int]:
    """(req/s, errors, requests answered) at CONCURRENCY for `seconds`."""
    done, errors = 0, 0
    t_end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < t_end:
            try:
                await one(session, url, model, False)
                done += 1
            except Exception:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done / (time.perf_counter() - t0), errors, done


async def measure(targets: dict[str, str], pids: dict[str, int], model: str, rounds: int, n: int,
                  seconds: float) -> dict:
    """`pids`: the process whose CPU each target's requests cost (the emulator's for direct)."""
    lat = {name: {"json": [], "ttft": []} for name in targets}
    rate: dict[str, list[float]] = {name: [] for name in targets}
    cpu_us: dict[str, list[float]] = {name: [] for name in targets}
    errors = {name: 0 for name in targets}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as session:
        for name, url in targets.items():  # warm the pools and the emulator's caches
            await sequential(session, url, model, True, 5)
        for _ in range(rounds):
            for name, url in targets.items():
                lat[name]["json"] += await sequential(session, url, model, False, n)
                lat[name]["ttft"] += await sequential(session, url, model, True, n)
            for name, url in targets.items():
                cpu0 = cpu_seconds(pids[name])
                rps, errs, done = await max_rate(session, url, model, seconds)
                if done:
                    cpu_us[name].append(1e6 * (cpu_seconds(pids[name]) - cpu0) / done)
                rate[name].append(rps)
                errors[name] += errs
    out = {}
    for name in targets:
        j, t = lat[name]["json"], lat[name]["ttft"]
        out[name] = {
            "requests": len(j) + len(t), "ok": len(j) + len(t), "errors": errors[name],
            "throughput_rps": max(rate[name]),
            "cpu_us_per_request": quantile(cpu_us[name], 0.5),
            "e2e_s": {"p50": quantile(j, 0.5), "p90": quantile(j, 0.9), "p99": quantile(j, 0.99),
                      "mean": sum(j) / len(j)},
            "ttft_s": {"p50": quantile(t, 0.5), "p90": quantile(t, 0.9), "p99": quantile(t, 0.99),
                       "mean": sum(t) / len(t)},
            "ttft_quantiles_s": [quantile(t, i / 20) for i in range(21)],
        }
    return out


def run(out_dir: Path, quick: bool) -> dict:
    rounds, n, seconds = (2, 100, 3.0) if quick else (5, 200, 5.0)
    warnings, notes = [], []
    with Fleet(out_dir / "logs") as fleet:
        emu = fleet.emulator("emu", profile="tiny", speed=20.0, model="m")
        services = {"direct": emu, "lb": start_lb(fleet, [emu.url]),
                    "lb-blind": start_lb(fleet, [emu.url], name="lb-blind", pushing="blind", policy="round-robin")}
        if importlib.util.find_spec("sglang_router") is not None:
            services["sglang-router"] = fleet.sglang_router([emu.url], policy="cache_aware")
        else:
            notes.append("SGLang Router not installed (pip install sglang-router==0.3.2): its column is skipped")
        targets = {name: s.url for name, s in services.items()}
        meter = CpuMeter(fleet)
        variants = asyncio.run(measure(targets, {name: s.pid for name, s in services.items()}, "m", rounds, n, seconds))
        machine = meter.result()
        warning = saturation_warning(machine, "[overhead] ")
        if warning:
            warnings.append(warning)
    d = variants["direct"]
    for name, v in variants.items():
        v["machine"] = machine
        if name == "direct":
            continue
        added = {k: {q: (v[k][q] - d[k][q]) * 1000 for q in ("p50", "p99")} for k in ("e2e_s", "ttft_s")}
        v["added_ms"] = {"json": added["e2e_s"], "streaming_ttft": added["ttft_s"]}
        notes.append(f"{name} adds JSON p50 {added['e2e_s']['p50']:+.2f} ms / p99 {added['e2e_s']['p99']:+.2f} ms, "
                     f"streaming TTFT p50 {added['ttft_s']['p50']:+.2f} ms / p99 {added['ttft_s']['p99']:+.2f} ms; "
                     f"max {v['throughput_rps']:.0f} req/s vs direct {d['throughput_rps']:.0f} at concurrency {CONCURRENCY}; "
                     f"{v['cpu_us_per_request']:.0f} µs of its CPU per request")
    notes.append(f"{rounds} interleaved rounds of {n} sequential JSON + {n} streaming requests per target "
                 f"(max_tokens 4, tiny profile at 20× speed), then {seconds:g} s at concurrency {CONCURRENCY}")
    return {"baseline": "direct", "variants": variants, "warnings": warnings, "notes": notes}
