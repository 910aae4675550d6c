"""`compare-*` machinery end to end on the tiny profile: lb and third-party routers in turn over
fresh emulators, report.md and summary.json, every system measured or skipped with a reason."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil

import pytest

from bench import report, report_md
from bench.cluster import RegionSpec
from bench.scenarios._compare import Compare, run_compare
from bench.systems import DIRECT, System, lb, nginx, nginx_config, sglang_router, unavailable, vllm_router



def tiny(systems: list[System], **kwargs) -> Compare:
    return Compare(title="tiny compare", scenario="tiny", workload="tot", systems=systems, duration_s=3.0, profile="tiny",
                   speed=10.0, replicas=2, clients=4, params={"output_tokens": 8}, **kwargs)


def check_summary(summary: dict, systems: list[System]) -> None:
    measured, skipped = summary["variants"], summary["skipped"]
    assert set(measured) | set(skipped) == {s.name for s in systems}
    assert not set(measured) & set(skipped)
    for name, run in measured.items():
        assert run["ok"] > 0 and run["errors"] == 0, (name, run["errors_by_kind"])
        assert run["load"]["samples"] > 0 and run["load"]["imbalance"] is not None
    for name, reason in skipped.items():
        assert reason.strip(), name


@pytest.mark.thirdparty
def test_quick_compare_single_region_writes_report_and_summary(tmp_path):
    broken = System("nginx bogus-policy", "nginx", "bogus-policy")  # fails to start: listed, not dropped
    systems = [lb(), sglang_router("cache_aware"), vllm_router("power_of_two"), nginx("least_conn"), DIRECT, broken]
    if all(unavailable(s) for s in systems[1:4]):
        pytest.skip("no third-party router installed (pip install sglang-router vllm-router; apt-get install nginx)")
    summary = run_compare(tiny(systems), tmp_path)
    report.write_summary(tmp_path / "summary.json", {"scenario": "tiny", **summary})
    check_summary(json.loads((tmp_path / "summary.json").read_text()), systems)
    assert "failed" in summary["skipped"]["nginx bogus-policy"]
    assert summary["baseline"] == "lb predicted-ttft/sp-pending"
    third = [n for n, r in summary["variants"].items() if r["system"]["family"] not in ("lb", "direct")]
    assert third, summary["skipped"]
    text = (tmp_path / "report.md").read_text()
    for name in [*summary["variants"], *summary["skipped"]]:
        assert name in text
    assert "the best peer's throughput" in text and "(1.00×)" in text
    assert "| `tiny` | lb predicted-ttft/sp-pending |" in report_md.overview([tmp_path])
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0 and (tmp_path / "throughput.png").stat().st_size > 0


@pytest.mark.skipif(shutil.which("nginx", path="/usr/sbin:/usr/bin") is None, reason="nginx is not installed")
def test_multi_region_lb_per_region_and_a_central_peer(tmp_path):
    systems = [lb(regional=True), nginx("hash-session")]
    c = tiny(systems, regions=[RegionSpec("us", 1, 3), RegionSpec("eu", 1, 2)], latency_ms={"us-eu": 20})
    summary = run_compare(c, tmp_path)
    check_summary(summary, systems)
    assert set(summary["variants"]) == {s.name for s in systems}, summary["skipped"]
    for run in summary["variants"].values():
        assert set(run["per_region"]) == {"us", "eu"}
    # eu's clients reach the central nginx across the 20 ms link (one round trip at least); lb's stay home
    central_eu = summary["variants"]["nginx hash-session"]["per_region"]["eu"]["ttft_s"]["p50"]
    assert central_eu >= 0.04


def test_nginx_config_hashes_on_the_session_header_and_rejects_unknown_policies(tmp_path):
    text = nginx_config(tmp_path, 8080, ["http://127.0.0.1:1", "http://127.0.0.1:2"], "hash-session")
    assert "hash $lb_session_key consistent;" in text and "$http_x_lb_session" in text
    assert "server 127.0.0.1:1 max_fails=0;" in text and "proxy_buffering off;" in text
    with pytest.raises(ValueError):
        nginx_config(tmp_path, 8080, ["http://127.0.0.1:1"], "random")


def test_repeats_interleave_rounds_and_report_medians_with_ranges(tmp_path, capsys):
    from bench.scenarios._compare import FOREIGN_CORES_WARN

    systems = [lb(), DIRECT]
    c = tiny(systems, repeats=2)
    c.duration_s = 2.0
    summary = run_compare(c, tmp_path)
    check_summary(summary, systems)
    started = [line.split("]")[0].strip("[") + line.split("run ")[1][:3]
               for line in capsys.readouterr().out.splitlines() if "]: run" not in line and " run " in line and " …" in line]
    assert started == [f"{lb().name}1/2", f"{DIRECT.name}1/2", f"{lb().name}2/2", f"{DIRECT.name}2/2"]  # A B, A B
    for name, v in summary["variants"].items():
        rep = v["repeats"]
        assert rep["runs"] == 2 and len(rep["foreign_cores"]) == 2
        thr = rep["figures"]["throughput_rps"]
        assert len(thr["runs"]) == 2 and thr["min"] <= thr["median"] <= thr["max"]
        assert v["throughput_rps"] == thr["median"]  # ratios between systems are ratios of medians
        p90 = rep["figures"]["ttft_s.p90"]
        assert v["ttft_s"]["p90"] == p90["median"]
        busy = [f for f in rep["foreign_cores"] if f > FOREIGN_CORES_WARN]
        assert len([w for w in summary["warnings"] if name in w and "other work took" in w]) == len(busy)
    assert any("median [min, max] of 2" in n for n in summary["notes"])
    assert "--repeats 2" in summary["command"]
    assert (tmp_path / "logs").is_dir() and len(list((tmp_path / "logs").glob("*/run-*"))) == 4


def test_sp_micro_states_sp_p_against_blind_pushing_whatever_the_default_policy(tmp_path):
    """The SP-P vs BP line of compare-sp-micro is found by pushing mode, not by a variant name
    that carries the policy (it went missing when the default policy changed)."""
    from bench.scenarios.compare_sp_micro import sp_vs_bp

    systems = [lb(), lb(pushing="blind")]
    summary = run_compare(tiny(systems, derived_notes=sp_vs_bp), tmp_path)
    check_summary(summary, systems)
    line = next(n for n in summary["notes"] if n.startswith("measured SP-P vs BP:"))
    p, b = (summary["variants"][s.name] for s in systems)
    assert f"{p['throughput_rps'] / b['throughput_rps']:.2f}× throughput" in line
    assert f"P90 TTFT {p['ttft_s']['p90'] / b['ttft_s']['p90']:.2f}× blind pushing's" in line
    assert f"cached-token ratio {p['cached_token_ratio']:.3f} vs {b['cached_token_ratio']:.3f}" in line
    assert line in (tmp_path / "report.md").read_text()


def test_compare_bursty_reports_each_tenants_p90_per_system(tmp_path):
    """compare-bursty's notes give, per system, the median tenant's and the worst tenant's TTFT
    p90 over its runs (ServeGen's eight tenants; two of them send 20 or more requests here)."""
    from bench.scenarios import compare_bursty

    systems = [lb(), DIRECT]
    c = compare_bursty.compare(True)
    c.systems, c.profile, c.speed, c.time_scale, c.duration_s = systems, "tiny", 10.0, 1.0, 5.0
    c.params = {"total_rps": 50.0, "size_scale": 0.05}
    summary = run_compare(c, tmp_path)
    check_summary(summary, systems)
    for name, v in summary["variants"].items():
        med, worst = (v["repeats"]["figures"][f"tenants.{k}"] for k in ("p90_median_s", "p90_worst_s"))
        assert med["median"] is not None and med["median"] <= worst["median"], (name, v["tenants"])
        line = next(n for n in summary["notes"] if n.startswith(f"{name}: each tenant's TTFT p90"))
        assert f"the median tenant's {med['median']:.2f}" in line and line in (tmp_path / "report.md").read_text()


def test_steady_state_leaves_out_the_first_fifth_and_the_drain_as_the_simulator_does():
    from bench.stats import RequestRecord, run_report

    def rec(i: int, start: float, e2e: float, cached: int) -> RequestRecord:
        return RequestRecord(f"r{i}", start, ok=True, ttft=0.1 * (1 + start), e2e=e2e, prompt_tokens=100,
                             cached_tokens=cached, output_tokens=10)

    # a cold start (nothing cached, slow answers), then a steady state, then the drain after 10 s
    records = [rec(0, 0.0, 2.5, 0), rec(1, 0.5, 2.0, 0)]
    records += [rec(2 + i, 2.0 + i, 1.0, 90) for i in range(8)]  # sent 2..9 s, ended 3..10 s
    records += [rec(10, 9.5, 3.0, 90)]  # sent in the window, ended in the drain
    report = run_report(records, 12.5, 10.0)
    steady = report["steady"]
    assert steady["from_s"] == 2.0
    # answers that ended in [2, 10]: the two cold ones (2.5 s and 2.5 s) and the eight
    assert steady["throughput_rps"] == 10 / 8.0
    assert steady["cached_token_ratio"] == 0.9  # the cold starts and the drained one left out
    assert steady["ttft_s"]["p50"] == pytest.approx(0.1 * (1 + 5.5))  # the median of those sent at 2..9 s
    assert report["cached_token_ratio"] < steady["cached_token_ratio"]  # the whole run counts them


def test_a_live_run_gives_each_tenants_p90_counting_requests_that_never_got_a_first_token():
    """The simulator's per-tenant figure on a live run's records: after the warm-up, each
    tenant's TTFT p90, a request cut at the deadline counted at its wait until the run ended."""
    from bench.stats import MIN_TENANT_REQUESTS, RequestRecord, run_report

    n = MIN_TENANT_REQUESTS
    records = [RequestRecord(f"a{i}", 3.0 + i * 0.1, ok=True, ttft=0.2, e2e=1.0, tenant="light") for i in range(n)]
    records += [RequestRecord(f"b{i}", 3.0 + i * 0.1, ok=True, ttft=0.5, e2e=1.0, tenant="heavy") for i in range(n)]
    # the heavy tenant's last five never got a first token before the deadline at 20 s
    records += [RequestRecord(f"c{i}", 9.0, ok=False, error="deadline", tenant="heavy") for i in range(5)]
    records += [RequestRecord("early", 0.5, ok=True, ttft=9.0, e2e=10.0, tenant="light")]  # the warm-up
    tenants = run_report(records, 20.0, 10.0)["tenants"]
    assert tenants["tenants"] == 2
    assert tenants["p90_worst_s"] == pytest.approx(11.0)  # 5 of 25 at 20 - 9 s: its p90 is their wait
    assert tenants["p90_median_s"] == pytest.approx((0.2 + 11.0) / 2)  # two tenants: the middle of the two
    one = run_report([r for r in records if r.tenant == "light"], 20.0, 10.0)["tenants"]
    assert one == {"p90_median_s": None, "p90_worst_s": None, "tenants": 0}  # one tenant: nothing to compare


def test_the_comparison_report_shows_the_steady_state_beside_the_whole_run():
    runs = {name: {"system": {"family": fam}, "throughput_rps": thr, "ttft_s": {"p50": 0.1, "p90": 0.2},
                   "steady": {"from_s": 4.0, "throughput_rps": thr * 1.1, "ttft_s": {"p50": 0.1, "p90": p90},
                              "cached_token_ratio": cached}}
            for name, fam, thr, p90, cached in (("lb", "lb", 40.0, 0.3, 0.89), ("ring", "nginx", 42.0, 0.5, 0.9))}
    text = report_md.scenario_markdown({"title": "t", "variants": runs})
    steady = text.split("After the warm-up (requests from 4 s on")[1]
    assert "| **lb** | 44.00 (0.95×) | 100 (1.00×) | 300 (0.60×) | 0.890 (0.99×) |" in steady


def test_a_comparison_can_run_some_of_its_systems_for_longer_and_says_so():
    from bench.scenarios import compare_sp_micro
    from bench.scenarios._compare import with_run_options

    c = with_run_options(compare_sp_micro.compare(False), 2, duration=60,
                         systems="nginx hash-session, lb predicted-ttft/sp-pending")
    assert [s.name for s in c.systems] == ["nginx hash-session", "lb predicted-ttft/sp-pending"]
    assert c.duration_s == 60 and c.repeats == 2
    assert c.options == ["--duration 60", "--systems 'nginx hash-session,lb predicted-ttft/sp-pending'"]
    with pytest.raises(SystemExit, match="unknown 'nginx hash'.*'nginx hash-session'"):
        with_run_options(compare_sp_micro.compare(False), 1, systems="nginx hash")


def test_an_operators_own_config_runs_beside_the_default_its_durations_in_engine_time(tmp_path):
    """`--lb-config FILE` adds `lb config`: the file's settings (not its replicas or ports),
    its durations divided by the emulators' speed-up as lb's defaults are; `--clients N` sets
    the closed-loop clients. The daemon is started on the composed file and answers."""
    from bench.scenarios._compare import LB_FROM_FILE, with_run_options
    from lb.daemon.config import load

    own = tmp_path / "own.toml"
    own.write_text('[server]\nport = 1\n\n[pushing]\nlease_s = 0\n\n[queue]\norder = "fcfs"\n\n'
                   '[affinity]\nhold_s = 2.0\n\n[[replicas]]\nurl = "http://127.0.0.1:9"\n')
    c = with_run_options(tiny([lb()]), 1, clients=6, lb_config=str(own))
    assert [s.name for s in c.systems] == ["lb predicted-ttft/sp-pending", LB_FROM_FILE] and c.clients == 6
    assert c.options == ["--clients 6", f"--lb-config {own}"] and c.notes[-1].startswith("--clients 6: 6 closed-loop")
    summary = run_compare(c, tmp_path / "out")
    check_summary(summary, c.systems)
    assert set(summary["variants"]) == {s.name for s in c.systems}, summary["skipped"]
    daemon = {name: load(tmp_path / "out" / "logs" / name / "lb.toml") for name in ("lb-predicted-ttft-sp-pending", "lb-config")}
    ours, default = daemon["lb-config"], daemon["lb-predicted-ttft-sp-pending"]
    assert ours.pushing.lease_s == 0 and default.pushing.lease_s == pytest.approx(5.0 / 10)  # speed 10
    assert ours.affinity.hold_s == pytest.approx(0.2) and default.affinity.hold_s == pytest.approx(0.1)
    assert ours.queue.order == "fcfs" and default.queue.order == "wsc"
    assert ours.probes.interval_s == pytest.approx(0.01) and not ours.replicas  # the scenario's replicas, not the file's


def test_a_scenario_on_sglangs_scheduler_runs_with_the_waiting_order_asked_for():
    """`--schedule-policy lpm`: compare-long-short's engines order their waiting queue longest
    cached prefix first (SGLang's older default) instead of in arrival order, and say so."""
    from bench.profiles import PROFILES
    from bench.scenarios import compare_long_short, compare_mixed_tree
    from bench.scenarios._compare import with_run_options

    c = with_run_options(compare_long_short.compare(False), 1, schedule_policy="lpm")
    assert c.profile == "l4-llama3-8b-sglang" and PROFILES[c.profile].waiting_order == "lpm"
    assert c.options == ["--schedule-policy lpm"] and "longest cached prefix first" in c.notes[-1]
    c = with_run_options(compare_long_short.compare(False), 1, schedule_policy="fcfs")
    assert c.profile == compare_long_short.PROFILE and PROFILES[c.profile].waiting_order == "fcfs"
    with pytest.raises(SystemExit, match="--schedule-policy: compare-mixed-tree: profile 'l4-llama3-8b' does not "
                                         "model SGLang's scheduler; these do: .*l4-llama3-8b-sglang"):
        with_run_options(compare_mixed_tree.compare(False), 1, schedule_policy="lpm")


def test_run_options_refuse_what_a_scenario_cannot_take(tmp_path):
    from bench.scenarios import compare_mooncake, compare_tot
    from bench.scenarios._compare import with_run_options

    with pytest.raises(SystemExit, match="--clients: compare-mooncake replays its trace open loop"):
        with_run_options(compare_mooncake.compare(False), 1, clients=8)
    with pytest.raises(SystemExit, match="--clients: compare-tot sets its clients per region"):
        with_run_options(compare_tot.compare(False), 1, clients=8)
    with pytest.raises(SystemExit, match="--clients must be >= 1"):
        with_run_options(tiny([lb()]), 1, clients=0)
    bad = tmp_path / "bad.toml"
    bad.write_text("[pushing]\nlease_s = -1\n")
    with pytest.raises(SystemExit, match="--lb-config .*bad.toml: .*pushing.lease_s: must be a finite number of seconds >= 0"):
        with_run_options(tiny([lb()]), 1, lb_config=str(bad))


def test_the_regional_testbed_scales_every_engine_time_duration_and_keeps_the_pushing_mode(tmp_path):
    """`bench.cluster` writes each LB's file: the probe, the affinity bounds, the KV lease and a
    section the spec adds all divided by the speed-up, the pushing mode kept beside them (a
    `[pushing]` section from the spec used to replace it)."""
    from bench.cluster import ClusterSpec, RegionSpec, start_testbed
    from bench.fleet import Fleet
    from lb.daemon.config import load

    spec = ClusterSpec(regions=[RegionSpec("us", 1, 0), RegionSpec("eu", 1, 0)], mode="peering",
                       latency_ms={"us-eu": 0}, profile="tiny", speed=10.0, pushing="blind",
                       lb={"pushing": {"lease_s": 2.0}, "affinity": {"hold_s": 3.0}})
    with Fleet(tmp_path) as fleet:
        start_testbed(fleet, spec)
        cfg = load(tmp_path / "lb-us.toml")
    assert cfg.pushing.mode == "blind" and cfg.pushing.lease_s == pytest.approx(0.2)
    assert cfg.affinity.hold_s == pytest.approx(0.3) and cfg.probes.interval_s == pytest.approx(0.01)


def test_mixed_engines_run_every_second_replica_on_sglangs_scheduler(tmp_path):
    """`--mixed-engines`: one region's replicas alternate between the scenario's engine and
    SGLang's scheduler on the same hardware, lb serves both, and the report says so."""
    from bench.scenarios import compare_long_short, compare_sp_micro, compare_tot
    from bench.scenarios._compare import with_run_options

    c = with_run_options(compare_sp_micro.compare(False), 1, mixed_engines=True)
    assert (c.profile, c.alt_profile) == ("l4-llama3-8b", "l4-llama3-8b-sglang-fcfs")
    assert c.options == ["--mixed-engines"] and "l4-llama3-8b-sglang-fcfs" in c.notes[-1]
    with pytest.raises(SystemExit, match="--mixed-engines: compare-long-short: profile .* runs SGLang's scheduler already"):
        with_run_options(compare_long_short.compare(False), 1, mixed_engines=True)
    with pytest.raises(SystemExit, match="--mixed-engines: compare-tot runs three regions"):
        with_run_options(compare_tot.compare(False), 1, mixed_engines=True)

    summary = run_compare(tiny([lb()], alt_profile="tiny-sglang"), tmp_path)
    check_summary(summary, [lb()])
    logs = sorted((tmp_path / "logs").rglob("emu*.log"))
    started = [next(line for line in p.read_text().splitlines() if "listening" in line) for p in logs]
    assert ["profile=tiny-sglang " in s for s in started] == [False, True], started


def test_every_comparison_runs_at_the_speed_asked_for_with_all_its_time_constants_alike(capsys):
    """`--speed F`: a scenario builds its engines, replays, tool runs, lb's time constants and
    WAN latency from F, not its own speed-up (a small machine runs Mixed Tree at 2x, not 4x),
    and its report's notes and command line say F. A scenario without a speed-up refuses it."""
    import argparse
    import importlib

    from bench.scenarios import compare_agent, compare_tot
    from bench.scenarios._compare import PAPER_LATENCY_MS, at_speed, slower_hint
    from bench.scenarios.runner import configure, run, scenario_names

    for name in [n for n in scenario_names() if n.startswith("compare-")]:
        module = importlib.import_module(f"bench.scenarios.{name.replace('-', '_')}")
        own, other = at_speed(module.compare, False, None), at_speed(module.compare, False, 3.0)
        assert own.speed == module.SPEED and other.speed == 3.0 and other.options == ["--speed 3"], name
        assert other.time_scale == (3.0 if own.time_scale == own.speed else own.time_scale), name  # replays follow
        said = " ".join(other.notes)
        factors = set(re.findall(r"(?<![\d.])(\d+(?:\.\d+)?)[×x] (?:speed|faster)", said))
        assert factors == {"3"}, (name, said)
    assert slower_hint(4.0).endswith("--speed 2 (the same engine time)") and slower_hint(1.5).endswith("--speed 1 (the same engine time)")
    assert slower_hint(1.0) == ""  # real time: nothing to slow
    tot = at_speed(compare_tot.compare, False, 1.0)
    assert tot.latency_ms == PAPER_LATENCY_MS and "1× speed" in tot.notes[0]
    assert at_speed(compare_tot.compare, False, None).latency_ms["us-eu"] == 40 / compare_tot.SPEED
    agent = at_speed(compare_agent.compare, False, 2.0)
    assert (agent.speed, agent.time_scale) == (2.0, 2.0) and "tool runs 2x faster" in agent.notes[0]
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(SystemExit, match=r"--speed must be a finite number > 0 \(got .*\); e.g. --speed 2"):
            at_speed(compare_tot.compare, False, bad)

    parser = argparse.ArgumentParser()
    configure(parser)
    assert run(parser.parse_args(["overhead", "--speed", "2"])) == 2
    assert "scenario overhead does not take --speed" in capsys.readouterr().err
