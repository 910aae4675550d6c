"""Fingerprints of short simulator runs: a speed-up of the simulator must not move a figure.

    python -m bench.sim.fingerprint                  # this tree: one hash per case, and CPU s
    python -m bench.sim.fingerprint --against main   # the same cases on REF too (a temporary
                                                     # git worktree), side by side; exit 1 on any difference

Each case is a short run whose every output (summary and per-minute series of a scenario;
per-seed figures and TTFTs of a `sim-compare` system; a fairness or tiers run) is hashed,
wall times left out. Cases cover the paths a change to bench/sim or lb/core can touch:
several models and regions with forwarding (day-3x3 slices, two seeds, overloaded and at the
day's load), autoscaling (day-us-reactive), every `sim-compare` workload behind `lb` and its
variants and one peer router each, WSC fairness with the throttle, and tier orders.
An intentional change of figures shows here as a different hash, to be explained.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _scenario(name: str, start_s: float, duration_s: float, seed: int, rate_scale: float | None = None):
    def run():
        from bench.sim.runner import run_config
        from bench.sim.world import load_config

        cfg = load_config(ROOT / "bench/sim/scenarios" / f"{name}.toml")
        cfg.start_s, cfg.duration_s, cfg.seed = start_s, duration_s, seed
        if rate_scale is not None:
            cfg.arrivals.rate_scale = rate_scale
        result = run_config(cfg)
        result["summary"].pop("sim")
        return result
    return run


def _compare(workload: str, system: str, seed: int, duration_s: float, load_rps: float):
    def run():
        from bench.sim.compare import run_one

        out = run_one((workload, system, seed, load_rps, duration_s))
        out.pop("wall_s")
        # derived from `sent` and `cut_at_deadline`, which are hashed: a new summary of the same
        # run is not a change of what the run did (added 2026-11-26; hashes comparable across it)
        out.pop("served_rps", None)
        out.pop("tenant_p90_median_s", None)  # likewise, from the TTFTs (added 2026-11-28)
        out.pop("tenant_p90_worst_s", None)
        out.pop("programs_rps", None)  # likewise, from the clients (added 2026-11-28, thirtieth session)
        return out
    return run


def _fairness(system: str, seed: int, duration_s: float):
    def run():
        from bench.sim.fair_workload import run_one

        return run_one((system, seed, True, duration_s))
    return run


def _tiers(system: str, seed: int, duration_s: float):
    def run():
        from bench.sim.tiers_workload import run_one

        return run_one((system, "over", seed, duration_s))
    return run


def cases() -> dict:
    out = {
        "day-3x3 noon 120s seed 1": _scenario("day-3x3", 43200, 120, 1),
        "day-3x3 noon 120s seed 2": _scenario("day-3x3", 43200, 120, 2),
        "day-3x3 overloaded 20s seed 3": _scenario("day-3x3", 0, 20, 3, rate_scale=0.05),
        "day-us-reactive 900s": _scenario("day-us-reactive", 36000, 900, 1),
        "small 300s": _scenario("small", 0, 300, 4),
    }
    # one fixed offered rate per workload (about 0.9 of its fleet's capacity: no capacity run)
    rates = {"tot": 8.0, "mixed-tree": 9.0, "multiturn": 3.0, "mooncake": 3.5, "bursty": 5.0,
             "heterogeneous": 5.0, "regions": 6.0}
    for workload, rate in rates.items():
        for system in ("lb", "lb blind", "lb least-load", "lb prefix-trie", "sglang-router cache_aware"):
            out[f"{workload} {system}"] = _compare(workload, system, 1, 120.0, rate)
    out["regions nginx least_conn"] = _compare("regions", "nginx least_conn", 2, 120.0, 6.0)
    for system in ("lb fcfs", "lb wsc", "lb wsc+oit"):
        out[f"fairness {system}"] = _fairness(system, 1, 60.0)
    for system in ("fcfs", "dpa"):
        out[f"tiers {system}"] = _tiers(system, 1, 60.0)
    return out


def fingerprint(only: str | None = None) -> dict[str, dict]:
    results = {}
    for name, run in cases().items():
        if only and only not in name:
            continue
        cpu = time.process_time()
        digest = _digest(run())
        results[name] = {"hash": digest, "cpu_s": round(time.process_time() - cpu, 2)}
        print(f"{name:42s} {digest} {results[name]['cpu_s']:7.2f} s", file=sys.stderr, flush=True)
    return results


def _against(ref: str, only: str | None) -> dict[str, dict]:
    """The same cases run on `ref`'s code: a detached worktree, this file run from there."""
    with tempfile.TemporaryDirectory(prefix="simfp-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), ref], check=True)
        try:
            code = ("import runpy, sys; path = sys.argv[1]; sys.argv = ['fingerprint', '--json'] + sys.argv[2:]; "
                    "runpy.run_path(path, run_name='__main__')")
            env = {**os.environ, "PYTHONPATH": str(tree)}
            args = [sys.executable, "-c", code, str(Path(__file__).resolve())] + (["--only", only] if only else [])
            done = subprocess.run(args, cwd=tree, env=env, check=True, stdout=subprocess.PIPE, text=True)
            return json.loads(done.stdout)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REF", help="also run the cases on this git ref and compare")
    parser.add_argument("--only", help="only the cases whose name contains this")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = parser.parse_args(argv)
    if args.against:
        print(f"-- {args.against}", file=sys.stderr)
        theirs = _against(args.against, args.only)
        print("-- this tree", file=sys.stderr)
    mine = fingerprint(args.only)
    if args.json:
        print(json.dumps(mine))
    if not args.against:
        return 0
    differ = [n for n in mine if theirs.get(n, {}).get("hash") != mine[n]["hash"]]
    cpu_theirs = sum(theirs[n]["cpu_s"] for n in mine if n in theirs)
    cpu_mine = sum(r["cpu_s"] for r in mine.values())
    print(f"{len(mine) - len(differ)}/{len(mine)} cases identical; CPU {cpu_theirs:.1f} s ({args.against}) "
          f"-> {cpu_mine:.1f} s (this tree)")
    for n in differ:
        print(f"DIFFERENT: {n}: {theirs.get(n, {}).get('hash')} -> {mine[n]['hash']}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
