"""The capacity loop reads `lb plan` output (issue 6): `[scaling] plan_file`, re-read when it
changes, feeds `planned` into each pool's signals, so the long-term strategies follow the plan
live instead of falling back to reactive."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon.conftest import needs_emulator, start_emulator, start_lb
from tests.daemon.test_capacity import metrics, poll
from tests.daemon.test_planner_cli import CONFIG
from tests.procs import REPO

pytestmark = [needs_emulator, pytest.mark.timeout(120)]


def write_history(path: Path, end: float, days: int = 4, season: int = 24) -> None:
    """Windows of absolute (unix) time ending at `end`, for the daemon's pool local/m."""
    first = end - days * season * 600
    lines = ["window_start,region,model,prompt_tokens,output_tokens,instances,slo_violations"]
    for w in range(days * season):
        level = 1 + 0.5 * math.sin(2 * math.pi * w / season)
        lines.append(f"{first + w * 600:.0f},local,m,{240_000 * level:.0f},{24_000 * level:.0f},4,0")
    path.write_text("\n".join(lines) + "\n")


def gauge(url: str, family: str) -> float | None:
    for s in metrics(url).get(family, []):
        if s.labels == {"region": "local", "model": "m"}:
            return s.value
    return None


def test_lt_i_follows_the_plan_file_and_its_changes(tmp_path):
    hist, plan_cfg, plan = tmp_path / "h.csv", tmp_path / "planner.toml", tmp_path / "plan.json"
    write_history(hist, end=math.floor(time.time() / 600) * 600)
    plan_cfg.write_text(CONFIG)
    r = subprocess.run([sys.executable, "-m", "lb.daemon.cli", "plan", "--history", str(hist), "--config",
                        str(plan_cfg), "--out", str(plan)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(plan.read_text())
    pool = doc["pools"][0]
    assert (pool["region"], pool["model"]) == ("local", "m") and "starts_at" in pool
    first = pool["preserve_instances"][0]
    # one level for every window: the plan's windows are 10 minutes of wall clock, and a run
    # that crossed a boundary read the next window's count (a flake seen at 01:20)
    pool["preserve_instances"] = [first] * len(pool["preserve_instances"])
    plan.write_text(json.dumps(doc))

    emu, url = start_emulator("--speed", "4")
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f'[scaling]\nstrategy = "lt-i"\ninterval_s = 0.1\nplan_file = "{plan}"\n'
                   f'[[replicas]]\nurl = "{url}"\nengine = "sglang"\nmodels = ["m"]\n')
    d = start_lb(config=cfg)
    try:
        poll(lambda: gauge(d.url, "lb_planned_replicas") == first, 15, f"planned = {first} from the plan file")
        poll(lambda: gauge(d.url, "lb_desired_replicas") == first, 5, "lt-i to ask for the plan")
        # a new plan (written the way an operator would: to a temp file, then renamed over)
        doc["pools"][0]["preserve_instances"] = [first + 3] * len(pool["preserve_instances"])
        tmp = tmp_path / "plan.json.new"
        tmp.write_text(json.dumps(doc))
        tmp.replace(plan)
        poll(lambda: gauge(d.url, "lb_desired_replicas") == first + 3, 10, "lt-i to follow the new plan")
        plan.write_text("{not json")  # a broken plan keeps the last good one
        poll(lambda: "not a usable `lb plan` document" in d.proc.log(), 10, "the bad plan to be reported")
        assert gauge(d.url, "lb_planned_replicas") == first + 3
        plan.unlink()  # no plan: planned is gone, lt-i decides reactively
        poll(lambda: gauge(d.url, "lb_planned_replicas") is None, 10, "the plan to be dropped")
    finally:
        d.proc.stop()
        emu.stop()
