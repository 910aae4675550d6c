"""`lb-bench`: the proof side of the project (emulator, client, scenarios, simulator).

Each subcommand lives in its own module exposing `configure(parser)` and `run(args) -> int`;
modules are imported only when their subcommand runs, so `lb-bench emulate` never pays for
matplotlib or scipy.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from lb import __version__

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "emulate": ("bench.emulator", "serve the engine model behind SGLang/vLLM/OpenAI HTTP faces"),
    "run": ("bench.client", "run a workload against a target URL and write a JSON report"),
    "scenario": ("bench.scenarios.runner", "run a named side-by-side benchmark scenario"),
    "calibrate": ("bench.calibrate", "print engine-profile timings next to their sources"),
    "cluster": ("bench.cluster", "start a local multi-region testbed on loopback"),
    "sim": ("bench.sim.cli", "discrete-event simulation of regions, LBs and replicas"),
    "sim-compare": ("bench.sim.compare", "lb vs the peers' published algorithms in the simulator, seeds and CIs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lb-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lb-bench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, helptext) in SUBCOMMANDS.items():
        sub.add_parser(name, help=helptext, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv or ["--help"])
        return 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    subparser = argparse.ArgumentParser(prog=f"lb-bench {name}", description=SUBCOMMANDS[name][1])
    module.configure(subparser)
    args = subparser.parse_args(argv[1:])
    from bench.traces import TraceError
    try:
        return int(module.run(args) or 0)
    except TraceError as e:  # a missing or corrupt dataset: say which, no traceback
        print(f"lb-bench {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
