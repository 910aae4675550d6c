"""Scenario `ha-pair`: two `lb` instances of one region (sharing a redis-server: rate windows,
service counters, pushes and prefix history, lb.daemon.instances) vs one, over the same
emulated fleet and the same multi-turn workload.

Clients pick an instance at random per request, as behind an L4 balancer or a Service, so a
conversation's turns reach both. Reported per variant: requests/s, the cached-token ratio
(cached / prompt tokens in the engines' usage), and the engines' waiting queue (mean and max
of `num_waiting_reqs`, sampled every 0.1 s). The fleet is fast (Llama-3-8B on L4, emulated 20x faster) so the
LB's own CPU is what limits throughput; notes give the pair's ratios to one instance (issue
15 wants cached ratio and waiting within 5 %, throughput >= 1.8x). Needs redis-server; run
alone, on a machine with enough cores for two LBs plus the emulators and the clients.
"""
from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

from bench.fleet import CpuMeter, Fleet, free_port, saturation_warning
from bench.scenarios._lb import start_lb

DESCRIPTION = "two lb instances sharing redis vs one: req/s, cached-token ratio, engine waiting (multi-turn)"
REPLICAS = 4
PROFILE = "l4-llama3-8b"
SPEED = 20.0


async def _sampler(urls: list[str], stop: asyncio.Event, out: list[int]) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            total = 0
            for u in urls:
                try:
                    async with s.get(u + "/get_load") as r:
                        total += (await r.json())[0]["num_waiting_reqs"]
                except (aiohttp.ClientError, ValueError, KeyError):
                    pass
            out.append(total)
            await asyncio.sleep(0.1)


async def _drive(targets: list[str], emus: list[str], clients: int, turns: int, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    done = errors = prompt = cached = 0
    waiting: list[int] = []
    stop = asyncio.Event()
    t_end = time.perf_counter() + seconds

    async def client(c: int, session: aiohttp.ClientSession) -> None:
        nonlocal done, errors, prompt, cached
        conv = 0
        while time.perf_counter() < t_end:
            history = f"client {c} conversation {conv}: " + " ".join(f"w{c}-{conv}-{i}" for i in range(150))
            for t in range(turns):
                if time.perf_counter() >= t_end:
                    return
                history += f" turn {t} question " + " ".join(f"q{t}-{i}" for i in range(20))
                body = {"model": "m", "messages": [{"role": "user", "content": history}], "max_tokens": 8,
                        "ignore_eos": True}
                try:
                    async with session.post(rng.choice(targets) + "/v1/chat/completions", json=body) as r:
                        doc = await r.json()
                    if r.status != 200:
                        errors += 1
                        continue
                    u = doc["usage"]
                    done += 1
                    prompt += u["prompt_tokens"]
                    cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                except (aiohttp.ClientError, ValueError, KeyError):
                    errors += 1
            conv += 1

    sampler = asyncio.ensure_future(_sampler(emus, stop, waiting))
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(c, session) for c in range(clients)))
    elapsed = time.perf_counter() - t0
    stop.set()
    await sampler
    return {"requests": done + errors, "ok": done, "errors": errors, "throughput_rps": done / elapsed,
            "cached_token_ratio": cached / prompt if prompt else 0.0,
            "engine_waiting": {"mean": sum(waiting) / len(waiting) if waiting else 0.0, "max": max(waiting, default=0)}}


def _redis(procs: list) -> str:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("ha-pair needs redis-server (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(proc)
    import redis
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            if client.ping():
                break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    return f"redis://127.0.0.1:{port}/0"


def run(out_dir: Path, quick: bool) -> dict:
    clients, turns, seconds = (16, 4, 8.0) if quick else (48, 6, 30.0)
    variants, warnings, notes = {}, [], []
    for name, instances in (("one lb", 1), ("two lb + redis", 2)):
        procs: list = []
        try:
            with Fleet(out_dir / "logs" / name.replace(" ", "-")) as fleet:
                emus = [e.url for e in fleet.emulators(REPLICAS, profile=PROFILE, speed=SPEED, model="m")]
                state = {"backend": "redis", "url": _redis(procs), "prefix": f"ha-pair-{instances}:"}
                lbs = [start_lb(fleet, emus, name=f"lb{i}", config={"state": state, "server": {"access_log": False}})
                       for i in range(instances)]
                meter = CpuMeter(fleet)
                v = asyncio.run(_drive([lb.url for lb in lbs], emus, clients, turns, seconds, seed=1))
                v["machine"] = meter.result()
                if (w := saturation_warning(v["machine"], f"[{name}] ")):
                    warnings.append(w)
                variants[name] = v
        finally:  # after the LBs stopped
            for p in procs:
                p.terminate()
                p.wait(timeout=10)
    one, two = variants["one lb"], variants["two lb + redis"]
    notes.append(f"pair / one: throughput {two['throughput_rps'] / max(one['throughput_rps'], 1e-9):.2f}x, "
                 f"cached-token ratio {two['cached_token_ratio']:.3f} vs {one['cached_token_ratio']:.3f}, engine waiting mean "
                 f"{two['engine_waiting']['mean']:.2f} vs {one['engine_waiting']['mean']:.2f} "
                 f"(max {two['engine_waiting']['max']} vs {one['engine_waiting']['max']})")
    notes.append(f"{clients} closed-loop clients, {turns}-turn conversations, each request to a random instance; "
                 f"{REPLICAS} {PROFILE} emulators at {SPEED:g}x for {seconds:g} s per variant")
    return {"baseline": "one lb", "variants": variants, "warnings": warnings, "notes": notes}
