"""Scenario `sglang-router-smoke`: SGLang Router (cache_aware) over 2 emulators vs direct
round robin, on a Tree-of-Thoughts workload whose prefixes reward cache-aware routing.

Each variant gets fresh emulators, so no variant inherits another's prefix cache. The router
is `sglang-router==0.3.2` from PyPI (its quirks: it rewrites `max_tokens` into
`max_completion_tokens`, drops fields and headers it does not know, and serves `/v1/models`
as text/plain).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from bench.fleet import Fleet
from bench.scenarios.runner import run_variant

DESCRIPTION = "SGLang Router (cache_aware) over 2 emulators vs direct round robin, ToT workload"
REPLICAS = 2


def settings(quick: bool) -> tuple[dict, dict]:
    """(emulator settings, client settings); quick: two 15-second variants."""
    if quick:
        return ({"profile": "l4-llama3-8b", "speed": 10.0},
                {"clients": 8, "duration": 15.0, "params": {"output_tokens": 64}})
    return ({"profile": "l4-llama3-8b", "speed": 4.0},
            {"clients": 16, "duration": 120.0, "params": {"output_tokens": 64}})


def run(out_dir: Path, quick: bool) -> dict:
    if importlib.util.find_spec("sglang_router") is None:
        return {"variants": {}, "skipped": "sglang-router is not installed (pip install sglang-router==0.3.2)"}
    emulator, client = settings(quick)
    variants, warnings = {}, []
    with Fleet(out_dir / "logs" / "direct") as fleet:
        emus = fleet.emulators(REPLICAS, **emulator)
        variants["direct-rr"] = run_variant(fleet, [e.url for e in emus], "tot", label="direct-rr",
                                            warnings=warnings, **client)
    with Fleet(out_dir / "logs" / "router") as fleet:
        emus = fleet.emulators(REPLICAS, **emulator)
        router = fleet.sglang_router([e.url for e in emus], policy="cache_aware")
        variants["sglang-router"] = run_variant(fleet, [router.url], "tot", label="sglang-router",
                                                warnings=warnings, **client)
    return {"baseline": "direct-rr", "variants": variants, "warnings": warnings,
            "notes": [f"{REPLICAS} emulators, profile {emulator['profile']} at {emulator['speed']}× speed"]}
