"""`lb-bench scenario NAME [--quick] [--out DIR]` and `lb-bench scenario --list`.

Imports `bench/scenarios/<NAME with - → _>.py`, calls its `run(out_dir, quick)`, writes
`out_dir/summary.json`, prints the variants side by side with ratios to the baseline (the
summary's `baseline`, else its first variant), prints the scenario's warnings, and plots
TTFT CDFs and throughput bars next to the summary.

Scenario modules build their variants with `run_variant`, which runs one bounded workload
through `bench.client` while metering CPU of every process, so a saturated machine is
called out instead of silently skewing the comparison.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

from bench import report
from bench.fleet import CpuMeter, Fleet, saturation_warning
from bench.profiles import SCHEDULE_POLICIES

NOT_SCENARIOS = {"runner"}


def module_name(scenario: str) -> str:
    return "bench.scenarios." + scenario.replace("-", "_")


def scenario_names() -> list[str]:
    import bench.scenarios as pkg
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(pkg.__path__)
                  if not m.name.startswith("_") and m.name not in NOT_SCENARIOS)


def run_variant(fleet: Fleet, targets: list[str], workload: str, *, label: str = "",
                warnings: list[str] | None = None, **bench_args) -> dict:
    """One variant: `bench.client.run_bench` under a CPU meter. The run JSON gains `machine`
    (wall, CPU seconds per process, cores used); a saturation warning lands in `warnings`."""
    from bench.client import run_bench

    meter = CpuMeter(fleet)
    result, _ = asyncio.run(run_bench(targets, workload, **bench_args))
    result["machine"] = meter.result()
    warning = saturation_warning(result["machine"], f"[{label}] " if label else "")
    if warning and warnings is not None:
        warnings.append(warning)
    return result


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="scenario name (see --list)")
    parser.add_argument("--quick", action="store_true", help="shrink to about a minute (smoke run)")
    parser.add_argument("--out", type=Path, help="output folder (default out/<name>)")
    parser.add_argument("--list", action="store_true", help="list scenarios with one line each")
    parser.add_argument("--repeats", type=int, metavar="N",
                        help="compare-* scenarios: runs per system, interleaved (default 3; --quick 1)")
    parser.add_argument("--duration", type=float, metavar="S",
                        help="run time in seconds, for scenarios that take one (chaos, compare-*)")
    parser.add_argument("--systems", metavar="A,B",
                        help="compare-* scenarios: only these systems (comma-separated names as the report lists them)")
    parser.add_argument("--no-stream", action="store_true",
                        help="compare-* scenarios: clients ask for whole answers (stream: false)")
    parser.add_argument("--no-session-headers", action="store_true",
                        help="compare-* scenarios: clients send none of lb's x-lb-* headers, as the openai SDK does")
    parser.add_argument("--clients", type=int, metavar="N",
                        help="compare-* scenarios in one region: closed-loop clients (more than the scenario's "
                             "default runs its fleet past capacity)")
    parser.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES,
                        help="compare-* scenarios on SGLang's scheduler (compare-long-short): the emulators' "
                             "waiting-queue order, as SGLang's --schedule-policy: fcfs (arrival order, today's "
                             "default) or lpm (longest cached prefix first, older releases' default)")
    parser.add_argument("--mixed-engines", action="store_true",
                        help="compare-* scenarios in one region: every second replica on SGLang's scheduler, the "
                             "rest on the scenario's (a fleet of vLLM and SGLang replicas side by side)")
    parser.add_argument("--speed", type=float, metavar="F",
                        help="compare-* scenarios: engines (and replays, tool runs, lb's time constants, WAN latency) "
                             "F× faster instead of the scenario's own speed-up; lower it where the machine's cores "
                             "are short (each ms an emulator waits for a core counts F× in engine time)")
    parser.add_argument("--lb-config", metavar="FILE",
                        help="compare-* scenarios: also run lb with this daemon config file as the system 'lb config' "
                             "(its durations in engine time, scaled by the scenario's speed-up like lb's defaults)")


def list_scenarios() -> str:
    lines = []
    for name in scenario_names():
        try:
            description = getattr(importlib.import_module(module_name(name)), "DESCRIPTION", "(no description)")
        except Exception as e:  # one broken scenario must not hide the others
            description = f"(cannot import: {e})"
        lines.append(f"{name:28s} {description}")
    return "\n".join(lines)


def present(summary: dict, out_dir: Path) -> None:
    """Table, warnings and plots of a scenario summary."""
    variants = summary.get("variants") or {}
    print(f"scenario {summary['scenario']}  →  {out_dir / 'summary.json'}")
    if summary.get("skipped"):
        print(f"skipped: {summary['skipped']}")
    if variants:
        baseline = summary.get("baseline") or next(iter(variants))
        print(report.format_comparison(variants, baseline))
        report.plot_ttft_cdfs(variants, out_dir / "ttft_cdf.png")
        report.plot_throughput(variants, out_dir / "throughput.png")
    for note in summary.get("notes", []):
        print(f"note: {note}")
    for warning in summary.get("warnings", []):
        print(f"WARNING: {warning}")


def run(args: argparse.Namespace) -> int:
    if args.list or not args.name:
        print(list_scenarios())
        return 0 if args.list else 2
    if args.name not in scenario_names():
        print(f"unknown scenario {args.name!r}; known: {', '.join(scenario_names())}", file=sys.stderr)
        return 2
    out_dir = args.out or Path("out") / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    module = importlib.import_module(module_name(args.name))
    extra = {}
    if getattr(args, "duration", None) is not None:
        if "duration" not in inspect.signature(module.run).parameters:
            print(f"scenario {args.name} does not take --duration", file=sys.stderr)
            return 2
        extra["duration"] = args.duration
    if getattr(args, "repeats", None) is not None:
        if "repeats" not in inspect.signature(module.run).parameters:
            print(f"scenario {args.name} does not take --repeats", file=sys.stderr)
            return 2
        extra["repeats"] = args.repeats
    if getattr(args, "systems", None):
        if "systems" not in inspect.signature(module.run).parameters:
            print(f"scenario {args.name} does not take --systems", file=sys.stderr)
            return 2
        extra["systems"] = args.systems
    for option, key in (("clients", "clients"), ("lb_config", "lb_config"), ("schedule_policy", "schedule_policy"),
                        ("speed", "speed")):
        if getattr(args, option, None) is not None:
            if key not in inspect.signature(module.run).parameters:
                print(f"scenario {args.name} does not take --{option.replace('_', '-')}", file=sys.stderr)
                return 2
            extra[key] = getattr(args, option)
    if getattr(args, "no_session_headers", False):
        if "lb_headers" not in inspect.signature(module.run).parameters:
            print(f"scenario {args.name} does not take --no-session-headers", file=sys.stderr)
            return 2
        extra["lb_headers"] = False
    if getattr(args, "mixed_engines", False):
        if "mixed_engines" not in inspect.signature(module.run).parameters:
            print(f"scenario {args.name} does not take --mixed-engines", file=sys.stderr)
            return 2
        extra["mixed_engines"] = True
    if getattr(args, "no_stream", False):
        if "stream" not in inspect.signature(module.run).parameters:
            print(f"scenario {args.name} does not take --no-stream", file=sys.stderr)
            return 2
        extra["stream"] = False
    summary = module.run(out_dir, args.quick, **extra)
    summary = {"scenario": args.name, **{k: v for k, v in summary.items() if k != "scenario"}}
    report.write_summary(out_dir / "summary.json", summary)
    present(summary, out_dir)
    return 0
