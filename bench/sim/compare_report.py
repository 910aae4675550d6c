"""What `sim-compare` writes besides summary.json: the table, report.md and the plots."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

LB = "lb"
# TTFT p90 over every request sent after the warm-up, one still without a first token at the end
# counted at its wait so far (bench.sim.arena.Arena.waited)
WAITED = "ttft_p90_waited_s"
# each tenant's TTFT p90 (unanswered too), the median tenant's and the worst (bench.stats.tenant_summary)
TENANT_MEDIAN, TENANT_WORST = "tenant_p90_median_s", "tenant_p90_worst_s"
PROGRAMS = "programs_rps"  # programs started after the warm-up that ran whole, per second (program workloads)


def _fmt(entry: dict | None, scale: float = 1.0, digits: int = 2) -> str:
    if entry is None:  # a summary written before the figure existed
        return "-"
    m, (lo, hi) = entry["median"], entry["ci95"]
    if m is None:
        return "-"
    return f"{m * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"


def best_peer(summary: dict) -> str | None:
    peers = {k: v for k, v in summary["systems"].items() if not k.startswith("lb")}
    if not peers:
        return None
    return max(peers, key=lambda k: peers[k]["throughput_rps"]["median"] or 0.0)


def standing(summary: dict) -> dict | None:
    """`lb` against the peers at one load: the ratios issue 11's goals are stated in (lb / the
    best peer by throughput, lb's TTFT p90 / the lowest peer p90, lb's p90 / SGLang Router
    `cache_aware`'s) and where lb is behind with the 95 % intervals apart (not just the medians)."""
    systems = summary["systems"]
    by_thr, ours = best_peer(summary), systems.get(LB)
    if by_thr is None or ours is None:
        return None
    peers = {k: v for k, v in systems.items() if not k.startswith("lb")}
    med = lambda s, k: s[k]["median"] or 0.0  # noqa: E731
    by_p90 = min(peers, key=lambda k: peers[k]["ttft_p90_s"]["median"] or float("inf"))
    behind = []
    if ours["throughput_rps"]["ci95"][1] < peers[by_thr]["throughput_rps"]["ci95"][0]:
        behind.append(f"throughput ({by_thr})")
    by_served = max(peers, key=lambda k: med(peers[k], "served_rps"))
    if ours["served_rps"]["ci95"][1] < peers[by_served]["served_rps"]["ci95"][0]:
        behind.append(f"served over the run ({by_served})")
    if ours["ttft_p90_s"]["ci95"][0] > peers[by_p90]["ttft_p90_s"]["ci95"][1]:
        behind.append(f"TTFT p90 ({by_p90})")
    by_waited, waited = None, "-"
    if all(WAITED in s for s in systems.values()):  # summaries before it was measured lack it
        by_waited = min(peers, key=lambda k: peers[k][WAITED]["median"] or float("inf"))
        waited = _ratio(ours[WAITED]["median"], peers[by_waited][WAITED]["median"])
        if (ours[WAITED]["ci95"][0] or 0.0) > (peers[by_waited][WAITED]["ci95"][1] or float("inf")):
            behind.append(f"TTFT p90 counting the unanswered ({by_waited})")
    ca = peers.get("sglang-router cache_aware")
    return {"best_by_throughput": by_thr, "throughput": _ratio(med(ours, "throughput_rps"), med(peers[by_thr], "throughput_rps")),
            "best_by_served": by_served, "served": _ratio(med(ours, "served_rps"), med(peers[by_served], "served_rps")),
            "lowest_p90": by_p90, "p90": _ratio(ours["ttft_p90_s"]["median"], peers[by_p90]["ttft_p90_s"]["median"]),
            "p90_vs_cache_aware": _ratio(ours["ttft_p90_s"]["median"], ca["ttft_p90_s"]["median"]) if ca else "-",
            "lowest_waited": by_waited, "waited": waited,
            "behind": behind}


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def table(summary: dict) -> str:
    """Markdown table: one row per system, medians with 95 % CIs, lb's ratios underneath."""
    rows = ["| system | throughput req/s | served req/s (whole run) | programs finished /s | TTFT p50 ms | TTFT p90 ms | "
            "TTFT p90 ms, unanswered too | tenants' TTFT p90 ms: median tenant / worst | E2E p50 s | cached | cut |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary["systems"].items():
        rows.append(f"| {name} | {_fmt(s['throughput_rps'])} | {_fmt(s['served_rps'])} | {_fmt(s.get(PROGRAMS))} | "
                    f"{_fmt(s['ttft_p50_s'], 1000, 0)} | "
                    f"{_fmt(s['ttft_p90_s'], 1000, 0)} | {_fmt(s.get(WAITED), 1000, 0)} | "
                    f"{_fmt(s.get(TENANT_MEDIAN), 1000, 0)} / {_fmt(s.get(TENANT_WORST), 1000, 0)} | {_fmt(s['e2e_p50_s'])} | "
                    f"{s['cached_ratio']['median']:.2f} | {s['cut_at_deadline']} |")
    joined = {name: s["joined_busy"]["median"] for name, s in summary["systems"].items()
              if (s.get("joined_busy") or {}).get("median") is not None}
    if joined:
        rows.append("")
        rows.append("the joining replicas' busy share after they joined over the others' (1.0: as busy at once): "
                    + ", ".join(f"{name} {v:.2f}" for name, v in joined.items()))
    surged = {name: (s["surge_p90_s"], s["after_surge_p90_s"]) for name, s in summary["systems"].items()
              if (s.get("surge_p90_s") or {}).get("median") is not None}
    if surged:
        rows.append("")
        rows.append("TTFT p90 ms, unanswered too, of the requests sent during the surge / in as long a window after it: "
                    + ", ".join(f"{name} {_fmt(during, 1000, 0)} / {_fmt(after, 1000, 0)}"
                                for name, (during, after) in surged.items()))
    peer = best_peer(summary)
    ours = summary["systems"].get(LB)
    if peer and ours:
        p = summary["systems"][peer]
        rows.append("")
        rows.append(f"lb / best peer ({peer}, by throughput): throughput "
                    f"{_ratio(ours['throughput_rps']['median'], p['throughput_rps']['median'])} (> 1: lb better), "
                    f"TTFT p50 {_ratio(ours['ttft_p50_s']['median'], p['ttft_p50_s']['median'])}, "
                    f"TTFT p90 {_ratio(ours['ttft_p90_s']['median'], p['ttft_p90_s']['median'])} (< 1: lb better)")
        st = standing(summary)
        rows.append(f"lb / lowest peer TTFT p90 ({st['lowest_p90']}): {st['p90']}; lb / sglang-router cache_aware "
                    f"TTFT p90: {st['p90_vs_cache_aware']}; lb / lowest peer TTFT p90 counting the requests still "
                    f"unanswered at the end ({st['lowest_waited'] or '-'}): {st['waited']}; behind with the intervals apart: "
                    f"{', '.join(st['behind']) or 'nowhere'}")
    return "\n".join(rows)


def report_md(summary: dict) -> str:
    lines = [f"# sim-compare {summary['workload']}", "",
             f"Offered load {summary['load']:g} x measured capacity {summary['capacity_rps']:.2f} req/s "
             f"({summary['offered_rps']:.2f} req/s), {summary['seeds']} seeds of {summary['duration_s']:g} s "
             "virtual time each, every system on the same arrivals.", "",
             f"Figures: {summary['ci']}; {summary['counts']}. `cut` = requests still in flight when the "
             "run ended (not errors). Latencies are over the requests sent after the warm-up that were "
             "answered by the end, except `TTFT p90 ms, unanswered too`: every request sent after the "
             "warm-up, one without a first token at the end counted at its wait so far (past capacity "
             "a system that leaves more requests waiting looks better on answered requests alone), and the "
             "tenants' p90 (each user with 20 or more requests after the warm-up: its own p90 the same way; "
             "the median tenant's and the worst; `-` where fewer than two users sent that many). `programs "
             "finished /s`: programs (trees, conversations, agent sessions) started after the warm-up that "
             "ran whole by the end, per second (`-` for replays).", "",
             table(summary), "",
             "![TTFT CDF](ttft_cdf.png)", "", "![throughput](throughput.png)", ""]
    return "\n".join(lines)


def plots(summary: dict, runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["systems"])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name in names:
        ttft = np.sort(np.concatenate([np.array(r["ttft"]) for r in runs if r["system"] == name] or [np.empty(0)]))
        if len(ttft):
            ax.plot(ttft * 1000, np.arange(1, len(ttft) + 1) / len(ttft), label=name,
                    linewidth=2.2 if name.startswith("lb") else 1.2)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{summary['workload']}: TTFT CDF, all seeds (load {summary['load']:g})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    med = [summary["systems"][n]["throughput_rps"]["median"] for n in names]
    lo = [m - summary["systems"][n]["throughput_rps"]["ci95"][0] for n, m in zip(names, med)]
    hi = [summary["systems"][n]["throughput_rps"]["ci95"][1] - m for n, m in zip(names, med)]
    ax.bar(range(len(names)), med, yerr=[lo, hi], capsize=4,
           color=["tab:green" if n.startswith("lb") else "tab:gray" for n in names])
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("throughput (req/s), median and 95 % CI")
    ax.set_title(f"{summary['workload']}: throughput at load {summary['load']:g}")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)


def sweep_plot(workload: str, summaries: dict[float, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted(summaries)
    names = list(next(iter(summaries.values()))["systems"])
    fig, ax = plt.subplots(1, 2, figsize=(13, 5))
    for name in names:
        thr = [summaries[f]["systems"][name]["throughput_rps"]["median"] for f in loads]
        p90 = [summaries[f]["systems"][name]["ttft_p90_s"]["median"] for f in loads]
        width = 2.2 if name.startswith("lb") else 1.2
        ax[0].plot(loads, thr, marker="o", label=name, linewidth=width)
        ax[1].plot(loads, [None if v is None else v * 1000 for v in p90], marker="o", label=name, linewidth=width)
    ax[0].set_xlabel("offered load (x capacity)")
    ax[0].set_ylabel("throughput (req/s)")
    ax[1].set_xlabel("offered load (x capacity)")
    ax[1].set_ylabel("TTFT p90 (ms, log)")
    ax[1].set_yscale("log")
    ax[0].legend(fontsize=7)
    fig.suptitle(f"{workload}: throughput and P90 TTFT against load")
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)
    lines = [f"# sim-compare {workload} --sweep", "", "![sweep](sweep.png)", "",
             "| load | lb / best peer throughput | lb / best peer served (whole run) | lb / lowest peer TTFT p90 | "
             "lb / cache_aware TTFT p90 | lb / lowest peer TTFT p90, unanswered too | lb behind, intervals apart |",
             "|---|---|---|---|---|---|---|"]
    for f in loads:
        st = standing(summaries[f])
        if st:
            lines.append(f"| {f:g} | {st['throughput']} ({st['best_by_throughput']}) | {st['served']} ({st['best_by_served']}) | "
                         f"{st['p90']} ({st['lowest_p90']}) | "
                         f"{st['p90_vs_cache_aware']} | {st['waited']} ({st['lowest_waited'] or '-'}) | "
                         f"{', '.join(st['behind']) or '-'} |")
    lines.append("")
    for f in loads:
        lines += [f"## load {f:g}", "", table(summaries[f]), ""]
    (out / "report.md").write_text("\n".join(lines))


def suite_table(summaries: dict[str, dict[float, dict]]) -> str:
    """One row per workload, one column per load: `lb` / the best peer's throughput (window),
    / the best peer's requests served over the run, `lb`'s TTFT p90 / the lowest peer's,
    / `cache_aware`'s; `*` where `lb` is behind with the 95 % intervals apart on any of them."""
    loads = sorted({f for by_load in summaries.values() for f in by_load})
    rows = ["| workload (capacity req/s) | " + " | ".join(f"{f:g}" for f in loads) + " |",
            "|---|" + "---|" * len(loads)]
    for workload, by_load in summaries.items():
        capacity = next(iter(by_load.values()))["capacity_rps"]
        cells = []
        for f in loads:
            st = standing(by_load[f]) if f in by_load else None
            cells.append("-" if st is None else f"{st['throughput']} / {st['served']} / {st['p90']} / "
                         f"{st['p90_vs_cache_aware']}{'*' if st['behind'] else ''}")
        rows.append(f"| {workload} ({capacity:.2f}) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def read_sweep(folder: Path) -> dict[float, dict]:
    """The per-load summaries a `sim-compare W --sweep --out FOLDER` wrote."""
    by_load = {}
    for path in sorted(folder.glob("load-*/summary.json")):
        summary = json.loads(path.read_text())
        by_load[summary["load"]] = summary
    if not by_load:
        raise SystemExit(f"{folder}: no load-*/summary.json (run `lb-bench sim-compare W --sweep --out {folder}`)")
    return by_load


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.sim.compare_report SWEEP_DIR...`: the suite's standing, one row a sweep."""
    parser = argparse.ArgumentParser(prog="python -m bench.sim.compare_report", description=main.__doc__)
    parser.add_argument("sweeps", nargs="+", type=Path, help="folders written by `lb-bench sim-compare W --sweep --out F`")
    args = parser.parse_args(argv)
    summaries: dict[str, dict[float, dict]] = {}
    for folder in args.sweeps:  # sweeps of one workload's systems in parts are joined
        for load, summary in read_sweep(folder).items():
            known = summaries.setdefault(summary["workload"], {}).setdefault(load, summary)
            known["systems"] = {**known["systems"], **summary["systems"]}
    print(suite_table(summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
