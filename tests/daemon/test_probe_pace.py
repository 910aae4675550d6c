"""An idle replica is probed every `probes.idle_intervals` intervals, a busy one every interval:
a real `lb` over the engine emulator, its probes counted on its own /metrics."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.daemon.conftest import http_json, needs_emulator, start_lb_with_emulator
from tests.procs import metric, poll

pytestmark = [needs_emulator, pytest.mark.timeout(60)]

INTERVAL_S = 0.1
WINDOW_S = 3.0
EVERY_INTERVAL = WINDOW_S / INTERVAL_S  # probes in a window at the fast pace: 30


def probes(lb) -> float:
    return metric(lb.url, "lb_probe_latency_seconds_count")


def test_an_idle_replica_is_probed_less_often_than_a_busy_one(procs, tmp_path):
    lb, _ = start_lb_with_emulator(procs, tmp_path, f"[probes]\ninterval_s = {INTERVAL_S}\nidle_intervals = 5\n",
                                   "--speed", "1")
    poll(lambda: probes(lb) >= 3, timeout=10)  # healthy, models known: its record is clean
    before = probes(lb)
    time.sleep(WINDOW_S)
    idle = probes(lb) - before

    stop = time.monotonic() + WINDOW_S
    body = {"model": "m", "prompt": "count the rainy days", "max_tokens": 64, "ignore_eos": True}

    def client(_: int) -> int:
        done = 0
        while time.monotonic() < stop:
            status, _ = http_json("POST", lb.url + "/v1/completions", body, timeout=30)
            assert status == 200
            done += 1
        return done

    before = probes(lb)
    with ThreadPoolExecutor(2) as ex:
        answered = sum(ex.map(client, range(2)))
    busy = probes(lb) - before
    print({"idle": idle, "busy": busy, "answered": answered})
    assert idle <= 0.4 * EVERY_INTERVAL, idle  # every 5th interval: ~6 (every interval: ~30)
    assert busy >= 0.5 * EVERY_INTERVAL and busy >= 2 * idle, (idle, busy)
