"""`python -m lb.daemon.forecast_cli --eval DIR`: how well the core's forecasts
(`lb.core.forecast`) predict held-out days of a ServeGen folder, the measurement behind the
model choice documented there. Reading the CSV traces is this side's job; the core only
computes on series."""
from __future__ import annotations

import argparse
import csv
import glob
import os
import sys

from lb.core import forecast as fc


def load_servegen_aggregate(folder: str) -> list[float]:
    """Requests per 10-min window summed over every ServeGen client file in `folder`."""
    total: list[float] = []
    for path in sorted(glob.glob(os.path.join(folder, "*.csv"))):
        with open(path, newline="") as f:
            rates = [float(row[1] or 0.0) for row in csv.reader(f) if row]
        if len(total) < len(rates):
            total.extend([0.0] * (len(rates) - len(total)))
        for i, r in enumerate(rates):
            total[i] += r * fc.WINDOW_S
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lb.daemon.forecast_cli",
                                description="Report forecast APE on held-out days of a ServeGen folder.")
    p.add_argument("--eval", required=True, metavar="DIR", help="ServeGen folder of chunk-*-trace.csv")
    p.add_argument("--train-days", type=int, nargs="*", default=[5, 6])
    args = p.parse_args(argv)
    try:
        series = load_servegen_aggregate(args.eval)
    except (OSError, ValueError, IndexError) as e:  # a corrupt file: one line, no traceback
        print(f"python -m lb.daemon.forecast_cli: cannot read {args.eval}: {e}", file=sys.stderr)
        return 2
    if not series:
        print(f"no ServeGen traces under {args.eval}")
        return 1
    print(f"ServeGen aggregate: {len(series)} windows of 10 min ({len(series) / fc.SEASON:.1f} days)")
    print(f"{'train days':>10}  {'method':<28} {'mean APE %':>10} {'max APE %':>10}")
    for days in args.train_days:
        for name, (mean, worst) in fc.evaluate(series, days * fc.SEASON).items():
            print(f"{days:>10}  {name:<28} {mean:>10.1f} {worst:>10.1f}")
    print("PreServe Table 1: ~8 % for its model; ARIMA on bursty code traffic 26-59 %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
