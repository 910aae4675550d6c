"""Scenario `fairness`: FairServe's abusive-tenant experiment through `lb`.

Benign tenants are ServeGen clients (their own arrival shapes, request sizes from the Azure
conversation trace); each arrival starts a 3-stage interaction (an agentic program). One
abusive tenant floods at 10× the mean benign tenant's rate. Variants, each with a fresh
emulator and `lb`: FCFS, RPM (sliding-window limit, always enforced), VTC, WSC with the
papers' cumulative counters and lift (`wsc-cumulative`, lb before the fix in docs/fairness.md),
WSC (default: decayed standing), WSC+OIT (throttle only under overload, never mid-interaction),
plus a no-abuser FCFS reference. `lb-bench sim-compare fairness` runs the same set-up in
virtual time with seeds and CIs.

Per variant: benign P90 TTFT relative to the reference (`benign_p90_ttft_ratio`), share of
service per tenant, interactions aborted mid-way (`interactions_aborted`) and the tokens
their finished stages had consumed (`tokens_wasted`). FairServe reports 0 tokens wasted and
21× fewer aborted interactions than RPM.
"""
from __future__ import annotations

import heapq
import itertools
import math
from pathlib import Path

from bench.fleet import CpuMeter, Fleet, saturation_warning
from bench.scenarios._fair import drive_interactions, p, start_lb_toml
from bench.stats import run_report
from bench.workloads.servegen import ServeGen

DESCRIPTION = "FairServe: ServeGen tenants + a 10× abuser, FCFS vs RPM vs VTC vs WSC vs WSC+OIT (aborts, waste, P90)"
STAGES = 3
TENANTS = 4
ABUSE_FACTOR = 10
WINDOW_S = 10.0
VARIANTS = {
    "fcfs": '[queue]\norder = "fcfs"\n',
    "rpm": '[queue]\norder = "fcfs"\n[fairness]\nthrottle = "rpm"\n',
    "vtc": '[queue]\norder = "vtc"\n',
    "wsc-cumulative": '[queue]\norder = "wsc"\n[fairness.wsc]\nhalf_life_s = 0.0\n',  # the papers' counters + lift
    "wsc": '[queue]\norder = "wsc"\n',
    "wsc+oit": '[queue]\norder = "wsc"\n[fairness]\nthrottle = "oit"\noverload_queue_len = 8\noverload_no_replica_s = 1.0\n',
}


def settings(quick: bool) -> dict:
    return {"duration": 6.0 if quick else 30.0, "grace": 4.0 if quick else 20.0, "rps": 2.0,
            "speed": 0.5, "max_running": 2, "size_scale": 0.05}


def arrivals(s: dict, abuser: bool) -> list:
    """Interaction starts of benign tenants (+ the abuser), in arrival order."""
    benign = ServeGen(seed=0, tenants=TENANTS, total_rps=s["rps"], size_scale=s["size_scale"]).arrivals()
    streams = [itertools.takewhile(lambda x: x.at < s["duration"], benign)]
    if abuser:
        abuse = ServeGen(seed=1, tenants=1, total_rps=ABUSE_FACTOR * s["rps"] / TENANTS,
                         size_scale=s["size_scale"], name="abuser").arrivals()
        tagged = (_as_abuser(x) for x in itertools.takewhile(lambda x: x.at < s["duration"], abuse))
        streams.append(tagged)
    return list(heapq.merge(*streams, key=lambda x: x.at))


def _as_abuser(spec):
    spec.user = spec.app = "abuser"
    spec.request_id = "abuse-" + spec.request_id
    return spec


def rpm_limit(starts: list, s: dict) -> int:
    """A per-tenant limit the busiest benign tenant stays under on average (2× its mean
    request rate) and the abuser exceeds: what an operator would set."""
    per_tenant: dict[str, int] = {}
    for x in starts:
        if x.user != "abuser":
            per_tenant[x.user] = per_tenant.get(x.user, 0) + STAGES
    busiest = max(per_tenant.values(), default=1) / s["duration"]
    return max(1, math.ceil(2 * busiest * WINDOW_S))


def run_one(out_dir: Path, name: str, toml: str, starts: list, s: dict, warnings: list) -> dict:
    import asyncio

    with Fleet(out_dir / "logs" / name) as fleet:
        emu = fleet.emulator(speed=s["speed"], extra=["--max-running", str(s["max_running"])], model="m")
        lb = start_lb_toml(fleet, [emu.url], toml)
        meter = CpuMeter(fleet)
        records, interactions, wall = asyncio.run(drive_interactions(
            lb.url, starts, stages=STAGES, model="m", duration=s["duration"], grace=s["grace"]))
        machine = meter.result()
    result = run_report(records, wall, workload="servegen-interactions", model="m")
    result["machine"] = machine
    warning = saturation_warning(machine, f"[{name}] ")
    if warning:
        warnings.append(warning)
    served: dict[str, int] = {}
    for r in records:
        if r.ok:
            served[r.tenant] = served.get(r.tenant, 0) + r.prompt_tokens + r.output_tokens
    total = sum(served.values()) or 1
    result.update({
        "benign_p90_ttft_s": p((r.ttft for r in records if r.ok and r.ttft is not None and r.tenant != "abuser"), 0.9),
        "service_share": {t: round(v / total, 4) for t, v in sorted(served.items())},
        "interactions": len(interactions),
        "interactions_completed": sum(i.stages_done == STAGES for i in interactions),
        "interactions_aborted": sum(i.aborted for i in interactions),
        "interactions_refused": sum(i.refused for i in interactions),
        "tokens_wasted": sum(i.tokens_spent for i in interactions if i.aborted),
        "throttled_429": sum(r.status == 429 for r in records),
    })
    return result


def run(out_dir: Path, quick: bool) -> dict:
    s = settings(quick)
    starts = arrivals(s, abuser=True)
    limit = rpm_limit(starts, s)
    limits = f"window_s = {WINDOW_S}\nuser_rpm = {limit}\n"
    warnings: list[str] = []
    reference = run_one(out_dir, "no-abuser", VARIANTS["fcfs"], arrivals(s, abuser=False), s, warnings)
    variants = {"no-abuser": reference}
    for name, toml in VARIANTS.items():
        toml = toml + limits if "throttle" in toml else toml
        variants[name] = run_one(out_dir, name, toml, starts, s, warnings)
    base = reference["benign_p90_ttft_s"]
    for v in variants.values():
        v["benign_p90_ttft_ratio"] = round(v["benign_p90_ttft_s"] / base, 3) if base and v["benign_p90_ttft_s"] else None
    rpm, oit = variants["rpm"]["interactions_aborted"], variants["wsc+oit"]["interactions_aborted"]
    notes = [f"{TENANTS} ServeGen tenants at {s['rps']} interactions/s in all, {STAGES} stages each; abuser at "
             f"{ABUSE_FACTOR}× the mean tenant rate; 1 tiny emulator at {s['speed']}× speed, max-running "
             f"{s['max_running']}; {s['duration']:.0f} s per variant; RPM/OIT limit {limit} requests per {WINDOW_S:g} s",
             "FairServe: WSC+OIT wastes 0 tokens and aborts 21× fewer interactions than RPM",
             "measured: " + ", ".join(f"{n}: ratio {v['benign_p90_ttft_ratio']}, aborted {v['interactions_aborted']}, "
                                      f"wasted {v['tokens_wasted']}" for n, v in variants.items()),
             f"RPM aborted {rpm} interactions vs WSC+OIT {oit}"
             + (f" ({rpm / oit:.1f}×)" if oit else " (WSC+OIT: none)")]
    return {"baseline": "fcfs", "variants": variants, "warnings": warnings, "notes": notes}
