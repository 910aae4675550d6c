"""The simulator against the live emulator: one closed-loop run both ways, same figures.

`simulate` runs `--clients` programs of a live workload behind `lb` in the simulator and
reports exactly what `lb-bench run` reports live (bench/stats.py): throughput = requests
completed / time until the last one finished (issuing stops at the duration, requests in
flight then still finish and count), TTFT p50/p90 over the completed requests. `live`
runs the same workload, seed, clients and fleet over real emulator processes with `lb` in
front. With emulators at `speed`x, every lb time constant is divided by `speed`
(bench.scenarios._lb.engine_time_config) and live figures are converted back to engine time
(throughput / speed, TTFT x speed) before comparing.

tests/bench/test_sim_agreement.py asserts the two agree; `python -m bench.sim.agreement
WORKLOAD` prints both for a workload by hand.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np

from bench.sim.arena import Arena, FleetSpec, RegionSpec, lb_config
from bench.sim.clients import Programs
from bench.workloads import make_workload

PROFILE = "l4-llama3-8b"
# The simulator's side of the comparison pools DRAWS runs with the HTTP hop drawn from 2 ms x
# [0.5, 1.5] (bench/sim/arena.py HTTP_S): one draw of a tree workload's p90 moves by a third
# with a millisecond here or there (mixed-tree, 200 requests: 569-1,085 ms over seven draws),
# so one simulated run is no better an estimate than one live run. Mixed-tree's per-run p90
# at 600 requests is bimodal (25 draws: 765-948 ms and 1,079-1,350 ms, as live runs are:
# 708-1,060 and 1,109-1,359 on 2026-11-26), so a median of per-run p90s jumps between the
# modes: the median of 25 draws (948 ms) failed a fresh-clone CI whose median of three live
# runs was 1,304 ms. The p90 of the pooled requests does not jump: 1,057 ms over the 25
# draws, against 1,122-1,147 ms pooled over one to six live runs (968-1,183 each) on a quiet
# machine (`pooled`). 25 draws cost ~3 s a workload.
DRAWS = 25
JITTER = 0.5


def simulate(workload: str, params: dict, *, clients: int, replicas: int, requests: int, seed: int = 0,
             draws: int = DRAWS, jitter: float = JITTER) -> dict:
    """Engine-time figures of a closed-loop run in the simulator: `draws` runs of the same
    workload seed pooled, each with its own draw of HTTP hop times (`Arena.http_jitter`),
    which is what a live run's figures are one draw from."""
    runs = [_simulate_once(workload, params, clients=clients, replicas=replicas, requests=requests,
                           seed=seed, jitter=jitter if draws > 1 else 0.0, jitter_seed=k) for k in range(draws)]
    return pooled(runs)


def pooled(runs: list[dict]) -> dict:
    """The figures of several runs of one case: TTFT p50/p90 over all their requests together,
    every other figure the median over runs (an odd number of runs gives one a run had). A
    tree workload's per-run p90 is bimodal (see DRAWS), so the median of per-run p90s jumps
    between the modes with a draw or two; the p90 of the pooled requests does not."""
    out = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0] if k != "ttfts"}
    ttft = np.concatenate([r["ttfts"] for r in runs])
    out["ttft_p50_s"], out["ttft_p90_s"] = float(np.percentile(ttft, 50)), float(np.percentile(ttft, 90))
    return out


def _simulate_once(workload: str, params: dict, *, clients: int, replicas: int, requests: int, seed: int,
                   jitter: float, jitter_seed: int) -> dict:
    arena = Arena(FleetSpec((RegionSpec("local", replicas),), profile=PROFILE), "lb", seed=seed, lb_cfg=lb_config(),
                  http_jitter=jitter, jitter_seed=jitter_seed)
    programs = Programs(arena, make_workload(workload, seed=seed, **params), stop_at=float("inf"),
                        max_requests=requests)
    programs.clients({"local": clients})
    while arena.in_flight:  # issuing stopped: let what is in flight finish, as the live client does
        arena.loop.run(arena.loop.now + 1.0)
    done = arena.done
    end = max(d.sent_at + d.e2e for d in done)
    ttft = np.array([d.ttft for d in done])
    return {"requests": len(done), "throughput_rps": len(done) / end, "ttfts": ttft,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
            "e2e_p50_s": float(np.median([d.e2e for d in done])), "duration_s": end,
            "cached_ratio": sum(d.cached_tokens for d in done) / sum(d.prompt_tokens for d in done)}


def live(workload: str, params: dict, *, clients: int, replicas: int, requests: int, speed: float,
         seed: int = 0, log_dir: Path | None = None) -> dict:
    """The same run over real emulators at `speed`x behind `lb`, in engine time."""
    from bench.client import run_bench
    from bench.fleet import Fleet
    from bench.systems import lb, start

    with Fleet(log_dir or Path(tempfile.mkdtemp(prefix="agreement-"))) as fleet:
        emulators = [fleet.emulator(f"emu{i}", profile=PROFILE, speed=speed, seed=seed + i) for i in range(replicas)]
        url = start(lb(), fleet, [e.url for e in emulators], speed=speed)[0]
        report, records = asyncio.run(run_bench([url], workload, clients=clients, requests=requests,
                                                seed=seed, params=params))
    if report["errors"]:
        raise RuntimeError(f"live run had errors: {report['errors_by_kind']}")
    ttfts = np.array([r.ttft * speed for r in records if r.ttft is not None])
    return {"requests": report["ok"], "throughput_rps": report["throughput_rps"] / speed, "ttfts": ttfts,
            "ttft_p50_s": report["ttft_s"]["p50"] * speed, "ttft_p90_s": report["ttft_s"]["p90"] * speed,
            "e2e_p50_s": report["e2e_s"]["p50"] * speed, "duration_s": report["duration_s"] * speed,
            "cached_ratio": report["cached_token_ratio"]}


def disagreements(sim: dict, real: dict, *, throughput_rel: float = 0.10, ttft_rel: float = 0.20,
                  ttft_p90_rel: float = 0.30, ttft_abs_s: float = 0.05) -> list[str]:
    """What is outside the agreed bounds: throughput within 10 %, TTFT p50 within 20 % + 50 ms,
    p90 within 30 % + 50 ms. The p90 gets more room because the live side's moves more than a
    simulator error would show: Mixed Tree's five pooled live runs gave 820 ms in one fresh-clone
    CI run (2026-11-26) and 1,117 ms three runs later on the same machine and commit (three
    more at the commit before: 1,116 ms), against a simulated 1,057 ms that did not change."""
    out = []
    if abs(sim["throughput_rps"] - real["throughput_rps"]) > throughput_rel * real["throughput_rps"]:
        out.append(f"throughput sim {sim['throughput_rps']:.3f} vs live {real['throughput_rps']:.3f} req/s")
    for key, rel in (("ttft_p50_s", ttft_rel), ("ttft_p90_s", ttft_p90_rel)):
        if abs(sim[key] - real[key]) > rel * real[key] + ttft_abs_s:
            out.append(f"{key} sim {sim[key] * 1000:.0f} vs live {real[key] * 1000:.0f} ms")
    return out


def line(name: str, sim: dict, real: dict) -> str:
    return (f"{name}: throughput sim {sim['throughput_rps']:.3f} / live {real['throughput_rps']:.3f} req/s; "
            f"TTFT p50 {sim['ttft_p50_s'] * 1000:.0f} / {real['ttft_p50_s'] * 1000:.0f} ms; "
            f"p90 {sim['ttft_p90_s'] * 1000:.0f} / {real['ttft_p90_s'] * 1000:.0f} ms; "
            f"E2E p50 {sim['e2e_p50_s']:.2f} / {real['e2e_p50_s']:.2f} s; "
            f"cached {sim['cached_ratio']:.2f} / {real['cached_ratio']:.2f}; run {sim['duration_s']:.1f} / {real['duration_s']:.1f} s; "
            f"requests {sim['requests']} / {real['requests']} (engine time)")


# What the agreement test runs: small, closed loop, the live comparisons' profile. Mixed Tree
# runs 600 requests: in its first 200 the eight clients' 4-branch trees still move in step
# from their common start, and the leaf levels of two trees (64 requests each) can land
# together; live timing noise pulls the clients apart sooner than the simulated hop jitter
# does, so at 200 requests the simulated p90 (median of 9 draws: 878 ms) sat above the live
# one (606-963 ms over 7 runs). Over 600 they agree: 1,065 simulated vs 921-1,626 live
# (median 943), p50 485 vs 434-591 (2026-11-25).
CASES = {
    "tot": {"params": {"output_tokens": 16}, "clients": 6, "requests": 200},
    "mixed-tree": {"params": {"output_tokens": 16}, "clients": 8, "requests": 600},
    "multiturn": {"params": {"output_tokens": 32}, "clients": 8, "requests": 64},
}
REPLICAS = 2
# Real time, not faster: on a busy 2-core machine every millisecond the client, lb and the
# emulators wait for a core counts `speed` times in engine time, so at 2x the live side ran
# 10-15 % slow whenever other work had the cores (load average 7-9); at 1x it stays within
# the bounds.
SPEED = 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=list(CASES))
    parser.add_argument("--speed", type=float, default=SPEED)
    parser.add_argument("--requests", type=int)
    parser.add_argument("--clients", type=int)
    parser.add_argument("--output-tokens", type=int)
    args = parser.parse_args()
    case = CASES[args.workload]
    if args.output_tokens:
        case["params"]["output_tokens"] = args.output_tokens
    kw = dict(clients=args.clients or case["clients"], replicas=REPLICAS, requests=args.requests or case["requests"])
    sim = simulate(args.workload, case["params"], **kw)
    real = live(args.workload, case["params"], speed=args.speed, **kw)
    print(line(args.workload, sim, real))
    print("disagreements:", disagreements(sim, real) or "none")


if __name__ == "__main__":
    main()
