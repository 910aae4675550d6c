"""Markdown reports of comparison scenarios (`compare-*`): one table per scenario, each figure
also as a ratio to the best peer (the best system that is not `lb` on that metric).

    python -m bench.report_md out/compare-tot out/compare-multiturn ...   # their report.md, joined
    python -m bench.report_md --into docs/results.md out/compare-*        # refresh the generated part
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# (header, path in the run JSON, scale, format, higher is better)
COLUMNS: list[tuple[str, tuple[str, ...], float, str, bool]] = [
    ("req/s", ("throughput_rps",), 1, "{:.2f}", True),
    ("out tok/s", ("output_tokens_per_s",), 1, "{:.0f}", True),
    ("TTFT p50 ms", ("ttft_s", "p50"), 1000, "{:.0f}", False),
    ("TTFT p90 ms", ("ttft_s", "p90"), 1000, "{:.0f}", False),
    ("TTFT mean ms", ("ttft_s", "mean"), 1000, "{:.0f}", False),
    ("E2E p50 s", ("e2e_s", "p50"), 1, "{:.2f}", False),
    ("cached", ("cached_token_ratio",), 1, "{:.3f}", True),
    ("imbalance", ("load", "imbalance"), 1, "{:.2f}", False),
    ("errors", ("errors",), 1, "{:.0f}", False),
]

# The same runs after their first fifth (`steady` in the run JSON, bench.stats.steady_summary):
# what the simulator's `sim-compare` measures.
STEADY_COLUMNS: list[tuple[str, tuple[str, ...], float, str, bool]] = [
    ("req/s", ("steady", "throughput_rps"), 1, "{:.2f}", True),
    ("TTFT p50 ms", ("steady", "ttft_s", "p50"), 1000, "{:.0f}", False),
    ("TTFT p90 ms", ("steady", "ttft_s", "p90"), 1000, "{:.0f}", False),
    ("cached", ("steady", "cached_token_ratio"), 1, "{:.3f}", True),
]


def value(run: dict, path: tuple[str, ...], scale: float = 1) -> float | None:
    v = run
    for key in path:
        v = v.get(key) if isinstance(v, dict) else None
    return v * scale if isinstance(v, (int, float)) else None


def is_lb(run: dict) -> bool:
    return (run.get("system") or {}).get("family") == "lb"


def best_peer(variants: dict[str, dict], path: tuple[str, ...], higher: bool) -> float | None:
    peers = [v for r in variants.values() if not is_lb(r) and (v := value(r, path)) is not None]
    if not peers:
        return None
    return max(peers) if higher else min(peers)


def _cell(v: float | None, best: float | None, fmt: str, scale: float) -> str:
    if v is None:
        return "-"
    text = fmt.format(v * scale)
    if best:  # 0 or None: no meaningful ratio
        text += f" ({v / best:.2f}×)"
    return text


def table(variants: dict[str, dict], columns=COLUMNS) -> str:
    rows = ["| system | " + " | ".join(c[0] for c in columns) + " |",
            "|---|" + "---:|" * len(columns)]
    bests = {c[0]: best_peer(variants, c[1], c[4]) for c in columns}
    for name, run in variants.items():
        cells = [_cell(value(run, path), bests[h], fmt, scale) for h, path, scale, fmt, _ in columns]
        rows.append(f"| {'**' + name + '**' if is_lb(run) else name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def headline(variants: dict[str, dict]) -> list[str]:
    """One line per lb variant: throughput and latency against the best peer."""
    lines = []
    tput, p50, p90 = (best_peer(variants, p, h) for p, h in
                      ((("throughput_rps",), True), (("ttft_s", "p50"), False), (("ttft_s", "p90"), False)))
    for name, run in variants.items():
        if not is_lb(run) or not tput:
            continue
        parts = [f"{value(run, ('throughput_rps',)) / tput:.2f}× the best peer's throughput"]
        for label, best, path in (("P50", p50, ("ttft_s", "p50")), ("P90", p90, ("ttft_s", "p90"))):
            v = value(run, path)
            if v and best:
                parts.append(f"{best / v:.2f}× lower {label} TTFT" if v <= best else f"{v / best:.2f}× higher {label} TTFT")
        lines.append(f"- **{name}**: " + ", ".join(parts))
    return lines


def scenario_markdown(summary: dict, plots: dict[str, str] | None = None, level: int = 1) -> str:
    h = "#" * level
    variants = summary.get("variants") or {}
    out = [f"{h} {summary.get('title') or summary.get('scenario', 'comparison')}", ""]
    if summary.get("command"):
        out += [f"Command: `{summary['command']}`", ""]
    machines = [r["machine"] for r in variants.values() if r.get("machine")]
    if machines:
        out += [f"Machine: {machines[0]['cores']} cores shared by everything (emulators are CPU-only Python "
                f"processes, the client, the systems under test); busiest run used "
                f"{max(m['cores_used'] for m in machines):.2f} cores"
                + (f"; the whole machine (other work included) was {min(hb):.2f}–{max(hb):.2f} cores busy during the runs"
                   if (hb := [m["host_cores_busy"] for m in machines if "host_cores_busy" in m]) else "") + ".", ""]
    setup = summary.get("setup")
    if setup:
        out += ["Setup: `" + json.dumps(setup, separators=(", ", ": ")) + "`", ""]
    if variants:
        out += [table(variants), "",
                "Ratios are each value ÷ the best peer's (the best non-`lb` system on that column: highest "
                "req/s, tok/s and cached ratio, lowest latency, imbalance and errors). `imbalance`: mean over "
                "samples every 0.25 s of (max − min) running + waiting requests across replicas.", ""]
        out += headline(variants) + [""]
        if any(value(r, ("steady", "throughput_rps")) for r in variants.values()):
            warm = max(value(r, ("steady", "from_s")) or 0.0 for r in variants.values())
            out += [f"After the warm-up (requests from {warm:.0f} s on, the first fifth of the run left out as "
                    "the simulator does; throughput over the answers that ended after it):", "",
                    table(variants, STEADY_COLUMNS), ""]
    for name, reason in (summary.get("skipped") or {}).items():
        out.append(f"- skipped **{name}**: {reason}")
    if summary.get("skipped"):
        out.append("")
    for key, label in (("notes", "Note"), ("paper", "Paper"), ("warnings", "WARNING")):
        out += [f"- {label}: {line}" for line in summary.get(key) or []]
    out.append("")
    for title, path in (plots or {}).items():
        out += [f"![{title}]({path})", ""]
    return "\n".join(out)


GENERATED = "<!-- generated by python -m bench.report_md --into; do not edit below -->"


def overview(dirs: list[Path]) -> str:
    """One row per scenario: its first lb variant against the best peer on each headline metric."""
    rows = ["| scenario | lb variant | throughput vs best peer | P50 TTFT: best peer ÷ lb | P90 TTFT: best peer ÷ lb "
            "| cached: lb vs best peer | systems measured / skipped |", "|---|---|---:|---:|---:|---:|---:|"]
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text())
        variants = summary.get("variants") or {}
        ours = next((n for n, r in variants.items() if is_lb(r)), None)
        if ours is None:
            continue
        run = variants[ours]

        def peer(path: tuple[str, ...], higher: bool) -> str:
            best = best_peer(variants, path, higher)
            v = value(run, path)
            if not best or not v:
                return "-"
            who = next(n for n, r in variants.items() if not is_lb(r) and value(r, path) == best)
            return f"{(v / best if higher else best / v):.2f}× ({who})"
        cached = best_peer(variants, ("cached_token_ratio",), True)
        rows.append(f"| `{summary.get('scenario', d.name)}` | {ours} | {peer(('throughput_rps',), True)} | "
                    f"{peer(('ttft_s', 'p50'), False)} | {peer(('ttft_s', 'p90'), False)} | "
                    f"{run.get('cached_token_ratio', 0):.3f} vs {cached or 0:.3f} | "
                    f"{len(variants)} / {len(summary.get('skipped') or {})} |")
    return "\n".join(rows)


def joined(dirs: list[Path], plots_to: Path | None = None, link_prefix: str = "") -> str:
    """The report.md of each scenario folder, one heading level down; plots copied to
    `plots_to` (as `<scenario>-<plot>.png`) when given, else linked where they are."""
    parts = []
    for d in dirs:
        text = (d / "report.md").read_text()
        text = "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())
        for plot in ("ttft_cdf.png", "throughput.png"):
            if plots_to is not None and (d / plot).exists():
                plots_to.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(d / plot, plots_to / f"{d.name}-{plot}")
                text = text.replace(f"]({plot})", f"]({link_prefix}{d.name}-{plot})")
            else:
                text = text.replace(f"]({plot})", f"]({d / plot})")
        parts.append(text.rstrip() + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report_md", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="scenario output folders holding report.md")
    parser.add_argument("--into", type=Path, help="replace what follows the generated marker in this markdown file "
                        "(plots copied next to it, under results/)")
    args = parser.parse_args(argv)
    if not args.into:
        print(joined(args.dirs))
        return 0
    head = args.into.read_text().split(GENERATED)[0] if args.into.exists() else ""
    body = overview(args.dirs) + "\n\n" + joined(args.dirs, args.into.parent / "results", "results/")
    args.into.write_text(head.rstrip() + "\n\n" + GENERATED + "\n\n" + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
