"""The real-vLLM harness (bench/real_vllm) end to end over emulators: the GPU run's code path
without a GPU, so a change that breaks it shows here and not on the next lent machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import urllib.request

from bench.fleet import Fleet


def test_fleet_harness_runs_every_system_from_empty_caches_and_reads_the_engines_counters(tmp_path):
    env = {**os.environ, "CLIENTS": "4"}
    r = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path), "1", "2"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [row["system"] for row in rows] == ["lb", "lb blind", "lb consistent-hash", "sglang-router cache_aware",
                                               "direct-rr"]
    for row in rows:
        assert row["ok"] > 0 and row["errors"] == 0, row
        assert row["samples"] > 0 and row["running_mean"] > 0 and 0 < row["kv_usage_mean"] < 1, row
        # lb's own queue wait is read from its /metrics; the other routers have none
        assert ("lb_queue_wait_mean_ms" in row) == (row["system"].split()[0] == "lb"), row
        # the engines' counters, read before and after each run, agree with the clients' usage
        assert abs(row["engine_hit_ratio"] - row["client_cached_ratio"]) < 1e-9, row
    replicas = json.loads((tmp_path / "lb-admin-replicas.json").read_text())["replicas"]
    assert len(replicas) == 4 and all(rep["engine"] == "vllm" and rep["kv_free_tokens"] for rep in replicas)
    with tarfile.open(tmp_path / "logs.tgz") as tar:
        assert any(n.endswith("engine0.log") for n in tar.getnames())


def test_fleet_harness_runs_the_systems_named_at_the_engines_working_point_named(tmp_path):
    """A small KV and a batch cap make the engines queue: the emulators get the same KV in tokens
    (0.25 GiB at 128 KiB a token) and cap, and only the systems named run."""
    env = {**os.environ, "CLIENTS": "12", "KV_GIB": "0.25", "MAX_NUM_SEQS": "2", "SYSTEMS": "lb blind,direct-rr"}
    r = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path), "1", "2"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [row["system"] for row in rows] == ["lb blind", "direct-rr"]
    assert all(row["running_mean"] <= 4 * 2 and row["waiting_max"] > 0 for row in rows), rows
    bad = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path / "bad"), "1", "1"],
                         capture_output=True, text=True, timeout=30, env={**env, "SYSTEMS": "lb,nginx"})
    assert bad.returncode != 0 and "SYSTEMS: unknown ['nginx']" in bad.stderr, bad.stderr
    bad = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path / "bad"), "1", "1"],
                         capture_output=True, text=True, timeout=30, env={**env, "MAX_NUM_SEQS": "eight"})
    assert bad.returncode != 0 and "MAX_NUM_SEQS: must be a positive int, got 'eight'" in bad.stderr, bad.stderr
    bad = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path / "bad"), "1", "1"],
                         capture_output=True, text=True, timeout=30, env={**env, "MAX_TOKENS": "lots"})
    assert bad.returncode != 0 and "MAX_TOKENS: max_tokens: give exact, none" in bad.stderr, bad.stderr


def _cached(url: str, prompt: str) -> int:
    with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        usage = json.loads(resp.read())["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_emulator_empties_its_prefix_cache_on_vllms_reset_prefix_cache(tmp_path):
    """What the harness relies on to start every system from empty caches."""
    prompt = "the same long prompt, again and again " * 40
    with Fleet(tmp_path) as fleet:
        emu = fleet.emulator(profile="tiny", speed=10.0)
        _cached(emu.url, prompt)
        assert _cached(emu.url, prompt) > 0
        req = urllib.request.Request(emu.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200
        assert _cached(emu.url, prompt) == 0


def test_fleet_harness_ab_tests_another_checkout_on_any_workload_at_a_speed_up(tmp_path):
    """`lb before` runs lb from the checkout LB_BEFORE names, interleaved with this one on the same
    engines; WORKLOAD/WORKLOAD_PARAMS pick the clients' workload; EMU_SPEED runs the emulators, an
    open-loop replay and lb's engine-time constants that many times faster."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "CLIENTS": "4", "SYSTEMS": "lb,lb before", "LB_BEFORE": root, "WORKLOAD": "shared-prefix",
           "WORKLOAD_PARAMS": "total_rps=2", "EMU_SPEED": "4", "EMU_PROFILE": "h100-llama3-8b", "MAX_TOKENS": "none"}
    r = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path), "1", "2"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [row["system"] for row in rows] == ["lb", "lb before"]
    for row in rows:
        assert row["ok"] > 0 and row["errors"] == 0, row
        assert row["max_tokens"] == "none", row  # the clients declared none (MAX_TOKENS)
        # what one probe took, and the router's own CPU over the run
        assert row["lb_probe_mean_ms"] > 0 and 0 < row["router_cpu_share"] < 2, row
    assert "interval_s = 0.025" in (tmp_path / "lb-engine-time.toml").read_text()  # lb's 100 ms probe / 4
    # `lb before` really runs the lb of LB_BEFORE's checkout: here one whose daemon only says so
    other = tmp_path / "other" / "lb" / "daemon"
    other.mkdir(parents=True)
    for pkg in (other.parent, other):
        (pkg / "__init__.py").write_text("")
    (other / "cli.py").write_text("print('the other checkout of lb')\nraise SystemExit(3)\n")
    bad = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path / "bad"), "1", "1"],
                         capture_output=True, text=True, timeout=60, env={**env, "LB_BEFORE": str(tmp_path / "other")})
    assert bad.returncode != 0 and "the other checkout of lb" in bad.stdout, bad.stdout[-2000:]
    bad = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path / "bad2"), "1", "1"],
                         capture_output=True, text=True, timeout=30, env={**env, "LB_BEFORE": ""})
    assert bad.returncode != 0 and "set LB_BEFORE" in bad.stderr, bad.stderr
    # a directory that is no checkout would let the interpreter find this one's lb: refused
    bad = subprocess.run([sys.executable, "-m", "bench.real_vllm.fleet", "emu", "-", str(tmp_path / "bad3"), "1", "1"],
                         capture_output=True, text=True, timeout=30, env={**env, "LB_BEFORE": str(tmp_path)})
    assert bad.returncode != 0 and "holds no lb/daemon/cli.py" in bad.stderr, bad.stderr
