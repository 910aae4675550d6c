"""sim-compare: peer policy models decide as their sources say; the CLI writes the issue's schema."""
from __future__ import annotations

import json

import pytest

from bench.sim.peer_policies import (CacheAware, LitellmLeastBusy, LitellmShuffle, LlmdScorers, NginxHashConsistent,
                                     NginxLeastConn, PeerRequest, PowerOfTwo, RoundRobin, VllmConsistentHash)

WORKERS = ["w0", "w1", "w2", "w3"]


def req(i: int, tokens, session=None) -> PeerRequest:
    return PeerRequest(f"r{i}", list(tokens), session=session)


def idle_but(worker: str) -> dict[str, int]:
    """Loads that trip cache_aware's imbalance branch towards `worker` (65 open on the others)."""
    return {w: 0 if w == worker else 65 for w in WORKERS}


def test_cache_aware_tree_fills_only_through_the_imbalance_branch():
    policy = CacheAware()
    zero = {w: 0 for w in WORKERS}
    shared = list(range(1000))
    # balanced, no tenant yet: the first healthy worker, and nothing is inserted
    assert [policy.choose(req(i, range(i * 5000, i * 5000 + 800)), WORKERS, zero, 0.0) for i in range(3)] == ["w0"] * 3
    assert policy.tree.size == {}
    # max - min > 64 and max > 1.5 x min: the least loaded, and the prompt goes into its tree
    assert policy.choose(req(3, shared), WORKERS, idle_but("w2"), 1.0) == "w2"
    # balanced again: > 30 % match follows the prefix to w2 even when w2 is the busiest
    assert policy.choose(req(4, shared + [7] * 50), WORKERS, {**zero, "w2": 64}, 2.0) == "w2"
    # a prompt that matches nothing goes to the smallest tree among tenants: w2 is the only one
    assert policy.choose(req(5, range(90_000, 91_000)), WORKERS, zero, 3.0) == "w2"
    # not past the absolute threshold (64): still balanced
    assert policy.choose(req(6, range(80_000, 81_000)), WORKERS, {**zero, "w2": 64}, 4.0) == "w2"


def test_cache_aware_eviction_cuts_each_tree_to_its_budget_oldest_first():
    policy = CacheAware(max_tree_chars=4 * 300, eviction_interval_s=10.0)
    prompts = [list(range(i * 1000, i * 1000 + 200)) for i in range(3)]
    for i, p in enumerate(prompts):
        assert policy.choose(req(i, p), WORKERS, idle_but("w1" if i < 2 else "w3"), float(i)) == ("w1" if i < 2 else "w3")
    assert policy.tree.size["w1"] == 400 and policy.tree.size["w3"] == 200
    policy.choose(req(9, range(50_000, 50_200)), WORKERS, idle_but("w0"), 11.0)  # the eviction tick passed
    assert policy.tree.size["w1"] <= 300 and policy.tree.size["w3"] == 200
    tree = policy.tree
    old_depth, _ = tree.match(tree.chain(prompts[0]))
    new_depth, _ = tree.match(tree.chain(prompts[1]))
    assert old_depth < 50 == new_depth  # the least recently used prompt lost its leaves, not the newer one


def test_round_robin_power_of_two_and_least_conn():
    rr = RoundRobin()
    assert [rr.choose(req(i, [1]), WORKERS, {}, 0) for i in range(5)] == WORKERS + ["w0"]
    p2 = PowerOfTwo(seed=1)
    assert {p2.choose(req(i, [1]), ["a", "b"], {"a": 3, "b": 1}, 0) for i in range(20)} == {"b"}
    lc = NginxLeastConn()
    assert lc.choose(req(0, [1]), WORKERS, {"w0": 2, "w1": 0, "w2": 1, "w3": 0}, 0) == "w1"
    assert lc.choose(req(1, [1]), WORKERS, {"w0": 2, "w1": 0, "w2": 1, "w3": 0}, 0) == "w3"  # ties in turn


def test_hashing_keys_what_each_router_reads():
    nginx = NginxHashConsistent()
    picks = {nginx.choose(req(i, [1], session="conv-7"), WORKERS, {}, 0) for i in range(20)}
    assert len(picks) == 1  # one session, one replica
    vllm = VllmConsistentHash()
    picks = {vllm.choose(req(i, [1], session="conv-7"), WORKERS, {}, 0) for i in range(40)}
    assert len(picks) > 1  # keyed on X-Request-Id, which the live client sends per request


def llmd(metrics: dict[str, tuple[int, float]], **kw) -> LlmdScorers:
    policy = LlmdScorers(**kw)
    policy.bind(metrics.__getitem__)
    return policy


def test_llmd_weighs_its_own_prefix_index_3_to_2_against_the_waiting_queue_and_kv():
    idle = {w: (0, 0.0) for w in WORKERS}
    policy = llmd(idle, seed=3)
    prefix = list(range(64))  # 4 blocks of 16 tokens
    holder = policy.choose(req(0, prefix), WORKERS, {}, 0.0)
    # the index is what the scheduler sent where: the holder has all four blocks
    assert policy.matched(policy.chain(prefix)) == {holder: 4}
    longer = prefix + list(range(1000, 1064))  # half of its 8 blocks are on the holder
    assert policy.choose(req(1, longer), WORKERS, {}, 0.0) == holder  # 3 x 0.5 wins when all else is equal
    # one request waiting on the holder and none elsewhere: min-max makes that a full 2 points, over 1.5
    policy = llmd({**idle, holder: (1, 0.0)}, seed=3)
    policy.choose(req(0, prefix), [holder], {}, 0.0)
    assert policy.choose(req(1, longer), WORKERS, {}, 0.0) != holder
    # a full match (3 points) outweighs the queue (2) ...
    policy = llmd({**idle, holder: (9, 0.0)}, seed=3)
    policy.choose(req(0, prefix), [holder], {}, 0.0)
    assert policy.choose(req(1, prefix + [5]), WORKERS, {}, 0.0) == holder
    # ... but not the queue and a full KV together (3 + 0 + 0.2 < 0 + 2 + 2)
    policy = llmd({**idle, holder: (9, 0.9)}, seed=3)
    policy.choose(req(0, prefix), [holder], {}, 0.0)
    assert policy.choose(req(1, prefix + [5]), WORKERS, {}, 0.0) != holder
    # nothing matched and the engines alike: the shuffled picker spreads the ties
    policy = llmd(idle, seed=3)
    assert len({policy.choose(req(i, range(i * 100, i * 100 + 32)), WORKERS, {}, 0.0) for i in range(40)}) == 4


def test_llmd_index_is_an_lru_per_server():
    policy = llmd({w: (0, 0.0) for w in WORKERS}, lru_blocks=6)
    first, second = list(range(64)), list(range(500, 564))  # 4 blocks each
    policy.choose(req(0, first), ["w1"], {}, 0.0)
    policy.choose(req(1, second), ["w1"], {}, 0.0)  # 8 blocks on w1: the oldest two leave its index
    assert policy.matched(policy.chain(first)) == {}  # its first block went first: nothing from the start
    assert policy.matched(policy.chain(second)) == {"w1": 4}
    policy.forget("w1")
    assert policy.matched(policy.chain(second)) == {} and not policy.holders


def test_llmd_sees_the_engines_as_of_its_last_scrape():
    from bench.sim.compare import make_arena
    from bench.sim.model import SimRequest

    arena = make_arena("tot", "llm-d default-scorers", seed=0)
    front = next(iter(arena.fronts.values()))
    rep = arena.replicas[0]
    arena.loop.run(0.02)  # inside the first 50 ms between two scrapes
    for i in range(3):
        rep.push_unscheduled(SimRequest(f"r{i}", "local", arena.model, "t", 0.02, list(range(i * 600, i * 600 + 512)), 50))
    assert rep.engine.probe()[2] > 0.0  # the engine holds their KV at once
    assert front.scraped(rep.id) == (0, 0.0)  # the router still has the scrape of 0 ms
    arena.loop.run(0.06)
    waiting, kv = front.scraped(rep.id)
    assert kv > 0.0


def test_litellm_default_shuffles_and_least_busy_takes_the_first_least_loaded():
    shuffle = LitellmShuffle(seed=0)
    loads = {"w0": 50, "w1": 0, "w2": 0, "w3": 0}
    picks = [shuffle.choose(req(i, [1]), WORKERS, loads, 0.0) for i in range(400)]
    assert min(picks.count(w) for w in WORKERS) > 70  # about 100 each: w0's 50 open requests are not looked at
    busy = LitellmLeastBusy()
    assert busy.choose(req(0, [1]), WORKERS, {"w0": 2, "w1": 1, "w2": 1, "w3": 3}, 0.0) == "w1"  # first of the ties
    assert busy.choose(req(1, [1]), WORKERS, {"w0": 2, "w1": 1, "w2": 1, "w3": 3}, 0.0) == "w1"  # no turn-taking


def test_sim_compare_writes_the_summary_schema(tmp_path, monkeypatch):
    from bench.sim import compare, workloads_sim

    monkeypatch.setattr(compare, "LB_VARIANTS", {"lb": {}})
    monkeypatch.setattr(compare, "PEERS", {k: v for k, v in compare.PEERS.items() if k == "nginx least_conn"})
    monkeypatch.setattr(workloads_sim.WORKLOADS["tot"], "duration_s", 15.0)  # capacity is measured over it
    args = compare.argparse.Namespace(workload="tot", seeds=2, quick=True, out=str(tmp_path), load=0.9,
                                      sweep=False, list=False, workers=1, no_stream=False, duration=12.0)
    assert compare.run(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workload"] == "tot" and summary["seeds"] == 2
    assert summary["duration_s"] == 12.0  # --duration overrides the workload's (quick) length
    assert set(summary["systems"]) == {"lb", "nginx least_conn"}
    for entry in summary["systems"].values():
        for metric in ("throughput_rps", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "cached_ratio"):
            lo, hi = entry[metric]["ci95"]
            assert lo <= entry[metric]["median"] <= hi
        assert entry["errors"] == 0 and entry["cut_at_deadline"] > 0  # trees still running at the end
        assert entry["throughput_rps"]["median"] > 0
    assert (tmp_path / "report.md").read_text().count("| lb |") == 1
    assert (tmp_path / "ttft_cdf.png").exists() and (tmp_path / "throughput.png").exists()
    engines = json.loads((tmp_path / "engines.json").read_text())  # per replica, per run
    assert sorted((e["system"], e["seed"]) for e in engines) == sorted(
        (s, seed) for s in ("lb", "nginx least_conn") for seed in (0, 1))
    for e in engines:
        assert [r["replica"] for r in e["replicas"]] == ["local/1", "local/2", "local/3", "local/4"]
        assert sum(r["requests"] for r in e["replicas"]) > 0
        for r in e["replicas"]:
            assert 0.0 <= r["hit_ratio"] <= 1.0 and r["waiting_max"] >= r["waiting_mean"] >= 0
            assert r["lost_while_waiting"] <= r["evicted_tokens"]


def test_simulated_clients_tokenize_prompts_exactly_as_the_emulator():
    from bench.sim.clients import encode_chat, output_text
    from bench.tokenizer import encode, render_chat
    from bench.workloads import make_workload

    for name in ("tot", "multiturn"):
        program = make_workload(name, seed=3).program(0, 0)
        specs = program.start()
        while specs:
            spec = specs.pop()
            assert encode_chat(spec.messages) == encode(render_chat(spec.messages))
            specs.extend(program.on_done(spec, output_text(spec.request_id, spec.max_tokens)))


def entry(thr, thr_ci, p90, p90_ci):
    """One system's figures in a sim-compare summary."""
    return {"throughput_rps": {"median": thr, "ci95": thr_ci}, "served_rps": {"median": thr, "ci95": thr_ci},
            "ttft_p50_s": {"median": 0.1, "ci95": [0.1, 0.1]},
            "ttft_p90_s": {"median": p90, "ci95": p90_ci}, "e2e_p50_s": {"median": 1.0, "ci95": [1.0, 1.0]},
            "cached_ratio": {"median": 0.9, "ci95": [0.9, 0.9]}, "errors": 0, "cut_at_deadline": 0}


def test_standing_names_the_peers_and_says_behind_only_when_the_intervals_part():
    from bench.sim.compare_report import standing, table

    summary = {"systems": {
        "lb": entry(10.0, [9.5, 10.5], 0.60, [0.59, 0.62]),
        "lb prefix-trie": entry(20.0, [20.0, 20.0], 0.10, [0.10, 0.10]),  # a variant of lb, never a peer
        "sglang-router cache_aware": entry(10.4, [10.0, 11.0], 0.90, [0.80, 1.00]),
        "sglang-router round_robin": entry(8.0, [7.9, 8.1], 0.43, [0.40, 0.48]),
    }}
    st = standing(summary)
    assert st["best_by_throughput"] == "sglang-router cache_aware" and st["throughput"] == "0.96x"
    assert st["lowest_p90"] == "sglang-router round_robin" and st["p90"] == "1.40x"
    assert st["p90_vs_cache_aware"] == "0.67x"
    assert st["behind"] == ["TTFT p90 (sglang-router round_robin)"]  # throughput intervals overlap
    summary["systems"]["sglang-router round_robin"]["ttft_p90_s"]["ci95"] = [0.40, 4.9]
    assert standing(summary)["behind"] == []  # round robin's interval reaches lb's
    assert "behind with the intervals apart: nowhere" in table(summary)
    # the whole run's completions are a measure of their own: the window's can hide or invent a gap
    for name, served, ci in (("lb", 9.0, [8.9, 9.1]), ("sglang-router cache_aware", 9.5, [9.2, 9.8]),
                             ("sglang-router round_robin", 9.6, [9.4, 9.7])):
        summary["systems"][name]["served_rps"] = {"median": served, "ci95": ci}
    st = standing(summary)
    assert st["best_by_served"] == "sglang-router round_robin" and st["served"] == "0.94x"
    assert st["behind"] == ["served over the run (sglang-router round_robin)"]
    assert "| 9.00 [8.90, 9.10] |" in table(summary)


def test_the_suite_table_joins_a_workloads_sweeps_run_in_parts_and_stars_a_cell_where_lb_is_behind(tmp_path, capsys):
    from bench.sim.compare_report import main

    def write(folder, load, systems):
        (tmp_path / folder / f"load-{load}").mkdir(parents=True)
        (tmp_path / folder / f"load-{load}" / "summary.json").write_text(json.dumps(
            {"workload": "tot", "load": load, "capacity_rps": 50.0, "systems": systems}))

    lb = {0.5: entry(20.0, [19.0, 21.0], 0.30, [0.29, 0.31]), 1.3: entry(50.0, [49.0, 51.0], 2.0, [1.9, 2.1])}
    cache_aware = {0.5: entry(19.0, [18.0, 20.0], 0.60, [0.55, 0.65]), 1.3: entry(30.0, [29.0, 31.0], 6.0, [5.5, 6.5])}
    for load in (0.5, 1.3):  # the peers in two runs, lb in both (as `--systems` splits them)
        write("a", load, {"lb": lb[load], "sglang-router cache_aware": cache_aware[load]})
    write("b", 0.5, {"lb": lb[0.5], "nginx hash-session": entry(20.5, [19.5, 21.5], 0.25, [0.20, 0.28])})
    write("b", 1.3, {"lb": lb[1.3], "nginx hash-session": entry(40.0, [39.0, 41.0], 8.0, [7.0, 9.0])})
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "| workload (capacity req/s) | 0.5 | 1.3 |"
    # 0.5: hash-session leads on throughput (overlapping) and p90 (apart: starred); 1.3: lb ahead
    assert rows[2] == "| tot (50.00) | 0.98x / 0.98x / 1.20x / 0.50x* | 1.25x / 1.25x / 0.33x / 0.33x |"
    with pytest.raises(SystemExit, match="no load-"):
        main([str(tmp_path)])


def test_clients_that_do_not_stream_show_lb_no_first_token():
    """`sim-compare --no-stream`: the daemon sees a non-streamed answer only when it ends, so
    the simulated `lb` must learn from whole answers too, and count each as prefill ahead only
    until its engine's count of first tokens passes it (vLLM's TTFT histogram, read by the
    probes: lb.core.backlog)."""
    from bench.sim import compare
    from bench.sim.workloads_sim import get

    arena = compare.make_arena("tot", "lb", 0, stream=False)
    get("tot").drive(arena, seed=0, rate_rps=20.0, stop_at=20.0)
    first_tokens = []
    lb = next(iter(arena.fronts.values()))
    real = lb.scheduler.first_token
    lb.scheduler.first_token = lambda rid, now: first_tokens.append(rid) or real(rid, now)
    arena.loop.run(20.0)
    assert arena.done and not first_tokens
    backlog = lb.scheduler.backlog
    rates = lb.policy.scorers[0].model.rates
    assert set(backlog.counted) == set(rates)  # each engine's count, read by the probes
    waiting = list(backlog._open.items())
    assert waiting and all(p.whole and rid in backlog._whole[p.target] for rid, p in waiting)
    arena.loop.run(120.0)  # no new calls after 20 s: every first token counted, nothing ahead
    assert not backlog.ahead and not any(backlog._whole.values())
    assert rates and all(r.step_s is None and r.whole_step_s > 0 for r in rates.values())


def test_a_childs_prompt_finds_its_parents_sampled_answer_cached_and_no_other_trees():
    """The simulated engine answers each request with its own sampled tokens and the client
    builds the child's prompt from exactly those: a child served where its parent ran finds
    the parent's answer cached (not only the parent's prompt), while a tree repeating an
    earlier tree's question shares the question, never the earlier tree's thoughts."""
    from bench.sim.compare import make_arena
    from bench.sim.workloads_sim import get

    arena = make_arena("tot", "lb", seed=1)
    # light (nothing is evicted), and long enough for ~100 trees over 200 questions: many repeat one
    get("tot").drive(arena, seed=1, rate_rps=6.0, stop_at=240.0)
    arena.loop.run(240.0)
    done = {d.req.id: d for d in arena.done}

    def parent(rid: str) -> str:
        head, last = rid.rsplit("-", 1)
        return f"{head}-{last.rsplit('.', 1)[0]}" if "." in last else f"{head}-root"

    pairs = [(d, done[parent(i)]) for i, d in done.items()
             if not i.endswith("root") and parent(i) in done and done[parent(i)].req.served_by == d.req.served_by]
    assert len(pairs) > 50
    block = 16  # the profile's cache block
    found = [d.cached_tokens >= (p.prompt_tokens + p.output_tokens) // block * block for d, p in pairs]
    assert sum(found) >= 0.95 * len(pairs)
    # every node of a tree is its own: a child finds at most its parent's prompt and answer
    # (and a block of its instruction a sibling shares), never a whole earlier tree's child
    # that asked the same question (200 questions; with one fixed answer token they matched)
    children = [(d, done[parent(i)]) for i, d in done.items() if not i.endswith("root") and parent(i) in done]
    assert all(d.cached_tokens <= (p.prompt_tokens + p.output_tokens) // block * block + block for d, p in children)


def test_the_sp_p_reproduction_runs_named_systems_over_the_whole_run_or_its_steady_state(tmp_path, capsys):
    from bench.sim import spp

    with pytest.raises(SystemExit, match="--systems: unknown 'no-such-router'; known: 'lb', "):
        spp.main(["--systems", "lb,no-such-router"])
    whole = spp.run_one(("nginx hash-session", 0, 20.0, 30, "l4-llama3-8b", 64, 0.0))
    steady = spp.run_one(("nginx hash-session", 0, 20.0, 30, "l4-llama3-8b", 64, 0.2))
    # a cold fleet's first seconds (every tree starting at once, nothing cached) count only in the whole run
    assert whole["cached_ratio"] < steady["cached_ratio"]
    spp.main(["--seeds", "1", "--duration", "10", "--systems", "nginx hash-session", "--warm-share", "0",
              "--workers", "1", "--out", str(tmp_path)])
    assert "| nginx hash-session |" in (tmp_path / "table.md").read_text()


def test_the_sp_p_reproduction_moves_the_engines_working_point_as_the_real_vllm_harness_does(tmp_path):
    """`--kv-tokens` and `--decode-reserve` change the engines (the profile itself untouched): a
    KV far smaller than the trees want, admitted without a decode reservation as vLLM's V1
    scheduler admits, makes the engines preempt where the profile's own KV never does."""
    from bench.profiles import PROFILES
    from bench.sim import spp

    name = spp.working_point("h100-llama3-8b", {"kv_tokens": 4096, "decode_reserve": 0})
    assert (PROFILES[name].kv_tokens, PROFILES[name].decode_reserve) == (4096, 0)
    assert PROFILES["h100-llama3-8b"].kv_tokens > 4096 and PROFILES["h100-llama3-8b"].decode_reserve == 128
    tight = spp.run_one(("lb blind", 0, 10.0, 30, "h100-llama3-8b", 64, 0.0, {"kv_tokens": 4096, "decode_reserve": 0}))
    roomy = spp.run_one(("lb blind", 0, 10.0, 30, "h100-llama3-8b", 64, 0.0))
    assert tight["preemptions"] > 0 and roomy["preemptions"] == 0
    assert tight["waiting_mean"] > roomy["waiting_mean"]
    for bad in (["--kv-tokens", "0"], ["--max-running", "0"], ["--decode-reserve", "-1"]):
        with pytest.raises(SystemExit):
            spp.main(bad)


def test_the_simulated_lb_learns_which_engines_preempt_as_the_daemon_does_from_vllms_counter():
    """The simulated probe carries a vLLM-like engine's preemption counter (an SGLang-like one
    reports none, as its /v1/loads does not), so SP-P's floor for engines that admit past their
    free KV (lb.core.pushing.OVERCOMMIT_UNSEEN) runs in the simulator on the daemon's code."""
    from dataclasses import replace

    from bench.sim import spp
    from bench.sim.clients import Programs
    from bench.sim.compare import make_arena
    from bench.sim.workloads_sim import TOT, get
    from bench.workloads import make_workload

    def views(profile: str, run_s: float = 10.0) -> list:
        fleet = replace(get("tot").fleet, profile=profile)
        arena = make_arena("tot", "lb", 0, fleet=fleet)
        params = {k: v for k, v in TOT.items() if k != "workload"}
        Programs(arena, make_workload("tot", seed=0, **params), stop_at=run_s).clients({"local": 30})
        arena.loop.run(run_s)
        return [(rep.view, rep.engine.counters.preemptions) for rep in arena.replicas]

    tight = views(spp.working_point("h100-llama3-8b", {"kv_tokens": 4096, "decode_reserve": 0}))
    assert all(v.overcommits == v.requeues == (preempted > 0) for v, preempted in tight) and any(v.overcommits for v, _ in tight)
    sglang = views("tiny-sglang", 20.0)  # SGLang's retractions, as /v1/loads says them (its last window)
    assert any(preempted for _, preempted in sglang) and any(v.requeues for v, _ in sglang)
    assert all(preempted for v, preempted in sglang if v.requeues) and not any(v.overcommits for v, _ in sglang)


def test_sim_compare_runs_named_systems_and_an_operators_own_config_file(tmp_path, monkeypatch, capsys):
    """`--systems` runs only those; `--lb-config FILE` adds lb with that daemon config (here
    least-load routing: it must not reuse the default's prefix memory) on the same arrivals."""
    from bench.sim import compare, workloads_sim

    monkeypatch.setattr(workloads_sim.WORKLOADS["tot"], "duration_s", 15.0)
    config = tmp_path / "lb.toml"
    config.write_text('[routing]\npolicy = "least-load"\n')
    args = compare.argparse.Namespace(workload="tot", seeds=1, quick=True, out=str(tmp_path / "out"), load=0.9,
                                      sweep=False, list=False, workers=1, no_stream=False, duration=12.0,
                                      systems="lb,nginx least_conn", lb_config=str(config))
    assert compare.run(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(summary["systems"]) == ["lb", "nginx least_conn", compare.LB_FROM_FILE]
    engines = json.loads((tmp_path / "out" / "engines.json").read_text())
    hits = {e["system"]: sum(r["hit_ratio"] for r in e["replicas"]) for e in engines}
    assert hits[compare.LB_FROM_FILE] < hits["lb"]  # least-load scatters the trees lb keeps together
    assert "| lb config |" in (tmp_path / "out" / "report.md").read_text()

    for bad, says in (({"systems": "lb,haproxy"}, "--systems: unknown 'haproxy'; known: 'lb', 'lb blind', "),
                      ({"systems": "", "lb_config": None}, "--systems named none"),
                      ({"systems": "lb", "lb_config": str(tmp_path / "missing.toml")}, "--lb-config")):
        with pytest.raises(SystemExit, match=says):
            compare.run(compare.argparse.Namespace(**{**vars(args), **bad}))
    config.write_text('[routing]\npolicy = "nope"\n')
    with pytest.raises(SystemExit, match="routing.policy.*unknown policy 'nope'"):  # the daemon's own message
        compare.run(args)

    assert compare.run(compare.argparse.Namespace(**{**vars(args), "systems": "list"})) == 0
    assert capsys.readouterr().out.splitlines()[-len(compare.systems()):] == compare.systems()


def test_a_simulated_agent_step_leaves_when_its_tool_has_run_and_finds_its_session_cached():
    """The simulated client waits out each step's tool run (virtual time, exactly) before it
    sends the next step, as the live client does; a step served where its session's last one
    ran finds that prompt and its answer cached, with nothing to evict them on a light fleet."""
    from bench.sim.compare import make_arena
    from bench.sim.workloads_sim import get
    from bench.workloads.agent import Agent

    arena = make_arena("agent", "lb", seed=2)
    get("agent").drive(arena, seed=2, rate_rps=0.5, stop_at=200.0)
    arena.loop.run(200.0)
    done = {d.req.id: d for d in arena.done}
    plans, checked, same, found = Agent(seed=2), 0, 0, 0
    for rid, d in done.items():
        session, step = rid.rsplit("-step", 1)
        prev = done.get(f"{session}-step{int(step) - 1}")
        if prev is None:
            continue
        client, index = (int(x) for x in session.removeprefix("agent-c").split("-"))
        think = plans.draw(client, index)[1][int(step) - 1].think_s
        assert d.sent_at == pytest.approx(prev.sent_at + prev.e2e + think, abs=1e-6)
        checked += 1
        if d.req.served_by == prev.req.served_by:
            same += 1
            found += d.cached_tokens >= (prev.prompt_tokens + prev.output_tokens) // 16 * 16
    assert checked > 30 and same > 30 and found >= 0.95 * same


def test_a_costly_probe_is_spaced_and_late_in_the_simulator_as_in_the_daemon(monkeypatch):
    """An engine whose load endpoint takes time (`Profile.probe_s`, vLLM's /metrics page) is
    probed as the daemon probes it: an early re-probe waits until probing takes at most
    `probes.max_probe_share` of the replica's time (lb.core.pushing.early_probe_delay), what it
    reads is the engine as the probe started, and it lands `probe_s` later; it is asked for
    after a push or an answer only when a decision waits on it. With free probes (the suite's
    profiles) the LB probes after every push and answer, at once."""
    from dataclasses import replace

    from bench.sim import spp
    from bench.sim.clients import Programs
    from bench.sim.compare import make_arena
    from bench.sim.model import SimReplica
    from bench.sim.workloads_sim import TOT, get
    from bench.workloads import make_workload

    def probes(overrides: dict) -> tuple[list, list, int]:
        landed: list[tuple[str, float, float, int]] = []  # (replica, read at, landed at, engine waiting then)
        instant = [0]
        original_landed, original_now = SimReplica._probe_landed, SimReplica.probe_now

        def spy_landed(rep, started, state, outstanding_at):
            landed.append((rep.id, started, rep.loop.now, state[0]))
            original_landed(rep, started, state, outstanding_at)

        def spy_now(rep):
            instant[0] += 1
            original_now(rep)

        monkeypatch.setattr(SimReplica, "_probe_landed", spy_landed)
        monkeypatch.setattr(SimReplica, "probe_now", spy_now)
        fleet = replace(get("tot").fleet, profile=spp.working_point("h100-llama3-8b", overrides))
        arena = make_arena("tot", "lb", 0, fleet=fleet)
        params = {k: v for k, v in TOT.items() if k != "workload"}
        Programs(arena, make_workload("tot", seed=0, **params), stop_at=8.0).clients({"local": 30})
        arena.loop.run(8.0)
        return landed, arena.replicas, instant[0]

    cost = 0.008
    landed, replicas, instant = probes({"kv_tokens": 4096, "decode_reserve": 0, "probe_s": cost})
    assert all(rep.view.probe_s == cost for rep in replicas)
    assert instant == len(replicas)  # only the first probe of each, before it turns healthy
    assert landed and all(abs(end - at - cost) < 1e-9 for _, at, end, _ in landed)
    gap = cost * (1 - 0.25) / 0.25  # the daemon's default share
    by_replica: dict[str, list] = {}
    for rid, at, end, _ in landed:
        by_replica.setdefault(rid, []).append((at, end))
    spacings = [b[0] - a[1] for runs in by_replica.values() for a, b in zip(runs, runs[1:])]
    assert spacings and min(spacings) >= gap - 1e-9
    assert any(waiting for *_, waiting in landed)  # the engines queue here: the probes matter

    _, _, free = probes({"kv_tokens": 4096, "decode_reserve": 0})
    assert free > 2 * len(landed)  # free probes: after every push and every answer


def test_the_p90_counting_the_unanswered_takes_every_request_sent_at_its_wait_so_far():
    """Past capacity a system that leaves requests waiting at the run's end looks better on the
    answered ones alone: `Arena.waited` counts every request sent (answered: its TTFT; answering:
    its first token's time; neither: what it has waited so far)."""
    from bench.sim import compare
    from bench.sim.workloads_sim import get

    arena = compare.make_arena("reasoning", "sglang-router round_robin", 0)
    get("reasoning").drive(arena, seed=0, rate_rps=6.0, stop_at=90.0)  # ~5x the fleet's capacity
    arena.loop.run(90.0)
    now = arena.loop.now
    waited = arena.waited(0.0)
    assert len(waited) == arena.sent == len(arena.done) + arena.in_flight
    answered = sorted(d.ttft for d in arena.done)
    assert answered and sorted(waited[:len(answered)]) == answered
    unanswered = [now - sent for rid, (_, sent, _) in arena.callbacks.items()
                  if (r := arena.arrived.get(rid)) is None or r.first_token is None]
    assert len(unanswered) > 100  # far past capacity many still wait for a first token at the end
    assert all(w in waited for w in unanswered)
    assert max(waited) > max(answered)  # the longest waits are the unanswered ones
    import numpy as np
    assert np.percentile(waited, 90) > np.percentile(answered, 90)


def test_the_fair_queue_moves_the_wait_past_capacity_onto_the_tenant_over_its_share():
    """Bursty tenants at 1.3x capacity: one of eight tenants sends over half the requests. Its
    p90 is the p90 over everyone's, so that figure alone cannot tell a router that makes every
    tenant wait from one that makes only the heavy one wait. Per tenant it can: under `lb`'s
    fair queue the median tenant's p90 is a fraction of the worst's; nginx least_conn (FCFS at
    each engine) gives every tenant about the same wait."""
    from bench.sim import compare

    got = {}
    for system in ("lb", "nginx least_conn"):
        run = compare.run_one(("bursty", system, 0, 8.23 * 1.3, 120.0))
        got[system] = (run["tenant_p90_median_s"], run["tenant_p90_worst_s"], run["ttft_p90_waited_s"])
    print(got)
    median, worst, everyone = got["lb"]
    assert median < 0.4 * worst  # the others are served while the heavy tenant waits
    assert worst > 0.9 * everyone  # the p90 over everyone is the heavy tenant's
    median, worst, _ = got["nginx least_conn"]
    assert median > 0.8 * worst  # first come, first served: every tenant waits alike
    assert got["lb"][0] < 0.5 * median  # and the median tenant waits far less under lb


def test_a_tenants_p90_needs_enough_requests_and_two_tenants_to_compare():
    from bench.stats import MIN_TENANT_REQUESTS, tenant_p90s

    many = [float(i) for i in range(1, 101)]  # p90 90.1
    assert tenant_p90s({"a": many}) == []  # one tenant: nothing to compare
    assert tenant_p90s({"a": many, "b": [1.0] * (MIN_TENANT_REQUESTS - 1)}) == []  # too few to have a p90
    assert tenant_p90s({"a": many, "b": [2.0] * MIN_TENANT_REQUESTS}) == [pytest.approx(90.1), 2.0]


def test_arena_waits_per_user_are_the_waits_of_everyone():
    from bench.sim import compare
    from bench.sim.workloads_sim import get
    from bench.workloads.servegen import ServeGen

    arena = compare.make_arena("bursty", "lb", 0)
    get("bursty").drive(arena, seed=0, rate_rps=12.0, stop_at=60.0)
    arena.loop.run(60.0)
    by_user = arena.waited_by_user(10.0)
    assert sorted(by_user) == sorted(f"sg-{c}" for c in ServeGen(seed=0, tenants=8).chosen())  # each named
    assert sorted(t for ts in by_user.values() for t in ts) == sorted(arena.waited(10.0))


def test_standing_counts_the_unanswered_p90_where_the_summaries_have_it():
    from bench.sim.compare_report import WAITED, standing, table

    summary = {"systems": {
        "lb": entry(10.0, [9.5, 10.5], 0.60, [0.55, 0.70]),
        "llm-d default-scorers": entry(10.0, [9.5, 10.5], 0.60, [0.50, 0.65]),
    }}
    st = standing(summary)  # written before the figure existed: no ratio, nothing behind
    assert st["waited"] == "-" and st["lowest_waited"] is None and st["behind"] == []
    assert "| 0.60 [0.55, 0.70] |" not in table(summary) and "| - |" in table(summary)
    summary["systems"]["lb"][WAITED] = {"median": 0.9, "ci95": [0.8, 1.0]}
    summary["systems"]["llm-d default-scorers"][WAITED] = {"median": 3.0, "ci95": [2.0, 9.0]}
    st = standing(summary)
    assert st["waited"] == "0.30x" and st["lowest_waited"] == "llm-d default-scorers" and st["behind"] == []
    summary["systems"]["lb"][WAITED] = {"median": 12.0, "ci95": [10.0, 14.0]}
    assert standing(summary)["behind"] == ["TTFT p90 counting the unanswered (llm-d default-scorers)"]


def test_the_reasoning_replay_is_decode_bound_heavy_tailed_and_fits_the_context():
    import itertools
    import statistics

    from bench.sim.workloads_sim import WORKLOADS, reasoning_calls
    from bench.workloads.reasoning import Reasoning

    assert "reasoning" in WORKLOADS
    calls = [t.call for t in itertools.islice(reasoning_calls(0), 2000)]
    answers = [c.output_tokens for c in calls]
    assert all(len(c.tokens) + c.output_tokens <= Reasoning().context for c in calls)
    assert statistics.mean(answers) > statistics.mean(len(c.tokens) for c in calls)  # the answer fills the KV
    assert 500 < statistics.median(answers) < 900 and max(answers) > 4000  # heavy-tailed
    # the same 8 system prompts for every seed, and another seed is another stream
    first = {c.tokens[0] for c in calls}
    other = [t.call for t in itertools.islice(reasoning_calls(1), 2000)]
    assert len(first) == 8 and {c.tokens[0] for c in other} == first
    assert [c.output_tokens for c in other[:50]] != answers[:50]


def test_past_capacity_lb_finishes_the_programs_it_started():
    """Heterogeneous replicas at 2x capacity (88.6 req/s against 44.3), 120 s: `lb` ranks a
    tree under way at the rank it started at (`[fairness.wsc] interaction_credit`), so it
    finishes trees while new ones wait. Ranked by its user's service now (credit 0: least
    attained service) every tree advances a call at a time behind each newer tree and none
    started after the warm-up finishes, with the p90 counting the unanswered far higher."""
    import dataclasses

    from bench.sim import compare
    from bench.sim.model import LBConfig
    from lb.core.fairness import WscConfig

    got = {}
    for credit in (WscConfig().interaction_credit, 0.0):
        cfg = dataclasses.replace(LBConfig(), wsc=WscConfig(interaction_credit=credit))
        run = compare.run_one(("heterogeneous", "lb", 0, 88.6, 120.0, compare.RunOptions(lb_cfg=cfg)))
        got[credit] = (run["programs_rps"], run["ttft_p90_waited_s"], run["throughput_rps"])
    print(got)
    (programs, waited, rps), (programs0, waited0, rps0) = got.values()
    assert programs > 0.3 and programs > 2 * programs0
    assert waited < 0.6 * waited0
    assert rps > 0.9 * rps0  # the calls answered cost little


def test_programs_finished_count_only_programs_that_ran_whole():
    """A program cut by the run's end is not finished: at the end of a short run some trees are
    under way, and every finished one answered all of its calls."""
    from bench.sim import compare
    from bench.sim.workloads_sim import get

    arena = compare.make_arena("tot", "lb", 0)
    programs = get("tot").drive(arena, seed=0, rate_rps=40.0, stop_at=30.0)
    arena.loop.run(30.0)
    calls = {}
    for d in arena.done:
        calls.setdefault(d.req.facts.interaction_id, []).append(d)
    assert 0 < len(programs.finished) < programs.programs_started
    assert all(b <= 30.0 and a < b for a, b in programs.finished)
    complete = [tree for tree, done in calls.items() if len(done) == 15]  # 1 + 2 + 4 + 8 calls a tree
    assert len(programs.finished) == len(complete)


def test_an_operators_lb_config_carries_its_fairness_settings_into_the_simulator(tmp_path):
    """`sim-compare --lb-config FILE` runs `lb` with the file's [fairness.wsc] too (it had
    dropped them: the simulated queue ran the defaults whatever the file said)."""
    from bench.sim.model import LBConfig

    path = tmp_path / "lb.toml"
    path.write_text("[fairness.wsc]\ninteraction_credit = 0\nhalf_life_s = 15\n")
    cfg = LBConfig.from_daemon_config(str(path))
    assert (cfg.wsc.interaction_credit, cfg.wsc.half_life_s) == (0.0, 15.0)
    path.write_text('[queue]\norder = "vtc"\n[fairness.wsc]\ninteraction_credit = 0\n')
    assert LBConfig.from_daemon_config(str(path)).wsc is None  # vtc keeps the paper's counters


def test_a_workload_runs_on_a_fleet_k_times_larger_with_its_capacity_measured_there(tmp_path, monkeypatch):
    """`--fleet-scale K` (or WORKLOAD*K): every region K times over, the capacity measured on
    that fleet (so --load keeps its meaning) and kept apart from the small fleet's."""
    from bench.sim import compare, workloads_sim

    monkeypatch.setattr(workloads_sim.WORKLOADS["regions"], "duration_s", 15.0)
    big = workloads_sim.get("regions*3")
    assert [(r.name, r.replicas) for r in big.fleet.regions] == [("us", 6), ("eu", 6), ("asia", 6)]
    assert big.fleet.latency_ms == workloads_sim.get("regions").fleet.latency_ms
    assert workloads_sim.get("heterogeneous*2").fleet.regions[0].slow_replicas == 4
    args = compare.argparse.Namespace(workload="tot", seeds=1, quick=True, out=str(tmp_path), load=0.9,
                                      sweep=False, list=False, workers=1, no_stream=False, duration=12.0,
                                      systems="lb", lb_config=None, fleet_scale=2)
    monkeypatch.setattr(workloads_sim.WORKLOADS["tot"], "duration_s", 15.0)
    assert compare.run(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["workload"] == "tot*2"
    engines = json.loads((tmp_path / "engines.json").read_text())
    assert [r["replica"] for r in engines[0]["replicas"]] == [f"local/{i}" for i in range(1, 9)]
    assert sum(r["requests"] > 0 for r in engines[0]["replicas"]) == 8
    capacities = json.loads((tmp_path / "capacity.json").read_text())
    assert list(capacities) == ["tot*2@15s"]
    assert capacities["tot*2@15s"] > 1.5 * compare.measure_capacity("tot", 15.0)  # twice the engines

    for bad, says in (({"fleet_scale": 0}, "--fleet-scale must be a whole number >= 1, got 0"),
                      ({"workload": "tot*2"}, "names its scale already"),
                      ({"workload": "fairness"}, "runs its own scenario"),
                      ({"workload": "tot*x", "fleet_scale": 1}, r"'tot\*x': the fleet's scale after '\*' must be")):
        with pytest.raises(SystemExit, match=says):
            compare.run(compare.argparse.Namespace(**{**vars(args), **bad}))


def test_a_workload_runs_on_sglangs_scheduler_and_lb_hears_its_retractions(tmp_path, monkeypatch):
    """`--engine sglang` (or WORKLOAD@sglang): the same hardware under SGLang's scheduler, the
    capacity measured on it and kept apart. Its engines retract past capacity and say so only
    as `/v1/loads` does (the retractions of the last 40 decode batches); lb's views take that
    as a preemption, as they take vLLM's counter."""
    from bench.sim import compare, workloads_sim

    assert workloads_sim.get("reasoning@sglang").fleet.profile == "l4-llama3-8b-sglang-fcfs"
    assert workloads_sim.get("reasoning@sglang-lpm").fleet.profile == "l4-llama3-8b-sglang"
    big = workloads_sim.get("regions*2@sglang")
    assert (big.name, big.fleet.regions[0].replicas, big.fleet.profile) == ("regions*2@sglang", 4,
                                                                          "l4-llama3-8b-sglang-fcfs")
    with pytest.raises(ValueError, match="the engine after .@. is one of vllm, sglang, sglang-lpm, mixed"):
        workloads_sim.get("tot@tgi")
    assert workloads_sim.get("tot@vllm") is workloads_sim.get("tot")

    arena = compare.make_arena("shared-prefix@sglang", "lb", seed=1)
    workloads_sim.get("shared-prefix@sglang").drive(arena, seed=1, rate_rps=8.0, stop_at=90.0)
    arena.loop.run(90.0)
    retracted = [r for r in arena.replicas if r.engine.counters.preemptions]
    assert retracted and all(r.engine.profile.new_token_ratio is not None for r in arena.replicas)
    assert all(r.view.requeues and r.view.preempted_at is not None and not r.view.overcommits for r in retracted)

    monkeypatch.setattr(workloads_sim.WORKLOADS["tot"], "duration_s", 15.0)
    args = compare.argparse.Namespace(workload="tot", seeds=1, quick=True, out=str(tmp_path), load=0.9,
                                      sweep=False, list=False, workers=1, no_stream=False, duration=12.0,
                                      systems="lb", lb_config=None, engine="sglang")
    assert compare.run(args) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["workload"] == "tot@sglang"
    assert list(json.loads((tmp_path / "capacity.json").read_text())) == ["tot@sglang@15s"]
    for bad, says in (({"workload": "tot@sglang"}, "names its engine already"),
                      ({"workload": "fairness"}, "runs its own scenario")):
        with pytest.raises(SystemExit, match=says):
            compare.run(compare.argparse.Namespace(**{**vars(args), **bad}))


def test_clients_without_lb_headers_reach_lb_as_third_party_clients_and_their_steps_are_recognized():
    """`--no-session-headers`: the agent's calls carry no session, interaction, stage or last
    call; lb's scheduler (the daemon's) recognizes the steps by their prompts and learns each
    client's share of calls continued. With headers it never needs to."""
    from bench.sim.compare import make_arena
    from bench.sim.workloads_sim import get

    shares = {}
    for headers in (True, False):
        arena = make_arena("agent", "lb", seed=2, headers=headers)
        get("agent").drive(arena, seed=2, rate_rps=0.5, stop_at=200.0)
        arena.loop.run(200.0)
        assert len(arena.done) > 50
        assert all(d.req.facts.session is None and d.req.facts.interaction_id is None for d in arena.done) != headers
        scheduler = next(iter(arena.fronts.values())).scheduler
        shares[headers] = {u: scheduler.leases.continuations.share(u) for u in {d.req.facts.user for d in arena.done}}
    assert set(shares[True].values()) == {0.0}  # declared: nothing to recognize
    assert sorted(shares[False].values())[len(shares[False]) // 2] > 0.6  # most clients' steps continue


@pytest.mark.parametrize("system", ["lb", "nginx hash-session", "sglang-router cache_aware"])
def test_a_replica_joining_a_busy_fleet_serves_nothing_before_it_joins_and_its_share_after(system):
    """`--join-at S`: each region's last replica is ready only at S (a scale-out landing on a
    loaded fleet, its cache cold). Before S it is given nothing; after it, lb and the peers'
    worker lists take it in, and it serves about a replica's share of what is sent then."""
    from bench.sim import compare
    from bench.sim.compare import make_arena
    from bench.sim.workloads_sim import get

    arena = make_arena("shared-prefix", system, seed=1, join_at_s=40.0)
    joiner = arena.replicas[-1]
    assert joiner.id == "local/4" and joiner.ready_at == 40.0
    assert all(r.ready_at == 0.0 for r in arena.replicas[:-1])
    get("shared-prefix").drive(arena, seed=1, rate_rps=3.0, stop_at=120.0)  # past 3 replicas' capacity
    arena.loop.run(120.0)
    on_joiner = [d for d in arena.done if d.req.served_by == joiner.id]
    assert on_joiner and min(d.sent_at + d.ttft for d in on_joiner) >= 40.0
    after = [d for d in arena.done if d.sent_at >= 60.0]
    assert len([d for d in after if d.req.served_by == joiner.id]) > 0.15 * len(after)
    busy = compare.joined_busy(arena, 120.0)
    assert 0.5 < busy < 1.5  # worked about as hard as the others once it was there
    assert compare.joined_busy(make_arena("shared-prefix", system, seed=1), 120.0) is None  # nobody joins


def test_join_at_must_fall_inside_the_run_on_a_fleet_that_serves_before_it(tmp_path):
    from bench.sim import compare

    args = compare.argparse.Namespace(workload="tot", seeds=1, quick=True, out=str(tmp_path), load=0.9,
                                      sweep=False, list=False, workers=1, no_stream=False, duration=12.0,
                                      systems="lb", lb_config=None, join_at=30.0)
    with pytest.raises(SystemExit, match=r"--join-at must be inside the run \(0 < S < 12"):
        compare.run(args)
    with pytest.raises(SystemExit, match="--join-at must be inside the run"):
        compare.run(compare.argparse.Namespace(**{**vars(args), "join_at": 0.0}))


def test_a_surge_sends_the_same_arrivals_faster_inside_its_window_and_none_outside_it():
    """`--surge START:END:FACTOR`: the run's own draws, their times inside the window compressed
    by FACTOR and those after shifted back, for programs and replays alike; without one, the
    arrival times are the ones every earlier run had."""
    from bench.sim.clients import Surge
    from bench.sim.compare import make_arena
    from bench.sim.workloads_sim import get

    surge = Surge.parse("20:40:2")
    assert [surge.warp(u) for u in (10.0, 20.0, 30.0, 60.0, 70.0)] == [10.0, 20.0, 25.0, 40.0, 50.0]

    def sent_times(workload: str, rate: float, surge: Surge | None) -> list[float]:
        arena = make_arena(workload, "lb", seed=2)
        get(workload).drive(arena, seed=2, rate_rps=rate, stop_at=80.0, surge=surge)
        arena.loop.run(80.0)
        return sorted([d.sent_at for d in arena.done] + [sent for _, sent, _ in arena.callbacks.values()])

    for workload, rate in (("mooncake", 2.0), ("multiturn", 6.0)):
        plain, surged = sent_times(workload, rate, None), sent_times(workload, rate, surge)
        before = [t for t in plain if t < 20.0]
        assert before and [t for t in surged if t < 20.0] == before  # untouched before the window
        inside = len([t for t in surged if 20.0 <= t < 40.0])
        assert inside > 1.5 * len([t for t in plain if 20.0 <= t < 40.0])  # twice the rate there
        if workload == "mooncake":  # a replay: the same calls, only their times moved
            assert len(surged) > len(plain) and inside == len([t for t in plain if 20.0 <= t < 60.0])


@pytest.mark.parametrize("spec, message", [
    ("100:200", "expected START:END:FACTOR"), ("200:100:2", "0 <= START < END"), ("0:10:0", "FACTOR must be > 0"),
    ("5:30:2", r"must end inside the run \(END <= 12"),
])
def test_a_surge_outside_the_run_or_malformed_is_refused_naming_the_flag(tmp_path, spec, message):
    from bench.sim import compare

    args = compare.argparse.Namespace(workload="tot", seeds=1, quick=True, out=str(tmp_path), load=0.9,
                                      sweep=False, list=False, workers=1, no_stream=False, duration=12.0,
                                      systems="lb", lb_config=None, surge=spec)
    with pytest.raises(SystemExit, match=f"--surge .*{message}"):
        compare.run(args)


def test_a_surge_reports_each_systems_ttft_during_it_and_after_it(tmp_path, capsys):
    from bench.sim import compare

    args = compare.argparse.Namespace(workload="tot", seeds=1, quick=True, out=str(tmp_path), load=0.9,
                                      sweep=False, list=False, workers=1, no_stream=False, duration=40.0,
                                      systems="lb,nginx hash-session", lb_config=None, surge="10:20:2")
    (tmp_path / "capacity.json").write_text(json.dumps({"tot@300s": 40.0}))  # not measured: a 40 s run
    assert compare.run(args) == 0
    out = capsys.readouterr().out
    assert "(offered x2 from 10 to 20 s)" in out
    assert "of the requests sent during the surge / in as long a window after it: lb " in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["surge"] == {"start_s": 10.0, "end_s": 20.0, "factor": 2.0}
    for system in ("lb", "nginx hash-session"):
        assert summary["systems"][system]["surge_p90_s"]["median"] > 0
        assert summary["systems"][system]["after_surge_p90_s"]["median"] > 0


def test_the_hot_shift_replay_moves_its_hot_app_every_500_requests():
    import collections
    import itertools

    from bench.sim.workloads_sim import (HOT_SHIFT_APPS, HOT_SHIFT_EVERY, HOT_SHIFT_QUESTION_TOKENS,
                                         HOT_SHIFT_SYSTEM_TOKENS, WORKLOADS, hot_shift_calls)

    assert WORKLOADS["hot-shift"].kind == "replay"
    calls = [t.call for t in itertools.islice(hot_shift_calls(0), 4 * HOT_SHIFT_EVERY)]
    assert all(len(c.tokens) == HOT_SHIFT_SYSTEM_TOKENS + HOT_SHIFT_QUESTION_TOKENS for c in calls)
    apps = [c.tokens[0] for c in calls]  # a system prompt's first token names its app
    assert len(set(apps)) <= HOT_SHIFT_APPS
    hot = []
    for block in range(4):
        counts = collections.Counter(apps[block * HOT_SHIFT_EVERY:(block + 1) * HOT_SHIFT_EVERY])
        top, n = counts.most_common(1)[0]
        assert n > 0.15 * HOT_SHIFT_EVERY  # Zipf 1/rank over 32: the top app ~25 %
        hot.append(top)
    assert len(set(hot)) >= 3  # the hot app moves
    # requests of one app share its whole system prompt and nothing after it
    same = [c for c in calls if c.tokens[0] == hot[0]][:2]
    assert same[0].tokens[:HOT_SHIFT_SYSTEM_TOKENS] == same[1].tokens[:HOT_SHIFT_SYSTEM_TOKENS]
    assert same[0].tokens[HOT_SHIFT_SYSTEM_TOKENS:] != same[1].tokens[HOT_SHIFT_SYSTEM_TOKENS:]
    assert [c.tokens[0] for c in (t.call for t in itertools.islice(hot_shift_calls(1), 200))] != apps[:200]


def test_a_mixed_fleet_runs_vllm_and_sglang_replicas_side_by_side_and_lb_serves_on_both():
    """WORKLOAD@mixed: every second replica of each region on SGLang's scheduler, the rest on
    vLLM's, slow replicas slowed whichever they run; lb is given no word of which is which."""
    from bench.sim import compare, workloads_sim

    w = workloads_sim.get("heterogeneous@mixed")
    assert (w.name, w.fleet.profile, w.fleet.alt_profile) == ("heterogeneous@mixed", "l4-llama3-8b",
                                                             "l4-llama3-8b-sglang-fcfs")
    with pytest.raises(ValueError, match="one of vllm, sglang, sglang-lpm, mixed"):
        workloads_sim.get("tot@tgi")
    arena = compare.make_arena("heterogeneous@mixed", "lb", seed=0)
    kinds = ["sglang" if r.engine.profile.new_token_ratio is not None else "vllm" for r in arena.replicas]
    assert kinds == ["vllm", "sglang", "vllm", "sglang"]
    steps = [r.engine.profile.step_base_s for r in arena.replicas]
    assert steps[0] == steps[1] == 2 * steps[2] == 2 * steps[3]  # the two slow ones, one of each kind
    w.drive(arena, seed=0, rate_rps=20.0, stop_at=40.0)
    arena.loop.run(40.0)
    served = {r.id: r.engine.counters.requests for r in arena.replicas}
    assert all(served.values()), served


@pytest.mark.parametrize("system", ["lb", "llm-d default-scorers"])
def test_parallel_samples_run_as_engine_requests_and_come_back_as_one_answer(system):
    """A call with `samples` (the API's `n`) runs on one replica as that many engine requests
    beside one prefill of its prompt, and its client gets one answer of all their tokens."""
    from bench.sim import compare
    from bench.sim.arena import Call

    arena = compare.make_arena("best-of-n", system, 0)
    done = []
    prompt = list(range(1 << 30, (1 << 30) + 600))
    arena.send(Call("n4", "local", prompt, 50, user="u", samples=4), done.append)
    replicas = [r for front in arena.fronts.values() for r in front.replicas.values()]
    arena.loop.run(1.0)
    running = [r.engine.load().num_running for r in replicas]
    assert sorted(running)[-1] == 4 and sum(running) == 4  # the four samples side by side on one replica
    arena.loop.run(60.0)
    [d] = done
    assert d.output_tokens == 4 * 50 and d.prompt_tokens == 600
    assert d.cached_tokens < 600  # its prompt was computed once, by one of the samples: not found cached


def test_a_lora_request_waits_in_lb_where_no_batch_can_take_its_adapter_and_an_engine_would_skip_it():
    """On `multi-lora`'s fleet each batch runs at most MAX_LORAS adapters: with every replica's
    slots taken, a request for one more adapter waits in lb's queue and in no engine's; llm-d,
    which pushes blindly, leaves it waiting in an engine. Its adapter's KV is its own there."""
    from bench.sim import compare
    from bench.sim.arena import Call
    from bench.workloads.multi_lora import MAX_LORAS

    def fill(system: str):
        arena = compare.make_arena("multi-lora", system, 0)
        done = []
        replicas = [r for front in arena.fronts.values() for r in front.replicas.values()]
        for k in range(MAX_LORAS * len(replicas)):  # every slot of every replica: one adapter each
            arena.send(Call(f"fill-{k}", "local", list(range((k + 1) << 20, ((k + 1) << 20) + 200)), 400,
                            user="u", adapter=f"a{k}"), done.append)
        arena.loop.run(2.0)
        arena.send(Call("late", "local", list(range(1 << 30, (1 << 30) + 200)), 4, user="u", adapter="late"),
                   done.append)
        arena.loop.run(3.0)
        return arena, replicas, done

    arena, replicas, done = fill("lb")
    assert all(len(r.engine.adapters()[0]) == MAX_LORAS for r in replicas)  # every slot runs an adapter
    assert sum(r.engine.load().num_waiting for r in replicas) == 0 and len(arena.fronts["local"].queue) == 1
    arena.loop.run(120.0)
    assert "late" in {d.req.id for d in done}  # served once a slot freed
    arena, replicas, _ = fill("llm-d default-scorers")
    assert sum(r.engine.load().num_waiting for r in replicas) == 1  # skipped in an engine's queue
