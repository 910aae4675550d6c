"""What a benchmark client declares as max_tokens (bench.workloads.base.EXACT): by default each
answer's own length, an oracle no real client is; `none` or a loose cap like real clients,
the answers as long as before, live (the length goes as `min_tokens`, where the emulator ends
an answer) and in the simulator (the scheduler sees only what was declared)."""
from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from bench.sim.arena import Arena, as_records
from bench.sim.workloads_sim import get
from bench.workloads.base import EXACT, UNDECLARED, RequestSpec, check_max_tokens, declared_max_tokens
from tests.procs import Proc, free_port, lb, lb_bench


def test_modes_parse_and_a_loose_cap_keeps_to_the_context():
    assert check_max_tokens("exact") == EXACT and check_max_tokens("none") == UNDECLARED
    assert check_max_tokens("4096") == 4096
    for bad in ("0", "-3", "lots", True):
        with pytest.raises(ValueError, match="exact, none or a positive number"):
            check_max_tokens(bad)
    assert declared_max_tokens(EXACT, 64, 8000) == 64
    assert declared_max_tokens(UNDECLARED, 64, 8000) is None
    assert declared_max_tokens(4096, 64, 8000) == 4096
    assert declared_max_tokens(4096, 64, 1000) == 1000  # what the prompt leaves of the context
    assert declared_max_tokens(4096, 64, 10) == 64  # never below the answer itself


def test_a_request_declares_what_it_is_told_and_dictates_its_length_as_min_tokens():
    spec = RequestSpec("r", [{"role": "user", "content": "hi"}], max_tokens=64)
    exact = spec.body("m")
    assert exact["max_tokens"] == 64 and exact["ignore_eos"] is True and "min_tokens" not in exact
    none = spec.body("m", UNDECLARED)
    assert "max_tokens" not in none and "ignore_eos" not in none and none["min_tokens"] == 64
    loose = spec.body("m", 4096)
    assert loose["max_tokens"] == 4096 and "ignore_eos" not in loose and loose["min_tokens"] == 64


def _chat(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_through_lb_undeclared_answers_end_where_the_workload_says(tmp_path):
    emu_port, lb_port = free_port(), free_port()
    emu_url, lb_url = f"http://127.0.0.1:{emu_port}", f"http://127.0.0.1:{lb_port}"
    with Proc(lb_bench("emulate", "--port", str(emu_port), "--profile", "tiny", "--speed", "20"),
              emu_url + "/health", name="emulator"), \
            Proc(lb("serve", "--port", str(lb_port), "--replica", emu_url), lb_url + "/ready", name="lb"):
        with urllib.request.urlopen(emu_url + "/v1/models", timeout=5) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        msg = [{"role": "user", "content": "count to five"}]
        short = _chat(lb_url, {"model": model, "messages": msg, "min_tokens": 5})
        assert short["usage"]["completion_tokens"] == 5 and short["choices"][0]["finish_reason"] == "stop"
        capped = _chat(lb_url, {"model": model, "messages": msg, "min_tokens": 50, "max_tokens": 7})
        assert capped["usage"]["completion_tokens"] == 7 and capped["choices"][0]["finish_reason"] == "length"
        out = tmp_path / "run.json"
        done = subprocess.run(lb_bench("run", "--target", lb_url, "--workload", "tot", "--clients", "2",
                                       "--requests", "15", "--param", "output_tokens=12", "--max-tokens", "none",
                                       "--out", str(out)), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(out.read_text())
        assert report["max_tokens"] == UNDECLARED and report["ok"] == 15 and report["errors"] == 0
        assert report["output_tokens"] == 15 * 12  # each answer as long as the workload dictates
        bad = subprocess.run(lb_bench("run", "--target", lb_url, "--workload", "tot", "--max-tokens", "some"),
                             capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "exact, none or a positive number" in bad.stderr, bad.stderr


@pytest.mark.parametrize("mode", [UNDECLARED, 4096])
def test_the_simulated_scheduler_sees_only_what_was_declared(mode):
    seen, engines = {}, {}

    def run(declared):
        arena = Arena(get("tot").fleet, "lb", seed=0, max_tokens=declared)
        front = next(iter(arena.fronts.values()))
        arrive = front.arrive

        def spy(req, *rest):
            seen.setdefault(declared, []).append((req.facts.max_tokens, req.output_tokens, req.facts.prompt_tokens))
            return arrive(req, *rest)

        front.arrive = spy
        for rep in arena.replicas:  # what each engine is asked for, as live: the cap declared, the length as min_tokens
            submit = rep.engine.submit

            def engine_spy(er, now, submit=submit):
                engines.setdefault(declared, []).append((er.max_new_tokens, er.min_new_tokens, er.ignore_eos,
                                                         len(er.prompt_tokens)))
                return submit(er, now)

            rep.engine.submit = engine_spy
        get("tot").drive(arena, seed=0, rate_rps=20.0, stop_at=20.0)
        arena.loop.run(20.0)
        return {r.request_id: r.output_tokens for r in as_records(arena.done)}

    mine, exact = run(mode), run(EXACT)
    both = mine.keys() & exact.keys()
    assert len(both) > 100 and all(mine[k] == exact[k] for k in both)  # as long, whatever was declared
    assert all(declared == output for declared, output, _ in seen[EXACT])
    for declared, output, prompt in seen[mode]:
        assert declared == (None if mode == UNDECLARED else min(4096, arena_limit() - prompt))
    assert all(ignore and minimum == 0 for _, minimum, ignore, _ in engines[EXACT])
    for cap, minimum, ignore, prompt in engines[mode]:
        room = arena_limit() - prompt  # an undeclared request may run to the end of the context
        assert not ignore and 1 <= minimum <= cap == (room if mode == UNDECLARED else min(4096, room)), (cap, prompt)


def arena_limit() -> int:
    return Arena(get("tot").fleet, "lb", seed=0).limit


def test_sim_compare_names_the_flag_for_a_bad_declaration(tmp_path):
    bad = subprocess.run(lb_bench("sim-compare", "tot", "--max-tokens", "lots", "--out", str(tmp_path)),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--max-tokens: give exact, none or a positive number" in bad.stderr, bad.stderr
