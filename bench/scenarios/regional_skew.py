"""Scenario `regional-skew`: SkyWalker's regional-skew experiment on the loopback testbed.

Three regions (us, eu, asia) with one-way latencies us–eu 40 ms, us–asia 80 ms, eu–asia
90 ms (bench/delay_proxy.py). Clients per region in SkyWalker's 120 : 40 : 40 proportion,
scaled down to what two cores can drive; replicas split evenly. Each variant is a fresh
testbed: `local-N` runs every region alone (no peers), `lb-N` lets the LBs forward overflow
to peers (SkyWalker Algorithm 1, snapshot-trie peer choice). Reported: throughput of `lb` vs
region-local at equal replica counts, and the smallest replica count at which `lb` matches
region-local's throughput with 12 replicas.

Emulated replicas are Llama-3-8B on L4 (`l4-llama3-8b`) capped at 4 running requests, so a
region of 4 replicas has 16 slots: us's clients overflow it while eu and asia have room.
SkyWalker: 1.07–1.18× throughput; 9 replicas match region-local's 12 (−25 %).
"""
from __future__ import annotations

from pathlib import Path

from bench.cluster import ClusterSpec, RegionSpec, run_variant
from lb.core.peering import DEFAULT_TAU

DESCRIPTION = "SkyWalker regional skew: lb with cross-region forwarding vs region-local, 12 and 9 replicas, 3 regions"
PAPER_CLIENTS = {"us": 120, "eu": 40, "asia": 40}
LATENCY_MS = {"us-eu": 40, "us-asia": 80, "eu-asia": 90}
MAX_RUNNING = 4  # per replica: a small replica, so 2 cores can fill twelve of them


def spec(mode: str, replicas: int, quick: bool) -> ClusterSpec:
    scale = 4  # clients ÷ 4: 30 / 10 / 10
    per_region = replicas // 3
    return ClusterSpec(
        regions=[RegionSpec(name, per_region, n // scale) for name, n in PAPER_CLIENTS.items()],
        mode=mode, latency_ms=LATENCY_MS, duration_s=25.0 if quick else 75.0,
        profile="l4-llama3-8b", speed=1.0, emulator_args=["--max-running", str(MAX_RUNNING)],
        policy="prefix-trie", peer_policy="prefix-trie", pushing="sp-pending", tau=DEFAULT_TAU,
        workload="multiturn", params={"output_tokens": 48 if quick else 64})


def run(out_dir: Path, quick: bool) -> dict:
    counts = (12, 9)
    variants, warnings = {}, []
    for n in counts:
        for mode, name in (("region-local", f"local-{n}"), ("peering", f"lb-{n}")):
            variants[name] = run_variant(out_dir / "logs" / name, spec(mode, n, quick), label=name, warnings=warnings)
    base = variants["local-12"]["throughput_rps"]
    notes = [f"clients us/eu/asia {'/'.join(str(c // 4) for c in PAPER_CLIENTS.values())} (SkyWalker's 120/40/40 ÷ 4), "
             f"replicas split evenly, l4-llama3-8b emulators capped at {MAX_RUNNING} running, multiturn, "
             f"one-way latency {LATENCY_MS}, {spec('peering', 12, quick).duration_s:.0f} s per variant",
             "SkyWalker: 1.07–1.18× throughput at equal replicas; 9 replicas match region-local's 12"]
    for n in counts:
        lb, local = variants[f"lb-{n}"]["throughput_rps"], variants[f"local-{n}"]["throughput_rps"]
        if local:
            notes.append(f"measured {n} replicas: lb {lb:.2f} req/s vs region-local {local:.2f} req/s = {lb / local:.2f}×")
    matching = [n for n in counts if variants[f"lb-{n}"]["throughput_rps"] >= 0.98 * base]
    notes.append(f"lb matches region-local-12 ({base:.2f} req/s, within 2 %) with "
                 f"{min(matching) if matching else 'none of ' + str(counts)} replicas")
    return {"baseline": "local-12", "variants": variants, "warnings": warnings, "notes": notes}
