"""Scenario `compare-sp-micro`: SkyWalker's selective-pushing microbenchmark in one region with
the third-party routers beside lb's three pushing modes (bench/scenarios/_compare.py).

4 emulated Llama-3-8B on L4 replicas, 30 closed-loop Tree-of-Thoughts clients (2-branch,
depth 4), lb with its default policy and blind / sp-outstanding / sp-pending pushing,
next to SGLang Router, vLLM router, nginx and direct round robin. The replicas run `SPEED`×
faster than real; lb's probe interval and affinity bounds are divided by the same factor.

Why 2× and not 4×: compressing engine time does not compress a proxy's own time. At 86
streamed requests a second `lb` spends ~12 ms of wall time per request of its own on this
2-core machine, ~50 ms of engine time at 4×. Measured 2026-11-27 (3 interleaved runs each): at
4× `lb`'s TTFT p90 was 1.53× nginx hash-session's; at 2× 0.68× (the full scenario; the
simulator's direction) at 0.97× its throughput, with the same cached ratio (0.83-0.84 against
0.90) at both speeds. `compare-tot` moved to 2× for the same reason on 2026-11-25.
"""
from __future__ import annotations

from bench.report_md import is_lb
from bench.scenarios._compare import PEERS, QUICK_PEERS, Compare, scenario_runner
from bench.scenarios.sp_micro import CLIENTS, SP_O_MAX_OUTSTANDING
from bench.systems import lb
from lb.core.policies import DEFAULT_POLICY

DESCRIPTION = "selective pushing (blind / SP-O / SP-P through lb) next to SGLang/vLLM router, nginx, direct; ToT"
SPEED = 2.0
SKYWALKER_SP = "SkyWalker SP-P vs BP: 1.27× throughput, 18.47× lower P90 TTFT, KV hit 89.9% vs 68.9%"


def compare(quick: bool, speed: float = SPEED) -> Compare:
    modes = ("sp-pending", "blind") if quick else ("sp-pending", "sp-outstanding", "blind")
    ours = [lb(pushing=m, config={"pushing": {"max_outstanding": SP_O_MAX_OUTSTANDING}}) for m in modes]
    return Compare(
        title="Selective pushing microbenchmark (ToT, one region)",
        scenario="compare-sp-micro", quick=quick, workload="tot",
        systems=ours + (QUICK_PEERS[:1] if quick else PEERS), duration_s=8.0 if quick else 20.0, speed=speed,
        replicas=4, clients=CLIENTS, params={"output_tokens": 64},
        notes=[f"{CLIENTS} ToT clients (2-branch, depth 4), 4 l4-llama3-8b replicas at {speed:g}× speed, lb policy "
               f"{DEFAULT_POLICY}, sp-outstanding max {SP_O_MAX_OUTSTANDING}; lb probe interval and affinity bounds ÷ {speed:g}"],
        paper=[SKYWALKER_SP], derived_notes=sp_vs_bp)


def sp_vs_bp(variants: dict[str, dict]) -> list[str]:
    # by system, not by name: the names carry the policy, which the default may change
    ours = {v["system"]["pushing"]: v for v in variants.values() if is_lb(v)}
    b, p = ours.get("blind"), ours.get("sp-pending")
    if not (b and p and b["throughput_rps"] and (p["ttft_s"] or {}).get("p90")):
        return []
    return [f"measured SP-P vs BP: {p['throughput_rps'] / b['throughput_rps']:.2f}× throughput, "
            f"P90 TTFT {p['ttft_s']['p90'] / b['ttft_s']['p90']:.2f}× blind pushing's, cached-token ratio "
            f"{p['cached_token_ratio']:.3f} vs {b['cached_token_ratio']:.3f}"]


run = scenario_runner(compare)
