"""Human-readable tables and plots of run JSON (one run, or scenario variants side by side).

matplotlib is imported only inside the plotting functions, so `lb-bench run` never pays for it.
"""
from __future__ import annotations

import json
from pathlib import Path

# (label, getter) rows of the tables; getters read the run JSON schema (docs/bench.md, run JSON).
ROWS: list[tuple[str, str, tuple[str, ...]]] = [
    ("requests", "{:.0f}", ("requests",)),
    ("ok", "{:.0f}", ("ok",)),
    ("errors", "{:.0f}", ("errors",)),
    ("duration s", "{:.1f}", ("duration_s",)),
    ("throughput req/s", "{:.2f}", ("throughput_rps",)),
    ("output tok/s", "{:.1f}", ("output_tokens_per_s",)),
    ("TTFT p50 ms", "{:.1f}", ("ttft_s", "p50")),
    ("TTFT p90 ms", "{:.1f}", ("ttft_s", "p90")),
    ("TTFT p99 ms", "{:.1f}", ("ttft_s", "p99")),
    ("E2E p50 s", "{:.2f}", ("e2e_s", "p50")),
    ("E2E p99 s", "{:.2f}", ("e2e_s", "p99")),
    ("cached-token ratio", "{:.3f}", ("cached_token_ratio",)),
]
MS_ROWS = {"TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms"}
MAX_GROUPS_SHOWN = 40  # tenants or tiers listed one a line


def _get(report: dict, path: tuple[str, ...]) -> float | None:
    value = report
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, (int, float)) else None


def _value(report: dict, label: str, path: tuple[str, ...]) -> float | None:
    value = _get(report, path)
    return value * 1000 if value is not None and label in MS_ROWS else value


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_run(report: dict) -> str:
    """One run: the main metrics, then one line per tenant and per tier."""
    rows = []
    for label, fmt, path in ROWS:
        value = _value(report, label, path)
        rows.append([label, "-" if value is None else fmt.format(value)])
    out = [f"workload {report.get('workload')} → {report.get('target')}", _table(["metric", "value"], rows)]
    if report.get("errors_by_kind"):
        out.append("errors: " + ", ".join(f"{k}={v}" for k, v in report["errors_by_kind"].items()))
    programs = report.get("programs")
    if programs:
        rate = programs.get("finished_rps")
        out.append(f"programs: {programs['started']} started, {programs['finished']} ran whole, "
                   f"{'-' if rate is None else f'{rate:.2f}'}/s of those started after the warm-up")
    for group in ("per_tenant", "per_tier"):
        groups = report.get(group) or {}
        if 0 < len(groups) <= MAX_GROUPS_SHOWN:
            out.append(format_groups(group, groups))
        elif groups:  # each program its own user (--program-rate): thousands of one-tree tenants
            out.append(f"{group.replace('_', ' ')}: {len(groups)} groups, not listed (the run JSON has them)")
    return "\n".join(out)


def format_groups(title: str, groups: dict[str, dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"
    rows = [[name, str(g["requests"]), str(g["errors"]), f"{g['throughput_rps']:.2f}",
             ms(g["ttft_s"]["p50"]), ms(g["ttft_s"]["p90"]), f"{g['cached_token_ratio']:.3f}"]
            for name, g in groups.items()]
    return _table([title.replace("_", " "), "requests", "errors", "req/s", "TTFT p50 ms",
                   "TTFT p90 ms", "cached"], rows)


def format_comparison(variants: dict[str, dict], baseline: str) -> str:
    """Variants side by side; each cell is `value (ratio to baseline)`."""
    names = list(variants)
    rows = []
    for label, fmt, path in ROWS:
        base = _value(variants[baseline], label, path)
        row = [label]
        for name in names:
            value = _value(variants[name], label, path)
            cell = "-" if value is None else fmt.format(value)
            if name != baseline and value is not None and base:
                cell += f" ({value / base:.2f}×)"
            row.append(cell)
        rows.append(row)
    return _table(["metric", *[f"{n} (baseline)" if n == baseline else n for n in names]], rows)


def write_summary(path: Path, summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def plot_ttft_cdfs(variants: dict[str, dict], path: Path) -> Path | None:
    """TTFT CDF per variant, from each run's `ttft_quantiles_s`."""
    curves = {n: v["ttft_quantiles_s"] for n, v in variants.items() if v.get("ttft_quantiles_s")}
    if not curves:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, qs in curves.items():
        ax.plot([q * 1000 for q in qs], [i / (len(qs) - 1) for i in range(len(qs))], label=name, marker=".")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput(variants: dict[str, dict], path: Path) -> Path | None:
    """Request and output-token throughput per variant, as bars."""
    if not variants:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(variants)
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.5))
    left.bar(names, [variants[n].get("throughput_rps") or 0 for n in names], color="tab:blue")
    left.set_ylabel("requests / s")
    right.bar(names, [variants[n].get("output_tokens_per_s") or 0 for n in names], color="tab:orange")
    right.set_ylabel("output tokens / s")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
