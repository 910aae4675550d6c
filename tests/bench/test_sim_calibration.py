"""Calibration: the simulator and the live emulator agree on the same small scenario.

Same profile (`l4-llama3-8b`), same two replicas fed round-robin in arrival order, same
requests: the first Azure-conversation arrivals at their trace times, with the exact prompt
token ids the emulator renders from the chat messages and the trace's output lengths
(`ignore_eos`). The emulators run `SPEED`× faster than the profile over real HTTP (the
benchmark client streaming, as users would); their times are scaled back to profile seconds.

Tolerance, and why: the simulator is the engine model without HTTP, so what may differ is
what real time adds. Each request pays ~2–10 ms of wall time on loopback (client JSON,
tokenizing the chat, SSE framing, event-loop scheduling on a 2-core machine shared with other
tests), i.e. ×SPEED = 10–40 ms of profile time, and a late arrival can miss the step it would
have joined (one step: 55–120 ms at these batch sizes). So TTFT p50/p90 must agree within
20 % + 0.15 s (about one step plus the HTTP cost), and throughput (output tokens per second
over the makespan, which also catches drift in decode speed) within 10 %. A model that got
prefill or decode speed wrong by a third, or queued differently, fails.
"""
from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from bench.client import run_bench
from bench.tokenizer import encode, render_chat
from bench.workloads import make_workload
from bench.sim.world import Simulation, parse_config
from tests.procs import Proc, free_port, lb_bench

PROFILE = "l4-llama3-8b"
SPEED = 4.0  # profile seconds per wall second in the emulators
REQUESTS = 90  # ~27 s of trace at ~3.3 req/s → ~7 s of wall time
PARAMS = {"size_scale": 0.5}  # half-length prompts and outputs: a busy but unsaturated pair
TTFT_REL, TTFT_ABS, TPUT_REL = 0.20, 0.15, 0.10


def _specs():
    workload = make_workload("azure-conv", seed=3, **PARAMS)
    out = []
    for spec in workload.arrivals():
        out.append(spec)
        if len(out) == REQUESTS:
            return out
    return out


def _live() -> dict:
    with contextlib.ExitStack() as stack:
        ports = [free_port(), free_port()]
        for i, p in enumerate(ports):
            stack.enter_context(Proc(lb_bench("emulate", "--port", str(p), "--profile", PROFILE,
                                              "--speed", str(SPEED)),
                                     ready_url=f"http://127.0.0.1:{p}/health", name=f"calib-emu-{i}"))
        _, records = asyncio.run(run_bench([f"http://127.0.0.1:{p}" for p in ports], "azure-conv",
                                           requests=REQUESTS, seed=3, time_scale=SPEED,
                                           params=PARAMS, deadline=60.0))
    assert all(r.ok for r in records), [r.error for r in records if not r.ok][:5]
    ends = [(r.start + r.e2e) * SPEED for r in records]
    return {"ttft": [r.ttft * SPEED for r in records], "output": sum(r.output_tokens for r in records),
            "makespan": max(ends)}


def _simulated(specs) -> dict:
    cfg = parse_config({"duration_s": 600.0, "seed": 3,
                        "models": [{"name": "m", "profile": PROFILE, "replicas": 2}],
                        "lb": {"pushing": "blind", "policy": "round-robin"},
                        "arrivals": {"kind": "external"}})
    sim = Simulation(cfg)
    done = []
    for lb in sim.lbs.values():
        lb.on_done = done.append
    for spec in specs:
        prompt = encode(render_chat(spec.messages))
        sim.loop.at(spec.at, lambda p=prompt, s=spec: sim.inject("local", "m", p, s.max_tokens, request_id=s.request_id))
    sim.loop.run(600.0)
    assert len(done) == len(specs)
    return {"ttft": [r.first_token - r.arrival for r in done], "output": sum(r.output_tokens for r in done),
            "makespan": max(r.finished_at for r in done)}


def _disagreements(sim: dict, live: dict) -> tuple[list[str], dict]:
    report, out = {}, []
    for q in (50, 90):
        s, l = np.percentile(sim["ttft"], q), np.percentile(live["ttft"], q)
        report[f"ttft_p{q}"] = (s, l)
        if abs(s - l) > TTFT_REL * l + TTFT_ABS:
            out.append(f"TTFT p{q}: simulated {s:.3f} s, live {l:.3f} s")
    s_tput, l_tput = sim["output"] / sim["makespan"], live["output"] / live["makespan"]
    report["output_tok_s"] = (s_tput, l_tput)
    if abs(s_tput - l_tput) > TPUT_REL * l_tput:
        out.append(f"output tokens/s: simulated {s_tput:.1f}, live {l_tput:.1f}")
    return out, report


def test_simulator_agrees_with_the_live_emulator():
    """The live half runs once more if it disagrees: on this 2-core machine the test beside it
    in the other worker can starve the emulators for seconds (seen once in a fresh-clone run:
    live TTFT p50 0.49 s against 0.20 simulated, 0.20-0.21 live when run again alone). A model
    that is wrong disagrees both times."""
    specs = _specs()
    sim = _simulated(specs)
    for attempt in range(2):
        live = _live()
        assert sim["output"] == live["output"]
        problems, report = _disagreements(sim, live)
        print(f"calibration, try {attempt + 1} (simulated, live):",
              {k: tuple(round(float(x), 3) for x in v) for k, v in report.items()})
        if not problems:
            return
    pytest.fail("; ".join(problems))
