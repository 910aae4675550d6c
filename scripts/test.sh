#!/usr/bin/env bash
# The test command README gives. Runs the whole suite; CI runs exactly this.
# LB_TEST_WORKERS: test processes (default 2; 0 runs everything in this one process).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
workers=()
if "$PY" -c "import xdist" 2>/dev/null; then
  workers=(-n "${LB_TEST_WORKERS:-2}")
fi
exec "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" "$@"
