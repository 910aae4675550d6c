"""Scenario `central-vs-regional`: three peering LBs with local clients vs one central LB.

SkyWalker's "global coordinator" baselines: a single LB in one region (us) fronting every
region's replicas, reached by the other regions' clients across the WAN and reaching their
replicas across it too (every probe, request and token stream pays the latency), against
one `lb` per region whose clients stay local and which forward only their overflow. Same
testbed, replicas, clients and workload as `regional-skew` (12 replicas, 4 per region).
"""
from __future__ import annotations

from pathlib import Path

from bench.cluster import ClusterSpec, RegionSpec, run_variant
from bench.scenarios.regional_skew import LATENCY_MS, MAX_RUNNING, PAPER_CLIENTS
from lb.core.peering import DEFAULT_TAU

DESCRIPTION = "three regional LBs (peering, local clients) vs one central LB in us: P50/P90 TTFT and throughput"


def spec(mode: str, quick: bool) -> ClusterSpec:
    return ClusterSpec(
        regions=[RegionSpec(name, 4, n // 4) for name, n in PAPER_CLIENTS.items()],
        mode=mode, central="us", latency_ms=LATENCY_MS, duration_s=25.0 if quick else 75.0,
        profile="l4-llama3-8b", speed=1.0, emulator_args=["--max-running", str(MAX_RUNNING)],
        policy="prefix-trie", peer_policy="prefix-trie", pushing="sp-pending", tau=DEFAULT_TAU,
        workload="multiturn", params={"output_tokens": 48 if quick else 64})


def run(out_dir: Path, quick: bool) -> dict:
    variants, warnings = {}, []
    for mode, name in (("central", "central-us"), ("peering", "regional")):
        variants[name] = run_variant(out_dir / "logs" / name, spec(mode, quick), label=name, warnings=warnings)
    c, r = variants["central-us"], variants["regional"]
    notes = [f"12 replicas (4 per region), clients us/eu/asia {'/'.join(str(n // 4) for n in PAPER_CLIENTS.values())}, "
             f"one-way latency {LATENCY_MS}, {spec('central', quick).duration_s:.0f} s per variant"]
    if c["ttft_s"] and r["ttft_s"] and c["throughput_rps"]:
        notes.append(f"measured regional vs central: {r['throughput_rps'] / c['throughput_rps']:.2f}× throughput, "
                     f"P50 TTFT {c['ttft_s']['p50']:.3f}→{r['ttft_s']['p50']:.3f}s, "
                     f"P90 TTFT {c['ttft_s']['p90']:.3f}→{r['ttft_s']['p90']:.3f}s")
    return {"baseline": "central-us", "variants": variants, "warnings": warnings, "notes": notes}
