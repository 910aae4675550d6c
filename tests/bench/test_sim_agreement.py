"""The simulator agrees with the live emulator on closed-loop runs (bench/sim/agreement.py).

For each closed-loop workload at a small size, the same workload, seed, clients and fleet
(2 emulated L4 replicas, `lb` in front) runs in the simulator and over real emulator
processes in real time (SPEED = 1: faster emulators turn every millisecond of CPU contention
on a busy 2-core machine into more engine time). They must agree on throughput within 10 %,
on TTFT p50 within 20 % + 50 ms and on p90 within 30 % + 50 ms (`disagreements` says why).
The runs are request-bounded (not time-bounded) so a few per cent of latency cannot move a
whole level of tree leaves in or out of the count. Both sets of figures are printed.
"""
from __future__ import annotations

import pytest

from bench.sim.agreement import CASES, REPLICAS, SPEED, disagreements, line, live, pooled, simulate

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("workload", list(CASES))
def test_simulator_agrees_with_live_emulators(workload, tmp_path):
    case = CASES[workload]
    kw = dict(clients=case["clients"], replicas=REPLICAS, requests=case["requests"])
    sim = simulate(workload, case["params"], **kw)
    real = live(workload, case["params"], speed=SPEED, log_dir=tmp_path / "1", **kw)
    print(line(workload, sim, real))
    if disagreements(sim, real):
        # One live run is one draw: on a shared 2-core machine other work slows it, and the
        # 4-branch trees' bursts move mixed-tree's p90 by half between identical runs (921-1,626
        # ms over three 600-request runs, 2026-11-25; the per-run p90 is bimodal on both sides,
        # bench/sim/agreement.py DRAWS). The simulated side pools its draws' requests; measure
        # four more live runs and pool theirs the same way (a real simulator error moves all five).
        runs = [real] + [live(workload, case["params"], speed=SPEED, log_dir=tmp_path / str(i), **kw) for i in range(2, 6)]
        real = pooled(runs)
        print("pooled over 5 live runs:", line(workload, sim, real))
    assert sim["requests"] == real["requests"] == case["requests"]
    assert disagreements(sim, real) == []
