"""The simulator: its event loop, its collapsed engine against the engine model stepped one
iteration at a time, and the LB behaviour it must share with the daemon."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.engine import Engine, EngineRequest
from bench.profiles import get_profile
from bench.sim.core import EventLoop
from bench.sim.model import SimRequest
from bench.sim.world import Simulation, parse_config
from lb.core.types import RequestFacts


def test_event_loop_runs_in_time_order_and_fifo_among_equals():
    loop = EventLoop()
    seen = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(5.0, seen.append, "late")
    loop.run(3.0)
    assert seen == ["a", "b", "c"] and loop.now == 3.0
    loop.at(0.5, seen.append, "past")  # never runs before now
    loop.run(10.0)
    assert seen[3:] == ["past", "late"]


def _workload(seed: int, n: int, rate: float) -> list[tuple[float, int, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        # some prompts share a prefix, so the radix cache is on the path too
        out.append((t, rng.randint(50, 400), rng.randint(5, 300)))
    return out


def _prompt(i: int, n: int) -> list[int]:
    shared = list(range(10_000, 10_000 + 64)) if i % 3 == 0 else []
    return (shared + list(range(i * 100_000, i * 100_000 + n)))[:n]


def _reference(profile: str, work) -> dict[str, tuple[float, float, int]]:
    """The engine model driven one step at a time, as the emulator drives it."""
    eng = Engine(get_profile(profile), seed=1)
    first, out = {}, {}
    now, i = 0.0, 0
    while True:
        nxt = eng.next_event_time(now)
        if i < len(work) and (nxt is None or work[i][0] <= nxt):
            now = work[i][0]
            eng.submit(EngineRequest(f"r{i}", _prompt(i, work[i][1]), work[i][2], ignore_eos=True), now)
            i += 1
            continue
        if nxt is None:
            break
        now = nxt
        res = eng.step(now)
        for rid in res.tokens:
            first.setdefault(rid, res.end)
        for f in res.finished:
            out[f.id] = (first[f.id], res.end, f.cached_tokens)
    return out


def _simulated(profile: str, work) -> dict[str, tuple[float, float, int]]:
    cfg = parse_config({"duration_s": 1.0, "seed": 1,
                        "models": [{"name": "m", "profile": profile, "replicas": 1}],
                        "lb": {"pushing": "blind", "policy": "round-robin"}})
    sim = Simulation(cfg)
    rep = sim.all_replicas[0]
    rep.engine.seed = 1
    done = {}
    lb = sim.lbs["local"]
    lb.on_done = lambda req: done.__setitem__(req.id, req)
    cached = {}
    orig = lb.completed

    def completed(req, now, prompt, c, output):
        cached[req.id] = c
        orig(req, now, prompt, c, output)

    lb.completed = completed
    for i, (t, n, out) in enumerate(work):
        req = SimRequest(f"r{i}", "local", "m", "t", t, _prompt(i, n), out)
        req.facts = RequestFacts(request_id=req.id, model="m", arrival=t, max_tokens=out)  # declared exactly, as the reference
        sim.loop.at(t, lb.arrive, req)
    sim.loop.run(10_000.0)
    assert rep.engine.collapsed_steps > len(work) // 2  # the fast path really ran
    return {rid: (r.first_token, r.finished_at, cached[rid]) for rid, r in done.items()}


# tiny at 40 req/s fills its KV (waiting, preemption); l4 at 3 req/s runs long decodes;
# tiny-sglang: SGLang's decaying admission ratio, retraction and LPM order
@pytest.mark.parametrize("profile,n,rate", [("tiny", 300, 40.0), ("l4-llama3-8b", 150, 3.0),
                                            ("tiny-sglang", 300, 40.0)])
def test_collapsed_decode_runs_match_the_engine_stepped_one_by_one(profile, n, rate):
    work = _workload(7, n, rate)
    ref = _reference(profile, work)
    sim = _simulated(profile, work)
    assert set(ref) == set(sim) and len(ref) == n
    for rid, (first, finish, cached) in ref.items():
        s_first, s_finish, s_cached = sim[rid]
        assert s_first == pytest.approx(first, rel=1e-9, abs=1e-9), rid
        assert s_finish == pytest.approx(finish, rel=1e-9, abs=1e-9), rid
        assert s_cached == cached, rid


def test_token_chain_names_prefixes_and_is_salted_per_tenant():
    from bench.sim.world import token_chain

    a = token_chain(list(range(100)), 32)
    b = token_chain(list(range(96)) + [7, 7, 7, 7], 32)
    assert len(a) == 3 and a == b  # the trailing partial block never matches
    assert token_chain([1] + list(range(1, 100)), 32)[0] != a[0]
    assert token_chain(list(range(100)), 32, salt="t1") != a


def _shared_prefix_run(policy: str) -> dict:
    cfg = parse_config({"duration_s": 60.0, "seed": 2,
                        "models": [{"name": "m", "profile": "tiny", "replicas": 4}],
                        "lb": {"policy": policy, "pushing": "sp-pending"},
                        "arrivals": {"kind": "external"}})
    sim = Simulation(cfg)
    rng = random.Random(4)
    for i in range(200):  # 8 conversations' growing prompts, interleaved at random
        conv = rng.randrange(8)
        prompt = list(range(conv * 10_000, conv * 10_000 + 300 + 2 * i))
        sim.loop.at(i * 0.05, lambda p=prompt: sim.inject("local", "m", p, 8))
    return sim.run(drain_s=60.0)["summary"]


def test_prefix_trie_routes_on_the_simulated_prompts_chain():
    trie, rr = _shared_prefix_run("prefix-trie"), _shared_prefix_run("round-robin")
    assert trie["ok"] == rr["ok"] == 200
    assert trie["cached_token_ratio"] > rr["cached_token_ratio"] + 0.1


def test_spikes_add_load_and_are_measured_and_holt_winters_plans_from_earlier_days():
    base = {"duration_s": 1200.0, "start_s": 14 * 3600.0, "seed": 1,
            "models": [{"name": "m", "profile": "l4-llama3-8b", "replicas": 2, "block_size": 256}],
            "arrivals": {"kind": "servegen", "rate_scale": 0.0005, "shapes": "azure-conv", "day": 2},
            "scaling": {"strategy": "lt-ua"}}
    from bench.sim.runner import run_config

    calm = run_config(parse_config(base))["summary"]
    spiky_cfg = {**base, "arrivals": {**base["arrivals"], "spikes": [{"at_s": 14 * 3600.0 + 300, "duration_s": 300.0, "factor": 8.0}]}}
    spiky = run_config(parse_config(spiky_cfg))["summary"]
    # 5 of 20 minutes at 8x: ~ (15 + 5*8)/20 = 2.75x the requests
    assert 1.8 * calm["requests"] < spiky["requests"] < 4.0 * calm["requests"]
    assert spiky["spikes"]["completions"] > 0 and spiky["spikes"]["ttft_p90_s"] is not None
    assert set(spiky["slo_attainment_by_region"]) == {"local"}
    fc = calm["forecast"]
    assert fc["method"] == "holt-winters" and fc["trained_on_days"] == 2
    assert fc["mean_ape_pct"] < 25


@pytest.mark.parametrize("rate_scale,start_s", [(0.05, 0.0), (0.008, 43200.0)])
def test_lazy_probes_and_per_model_passes_change_no_figure(monkeypatch, rate_scale, start_s):
    """A pass probes only the waiting models' replicas that changed since their last probe,
    and looks only at those models' replicas (the hot path of a large fleet): every view a
    pass reads, and the figures, are exactly those of probing every replica at each tick
    and passing the whole fleet. Overloaded (requests wait for probes) and at the day's load."""
    from bench.sim.model import SimLB
    from bench.sim.runner import run_config
    from bench.sim.world import load_config
    from lb.core.scheduler import Scheduler

    schedule = Scheduler.schedule

    def run() -> tuple[dict, list, list]:
        seen = []

        def recording(self, now, targets, peers=None):
            waiting = {m for m, n in self._waiting.items() if n}
            seen.append((now, [(t.view.id, t.view.pending, t.view.running, t.view.kv_free_tokens, t.view.outstanding,
                                t.view.pushed_since_probe, t.view.pushed_tokens_since_probe)
                               for t in targets if t.view.serves(next(iter(waiting)))] if len(waiting) == 1 else None))
            return schedule(self, now, targets, peers)

        monkeypatch.setattr(Scheduler, "schedule", recording)
        cfg = load_config(Path(__file__).parents[2] / "bench/sim/scenarios/day-3x3.toml")
        cfg.start_s, cfg.duration_s, cfg.arrivals.rate_scale = start_s, 20.0, rate_scale
        result = run_config(cfg)
        result["summary"]["sim"].pop("wall_s")
        return result["summary"], result["series"], seen

    lazy = run()

    def every_replica_each_tick(self, now, models):  # the eager form: the whole fleet, every tick
        tick = self.tick_at(now)
        if getattr(self, "_eager_tick", None) == tick:
            return
        self._eager_tick = tick
        for rep in self.replicas.values():
            if rep.view.last_probe_at < tick and rep.ready:
                state = (rep.snap, rep.snap_outstanding) if rep.snap_tick == tick else (rep.engine.probe(), rep.view.outstanding)
                rep.probe_into_view(tick, *state)

    monkeypatch.setattr(SimLB, "refresh", every_replica_each_tick)
    monkeypatch.setattr(SimLB, "pass_targets", lambda self, models: list(self.replicas.values()))
    eager = run()
    assert eager[2] == lazy[2]  # every view every pass read
    assert eager[:2] == lazy[:2]
    assert lazy[0]["requests"] > 200 and len(lazy[2]) > 200
