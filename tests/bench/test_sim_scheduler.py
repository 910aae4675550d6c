"""The simulator runs the daemon's scheduler (lb.core.scheduler): its queue orders charge
tenants there too, so a fair order changes who is served in virtual time."""
from __future__ import annotations

import pytest
from dataclasses import replace

from bench.sim.world import Simulation, parse_config
from lb.core.scheduler import Scheduler


def _served(order: str, first: int = 100) -> tuple[list[str], Simulation]:
    """One replica; a flooding tenant sends 200 requests at t=0, a light one 20 requests
    just after. The tenants of the first `first` requests served, in completion order."""
    cfg = parse_config({"duration_s": 600.0, "seed": 3, "arrivals": {"kind": "external"},
                        "models": [{"name": "m", "profile": "l4-llama3-8b", "replicas": 1}],
                        "lb": {"policy": "least-load", "queue": order}})
    sim = Simulation(cfg)
    done: list[str] = []
    lb = sim.lbs["local"]
    lb.on_done = lambda req: done.append(req.tenant)

    def burst(tenant: str, n: int, base: int) -> None:
        for i in range(n):
            sim.inject("local", "m", list(range(base + i * 1000, base + i * 1000 + 512)), 64, tenant)

    sim.loop.at(0.0, burst, "flood", 200, 10**7)
    sim.loop.at(0.05, burst, "light", 20, 10**9)
    sim.run(drain_s=600.0)
    assert len(done) == 220  # everyone is served in the end, under either order
    return done[:first], sim


def test_sim_calls_the_core_scheduler():
    sim = Simulation(parse_config({"models": [{"name": "m"}], "arrivals": {"kind": "external"}}))
    assert isinstance(sim.lbs["local"].scheduler, Scheduler)


def test_wsc_charges_tenants_in_the_simulator_and_serves_them_differently_from_fcfs():
    fcfs, _ = _served("fcfs")
    wsc, sim = _served("wsc")
    light_fcfs, light_wsc = fcfs.count("light"), wsc.count("light")
    print(f"light tenant's requests among the first 100 served: fcfs {light_fcfs}, wsc {light_wsc}")
    # The replica admits ~57 of the flood at t=0 under either order. Then FCFS serves the
    # flood's backlog first; WSC lifts the light tenant to the least served counter and
    # charges the flood at each dispatch, so the light tenant gets every other slot.
    assert light_fcfs <= 2
    assert light_wsc >= 15
    service = sim.lbs["local"].queue.service
    assert service.get("flood") > 0 and service.get("light") > 0  # charged when taken out
    assert not service.inflight  # and settled at completion: nothing left in flight


def test_the_simulator_reads_the_daemons_config_file(tmp_path):
    from lb.daemon.config import ConfigError, load

    path = tmp_path / "lb.toml"
    path.write_text('[routing]\npolicy = "round-robin"\n[pushing]\nmode = "sp-outstanding"\nmax_outstanding = 7\n'
                    '[queue]\norder = "wsc"\n[probes]\ninterval_s = 0.05\n[affinity]\nhold_s = 3.0\n[peering]\ntau = 5\n')
    daemon = load(path)
    cfg = parse_config({"models": [{"name": "m"}], "arrivals": {"kind": "external"},
                        "lb": {"config": str(path), "forward": False}})
    lb = Simulation(cfg).lbs["local"]
    assert lb.policy.name == daemon.routing.policy == "round-robin"
    assert lb.scheduler.cfg.pushing == daemon.pushing.mode and lb.scheduler.cfg.max_outstanding == 7
    assert lb.queue.name == "wsc" and lb.cfg.probe_interval_s == 0.05 and lb.cfg.peer_queue_tau == 5
    assert lb.scheduler.affinity.cfg == daemon.affinity and not lb.cfg.forward  # [lb] keys override the file
    path.write_text('[pushing]\nmod = "blind"\n')
    with pytest.raises(ConfigError, match="pushing.mod"):  # the daemon's own message, naming the key
        parse_config({"models": [{"name": "m"}], "lb": {"config": str(path)}})


def test_a_scenario_without_overrides_runs_the_daemons_default_config():
    """The simulator's defaults are the daemon's, field by field (one source: lb.daemon.config)."""
    from lb.core.fairness import FairnessConfig, WeightedService
    from lb.core.tiers import TierConfig
    from lb.daemon.config import Config
    from lb.daemon.dispatch import scheduler_config

    daemon = Config()
    cfg = parse_config({"models": [{"name": "m"}], "arrivals": {"kind": "external"}}).lb
    assert cfg.policy == daemon.routing.policy == "predicted-ttft"
    assert cfg.policy_options == daemon.routing.options
    assert cfg.pushing == daemon.pushing.mode
    assert cfg.max_outstanding == daemon.pushing.max_outstanding
    assert cfg.push_credit == daemon.pushing.push_credit
    assert cfg.max_unseen == daemon.pushing.max_unseen
    assert cfg.queue == daemon.queue.order
    assert cfg.probe_interval_s == daemon.probes.interval_s
    assert cfg.early_reprobe_s == daemon.probes.early_reprobe_s
    assert cfg.peer_queue_tau == daemon.peering.tau
    assert cfg.peer_policy == daemon.peering.policy
    assert cfg.affinity == daemon.affinity
    # the scheduler the simulator builds is configured as the daemon's, bar the queue bound
    # (virtual clients are never refused: the simulator's queue is unbounded)
    sim_lb = Simulation(parse_config({"models": [{"name": "m"}], "arrivals": {"kind": "external"}})).lbs["local"]
    assert sim_lb.scheduler.cfg == replace(scheduler_config(daemon), max_queue=sim_lb.scheduler.cfg.max_queue)
    assert sim_lb.policy.name == daemon.routing.policy and sim_lb.peer_router.name == daemon.peering.policy
    # WSC and tier settings left unset mean the order's defaults, which are the daemon's
    assert WeightedService().cfg == FairnessConfig().wsc == daemon.fairness.wsc
    assert TierConfig() == daemon.tiers


def test_the_simulators_peer_bound_never_rules_out_a_peer_that_could_win():
    """`_SimPeers.fastest_possible_s` lets a pass skip building peer statuses: it must be at
    or below what `predicted_peer` adds up from any advert a status could carry."""
    from bench.sim.compare import make_arena
    from bench.sim.model import _SimPeers
    from bench.sim.workloads_sim import get
    from lb.core.backlog import forward_cost, remote_ttft

    arena = make_arena("regions", "lb", 0)
    get("regions").drive(arena, seed=0, rate_rps=60.0, stop_at=40.0)
    checked = 0
    for stop in (20.0, 30.0, 40.0):
        arena.loop.run(stop)
        now = arena.loop.now
        for lb in arena.fronts.values():
            peers = _SimPeers(lb, now)
            for latency, peer in lb.peers:
                adverts = peer.scheduler.advertise(list(peer.replicas.values()), now)
                for model, advert in adverts.items():
                    for tokens in (1, 300, 3000):
                        for error in (0.0, 0.05):
                            bound = peers.fastest_possible_s(model, tokens, error)
                            best = remote_ttft(advert, tokens)
                            assert bound is not None and best is not None
                            assert bound <= forward_cost(2 * latency, best, error, advert["error_s"])
                            checked += 1
    assert checked > 0
