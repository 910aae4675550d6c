"""Scenario runner: listing, a --quick scenario end to end, tables, CPU metering, fleet cleanup."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import report
from bench.fleet import Fleet, cpu_seconds, saturation_warning
from bench.scenarios.runner import scenario_names
from tests.procs import lb_bench


def test_list_names_every_scenario_with_its_description():
    done = subprocess.run(lb_bench("scenario", "--list"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert {"calibration", "sglang-router-smoke"} <= set(lines) == set(scenario_names())
    assert "CPU cost per 1,000 streamed tokens" in lines["calibration"]


def test_unknown_scenario_is_refused():
    done = subprocess.run(lb_bench("scenario", "no-such"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "calibration" in done.stderr


def test_calibration_quick_runs_end_to_end_and_writes_summary(tmp_path):
    done = subprocess.run(lb_bench("scenario", "calibration", "--quick", "--out", str(tmp_path)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["scenario"] == "calibration"
    assert summary["calibration"]["profiles"]["l4-llama3-8b"]["prefill_512_ms"] > 0  # bench.calibrate's numbers
    live = summary["variants"]["live"]
    assert live["ok"] == live["requests"] > 0 and live["ttft_s"]["p50"] > 0
    assert live["emulator_cpu_s_per_1k_tokens"] > 0
    assert live["machine"]["cpu_s"]["emu"] > 0 and live["machine"]["wall_s"] >= 8
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0 and (tmp_path / "throughput.png").stat().st_size > 0
    assert "per 1,000 tokens" in done.stdout and "live (baseline)" in done.stdout


def test_comparison_table_shows_ratios_to_the_baseline():
    def variant(rps, p50):
        return {"throughput_rps": rps, "ttft_s": {"p50": p50, "p90": None, "p99": None, "mean": None}}
    table = report.format_comparison({"a": variant(10.0, 0.1), "b": variant(15.0, 0.05)}, "a")
    assert "a (baseline)" in table
    rps_line = next(line for line in table.splitlines() if line.startswith("throughput"))
    assert "15.00 (1.50×)" in rps_line
    ttft_line = next(line for line in table.splitlines() if line.startswith("TTFT p50"))
    assert "100.0" in ttft_line and "50.0 (0.50×)" in ttft_line


def test_saturation_warning_only_when_cores_are_nearly_busy():
    busy = {"wall_s": 10.0, "cpu_s": {"emu0": 9.0, "client": 9.5}, "cores_used": 1.85, "cores": 2}
    idle = {**busy, "cpu_s": {"emu0": 1.0}, "cores_used": 0.1}
    assert "1.85 of 2 cores" in saturation_warning(busy, "[x] ")
    assert saturation_warning(idle) is None


def test_fleet_meters_cpu_of_its_processes_and_stops_them(tmp_path):
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n" \
           "import http.server, sys\nhttp.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), " \
           "http.server.SimpleHTTPRequestHandler).serve_forever()\n"
    from bench.fleet import free_port
    port = free_port()
    with Fleet(tmp_path) as fleet:
        service = fleet.start("spinner", [sys.executable, "-c", spin, str(port)], "/", port)
        assert cpu_seconds(service.pid) >= 0.25
        assert fleet.cpu()["spinner"] >= 0.25
    assert service.popen.poll() is not None  # stopped when the block ended


def test_ha_pair_agents_runs_one_lb_and_a_pair_end_to_end(tmp_path):
    """The scenario behind the HA pair's figure (docs/results.md), shrunk: both variants serve
    agent sessions without headers with no error, and the report carries the pair's ratios."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (scripts/install-deps.sh installs it)")
    done = subprocess.run(lb_bench("scenario", "ha-pair-agents", "--quick", "--duration", "6", "--clients", "8",
                                   "--no-session-headers", "--out", str(tmp_path)),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name in ("one lb", "two lb + redis"):
        v = summary["variants"][name]
        assert v["ok"] == v["requests"] > 0 and v["errors"] == 0 and v["lb_headers"] is False
    assert any(n.startswith("pair / one: throughput") for n in summary["notes"])
