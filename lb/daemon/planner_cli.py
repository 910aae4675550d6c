"""The planning process: token history in, forecast and capacity plan out.

    python -m lb.daemon.planner_cli --history FILE [--config config/scaling.toml] [--out PLAN.json]
    python -m lb.daemon.planner_cli --servegen bench/data/servegen/m-small --out PLAN.json

It runs beside the daemons (cron, a sidecar, a CI job), not inside them: it needs the `plan`
extra (numpy, scipy, statsmodels), which the request path never imports.

History (CSV with a header; one row per finished window and pool):
    window_start,region,model,prompt_tokens,output_tokens[,instances,slo_violations]
`window_start` in seconds; windows are `[planner] window_s` long (600 by default). With
`--servegen DIR` the history is derived instead from ServeGen per-client request rates
(requests per window × `--tokens-per-request`), one pool labelled `derived`.

Output: for each (region, model) the forecast of prompt/output tokens for the next
`horizon` windows (from `starts_at`, the end of the history's last window) (Holt-Winters, or the seasonal-naive fallback — the plan says which),
PreServe's instance count for each of those windows (μ profiled from the history's windows
without SLO violations when it has `instances`, else from config), the warm pool
N_warm ≥ λ_burst·T_cold, and SageServe's ILP deltas per region×model×GPU for the horizon's
peak demand when the config describes GPUs and models.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

from lb.core import forecast as fc
from lb.daemon.forecast_cli import load_servegen_aggregate
from lb.core.planner import (IlpInput, Throughput, WindowStats, burst_rate, plan_ilp, preserve_instances,
                             profile_throughput, warm_pool_size)

Pool = tuple[str, str]


def read_history(path: str, window_s: float) -> dict[Pool, list[dict]]:
    """Rows per pool, ordered by window, with missing windows filled as zero traffic."""
    pools: dict[Pool, dict[int, dict]] = defaultdict(dict)
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"window_start", "region", "model", "prompt_tokens", "output_tokens"}
        missing = need - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; expected {sorted(need)}")
        for n, row in enumerate(reader, start=2):
            try:
                w = int(float(row["window_start"]) // window_s)
                rec = {"prompt_tokens": float(row["prompt_tokens"]), "output_tokens": float(row["output_tokens"])}
                if row.get("instances") not in (None, ""):
                    rec["instances"] = float(row["instances"])
                    rec["slo_violations"] = int(float(row.get("slo_violations") or 0))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
            pools[(row["region"], row["model"])][w] = rec
    out = {}
    for pool, rows in pools.items():
        lo, hi = min(rows), max(rows)
        out[pool] = [rows.get(w, {"prompt_tokens": 0.0, "output_tokens": 0.0}) | {"window_start": w * window_s}
                     for w in range(lo, hi + 1)]
    return out


def servegen_history(folder: str, prompt_per_req: float, output_per_req: float,
                     pool: Pool = ("derived", "servegen")) -> dict[Pool, list[dict]]:
    reqs = load_servegen_aggregate(folder)
    return {pool: [{"prompt_tokens": r * prompt_per_req, "output_tokens": r * output_per_req}
                                      for r in reqs]}


def throughput_for(rows: list[dict], model_cfg: dict, window_s: float) -> tuple[Throughput, str]:
    windows = [WindowStats(r["prompt_tokens"], r["output_tokens"], r["instances"], window_s, r["slo_violations"])
               for r in rows if r.get("instances")]
    if any(w.slo_violations == 0 for w in windows):
        return profile_throughput(windows, quantile=0.95), "profiled"
    mu = model_cfg.get("mu")
    if not mu:
        raise ValueError("no clean windows with `instances` in the history and no [planner.models.M.mu] "
                         "{prefill, decode, total} in the config")
    return Throughput(float(mu["prefill"]), float(mu["decode"]), float(mu["total"])), "config"


def plan(history: dict[Pool, list[dict]], cfg: dict) -> dict:
    window_s = float(cfg.get("window_s", fc.WINDOW_S))
    horizon = int(cfg.get("horizon", 6))
    season = int(cfg.get("season", fc.SEASON))
    cold_start_s = float(cfg.get("cold_start_s", 300.0))
    models_cfg = cfg.get("models", {})
    pools, demand, current = [], {}, {}
    for (region, model), rows in sorted(history.items()):
        prompt = fc.forecast([r["prompt_tokens"] for r in rows], horizon, season)
        output = fc.forecast([r["output_tokens"] for r in rows], horizon, season)
        entry = {"region": region, "model": model, "history_windows": len(rows),
                 # the first forecast window starts where the history ends (absent for derived
                 # histories: the daemon then counts from when the plan file was written)
                 **({"starts_at": rows[-1]["window_start"] + window_s} if "window_start" in rows[-1] else {}),
                 "forecast_method": prompt.method,
                 "prompt_tokens": [round(v) for v in prompt.values],
                 "output_tokens": [round(v) for v in output.values]}
        try:
            mu, source = throughput_for(rows, models_cfg.get(model, {}), window_s)
        except ValueError as e:
            entry["instances_error"] = str(e)
        else:
            need = [preserve_instances(p, d, mu, window_s) for p, d in zip(prompt.values, output.values)]
            entry |= {"mu": {"prefill": mu.prefill, "decode": mu.decode, "total": mu.total, "source": source},
                      "preserve_instances": need,
                      "warm_pool": warm_pool_size(burst_rate(need, window_s), cold_start_s)}
        pools.append(entry)
        demand[(region, model)] = max((p + d) / window_s for p, d in zip(prompt.values, output.values))
        last = next((r["instances"] for r in reversed(rows) if r.get("instances")), 0)
        current[(region, model)] = int(round(last))
    return {"window_s": window_s, "horizon": horizon, "pools": pools,
            "ilp": ilp_section(cfg, demand, current)}


def ilp_section(cfg: dict, demand: dict[Pool, float], current: dict[Pool, int]) -> dict:
    gpus, models = cfg.get("gpus", {}), cfg.get("models", {})
    tps = {(m, g): float(v) for m, mc in models.items() for g, v in mc.get("tps", {}).items()}
    if not gpus or not tps:
        return {"skipped": "no [planner.gpus.*] / [planner.models.*.tps] in the config"}
    if not any(m == model for _, model in demand for m, _ in tps):
        return {"skipped": f"no configured model in [planner.models] matches the history's {sorted(demand)}"}
    cur = {}
    for (region, model), n in current.items():
        gpu = next((g for (m, g) in sorted(tps) if m == model), None)
        if gpu is not None and n:
            cur[(region, model, gpu)] = n
    inp = IlpInput(
        current=cur, demand={k: v for k, v in demand.items() if any(m == k[1] for m, _ in tps)}, tps=tps,
        vm_start_cost={g: float(c.get("vm_start_cost", 0)) for g, c in gpus.items()},
        model_load_cost={m: float(c.get("model_load_cost", 0)) for m, c in models.items()},
        run_cost={g: float(c.get("run_cost", 0)) for g, c in gpus.items()},
        epsilon=float(cfg.get("epsilon", 0.5)), headroom=float(cfg.get("headroom", 0.0)),
        max_vms={(r, g): int(n) for g, c in gpus.items() for r, n in c.get("max_vms", {}).items()},
        min_instances=int(cfg.get("min_instances", 1)))
    try:
        result = plan_ilp(inp)
    except ValueError as e:
        return {"error": str(e)}
    return {"objective": round(result.objective, 3),
            "deltas": [{"region": r, "model": m, "gpu": g, "current": cur.get((r, m, g), 0),
                        "target": t, "delta": result.delta[(r, m, g)]}
                       for (r, m, g), t in sorted(result.target.items())],
            "new_vms": [{"region": r, "gpu": g, "count": n} for (r, g), n in sorted(result.new_vms.items())]}


def print_plan(doc: dict) -> None:
    for p in doc["pools"]:
        print(f"{p['region']}/{p['model']}: {p['history_windows']} windows of history, "
              f"forecast by {p['forecast_method']}")
        print(f"  {'window':>6} {'prompt tok':>12} {'output tok':>12} {'instances':>9}")
        need = p.get("preserve_instances", ["-"] * len(p["prompt_tokens"]))
        for i, (pt, ot, n) in enumerate(zip(p["prompt_tokens"], p["output_tokens"], need), start=1):
            print(f"  {'+' + str(i):>6} {pt:>12} {ot:>12} {n:>9}")
        if "warm_pool" in p:
            print(f"  warm pool: {p['warm_pool']} (μ {p['mu']['source']}: prefill {p['mu']['prefill']:.0f}, "
                  f"decode {p['mu']['decode']:.0f}, total {p['mu']['total']:.0f} tok/s per instance)")
        else:
            print(f"  instances: {p['instances_error']}")
    ilp = doc["ilp"]
    if "deltas" in ilp:
        print(f"ILP (objective {ilp['objective']}):")
        for d in ilp["deltas"]:
            print(f"  {d['region']}/{d['model']}/{d['gpu']}: {d['current']} -> {d['target']} ({d['delta']:+d})")
    else:
        print(f"ILP: {ilp.get('skipped') or ilp.get('error')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lb plan", description="forecast token demand and plan capacity")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--history", metavar="FILE", help="per-window token CSV (see module docstring)")
    src.add_argument("--servegen", metavar="DIR", help="derive a history from ServeGen per-client rates")
    p.add_argument("--tokens-per-request", default="1000,250", metavar="P,D",
                   help="prompt,output tokens per request for --servegen (default 1000,250)")
    p.add_argument("--pool", default="derived/servegen", metavar="REGION/MODEL",
                   help="pool name for the --servegen history (default derived/servegen)")
    p.add_argument("--config", metavar="FILE", help="TOML with a [planner] table (see config/scaling.toml)")
    p.add_argument("--horizon", type=int, help="windows to forecast (planner.horizon, default 6)")
    p.add_argument("--out", metavar="FILE", help="write the plan as JSON here")
    args = p.parse_args(argv)
    try:
        cfg = tomllib.loads(Path(args.config).read_text()).get("planner", {}) if args.config else {}
        if args.horizon:
            cfg["horizon"] = args.horizon
        window_s = float(cfg.get("window_s", fc.WINDOW_S))
        if args.history:
            history = read_history(args.history, window_s)
        else:
            pt, ot = (float(x) for x in args.tokens_per_request.split(","))
            region, _, model = args.pool.partition("/")
            history = servegen_history(args.servegen, pt, ot, (region, model or "servegen"))
        if not history:
            raise ValueError("the history holds no windows")
        doc = plan(history, cfg)
    except (OSError, ValueError, tomllib.TOMLDecodeError) as e:
        print(f"lb plan: {e}", file=sys.stderr)
        return 2
    print_plan(doc)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
