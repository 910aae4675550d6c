"""`lb-bench run` against a real emulator process on loopback: schema, bounds, SSE parsing."""
from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import time
import urllib.request

import orjson
import pytest

from bench.client import SSEDecoder, chunk_text
from tests.procs import Proc, free_port, lb_bench


SUMMARY_KEYS = {"requests", "ok", "errors", "errors_by_kind", "duration_s", "throughput_rps",
                "output_tokens_per_s", "ttft_s", "e2e_s", "itl_s", "prompt_tokens", "cached_tokens",
                "output_tokens", "cached_token_ratio"}
RUN_KEYS = SUMMARY_KEYS | {"target", "seed", "workload", "model", "clients", "time_scale",
                           "ttft_quantiles_s", "per_tenant", "per_tier"}


@contextlib.contextmanager
def emulator_at(speed: float):
    """A tiny-profile emulator process; yields its base URL."""
    port = free_port()
    with Proc(lb_bench("emulate", "--port", str(port), "--profile", "tiny", "--speed", str(speed)),
              f"http://127.0.0.1:{port}/health", name="emulator"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def emulator():
    with emulator_at(speed=20) as url:
        yield url


def bench_run(tmp_path, target: str, *args: str, timeout: float = 60) -> tuple[dict, float]:
    out = tmp_path / "run.json"
    started = time.monotonic()
    done = subprocess.run(lb_bench("run", "--target", target, "--out", str(out), *args),
                          capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - started
    assert out.exists(), done.stdout + done.stderr
    assert "throughput req/s" in done.stdout  # the human-readable table
    return json.loads(out.read_text()), wall


def check_latency(obj: dict) -> None:
    assert set(obj) == {"p50", "p90", "p99", "mean"}
    assert 0 < obj["p50"] <= obj["p90"] <= obj["p99"]


def test_tot_run_has_the_schema_and_sane_values(tmp_path, emulator):
    report, _ = bench_run(tmp_path, emulator, "--workload", "tot", "--clients", "3", "--requests", "30",
                          "--param", "output_tokens=16", "--param", 'tier="iw-f"')
    assert RUN_KEYS <= set(report)
    assert report["requests"] == 30 and report["ok"] == 30 and report["errors"] == 0
    check_latency(report["ttft_s"])
    check_latency(report["e2e_s"])
    assert report["e2e_s"]["p50"] >= report["ttft_s"]["p50"]
    assert report["output_tokens"] == 30 * 16  # ignore_eos + max_tokens honoured, read from usage
    assert report["throughput_rps"] == pytest.approx(30 / report["duration_s"])
    # Tree nodes extend their parents' prompts: the emulator's prefix cache serves part of them.
    assert 0 < report["cached_token_ratio"] < 1
    assert set(report["per_tenant"]) == {"client-0", "client-1", "client-2"}
    assert set(report["per_tier"]) == {"iw-f"} and report["per_tier"]["iw-f"]["requests"] == 30
    for group in report["per_tenant"].values():
        assert SUMMARY_KEYS <= set(group)
    assert len(report["ttft_quantiles_s"]) == 21


def test_a_run_that_does_not_stream_reports_e2e_and_usage_but_no_ttft(tmp_path, emulator):
    report, _ = bench_run(tmp_path, emulator, "--workload", "tot", "--clients", "3", "--requests", "30",
                          "--param", "output_tokens=16", "--no-stream")
    assert report["stream"] is False and report["ok"] == 30 and report["errors"] == 0
    check_latency(report["e2e_s"])
    assert report["ttft_s"]["p50"] is None and report["ttft_quantiles_s"] == []
    assert report["output_tokens"] == 30 * 16  # from each answer's usage
    assert 0 < report["cached_token_ratio"] < 1  # the trees grew from the whole answers' text


def test_open_loop_replay_reports_per_tier_and_stops_at_requests(tmp_path, emulator):
    report, _ = bench_run(tmp_path, emulator, "--workload", "azure-conv", "--requests", "12",
                          "--time-scale", "50", "--param", "size_scale=0.05")
    assert report["requests"] == 12 and report["ok"] == 12
    assert set(report["per_tier"]) <= {"iw-f", "iw-n"} and sum(
        g["requests"] for g in report["per_tier"].values()) == 12
    assert set(report["per_tenant"]) == {"azure"}


def test_duration_bounds_a_closed_loop_run(tmp_path, emulator):
    report, wall = bench_run(tmp_path, emulator, "--workload", "multiturn", "--clients", "2",
                             "--duration", "1.5", "--param", "output_tokens=8")
    assert report["requests"] > 2 and report["errors"] == 0
    assert 1.5 <= report["duration_s"] < 10
    assert wall < 20


def test_deadline_cancels_in_flight_requests_and_reports_them(tmp_path):
    with emulator_at(speed=1) as target:
        report, wall = bench_run(tmp_path, target, "--workload", "multiturn", "--clients", "2",
                                 "--duration", "0.5", "--deadline", "1.0", "--param", "output_tokens=1500")
        assert report["errors_by_kind"] == {"deadline": 2} and report["ok"] == 0
        assert report["duration_s"] == pytest.approx(1.0, abs=0.5) and wall < 15
        # The cancelled streams were closed, so the engine aborted them (KV freed, nothing runs).
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(target + "/get_load", timeout=2) as r:
                load = json.loads(r.read())
            if sum(rank["num_reqs"] + rank["num_waiting_reqs"] for rank in load) == 0:
                break
            assert time.monotonic() < deadline, load
            time.sleep(0.05)


def raw_stream(target: str) -> bytes:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 12, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(target + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def decode_all(pieces: list[bytes]) -> list[str]:
    decoder = SSEDecoder()
    return [event for piece in pieces for event in decoder.feed(piece)]


def test_sse_decoder_parses_a_real_stream_split_anywhere(emulator):
    raw = raw_stream(emulator)
    whole = decode_all([raw])
    assert whole[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in whole[:-1]]
    assert "".join(chunk_text(c) for c in chunks).strip()
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"] == []
    for cut in range(1, len(raw)):
        assert decode_all([raw[:cut], raw[cut:]]) == whole
    assert decode_all([bytes([b]) for b in raw]) == whole


def test_sse_decoder_follows_the_spec_on_crlf_comments_and_multiline_data():
    raw = b": keep-alive\r\n\r\nevent: message\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\ndata:[DONE]\n\n"
    assert decode_all([raw]) == ['{"a":\n1}', "[DONE]"]
    assert chunk_text({"choices": [{"text": "hi"}]}) == "hi"  # /v1/completions chunks
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""


def test_http_errors_are_counted_by_kind(tmp_path, emulator):
    out = tmp_path / "run.json"
    done = subprocess.run(lb_bench("run", "--target", emulator, "--workload", "multiturn", "--requests", "5",
                                   "--model", "no-such-model", "--out", str(out)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1  # nothing succeeded
    report = json.loads(out.read_text())
    assert report["errors_by_kind"] == {"http_404": 5} and report["ok"] == 0
    assert report["ttft_s"] == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_an_agent_step_waits_for_its_tool_run_scaled_as_the_engines_time(tmp_path, emulator):
    from bench.workloads.agent import Agent

    params = {"system_tokens": 60, "task_tokens": [10, 20], "observation_tokens": [5, 20],
              "output_tokens": [4, 8], "steps": [4, 6], "think_mean_s": 0.6, "max_context": 1500}
    records_path = tmp_path / "records.jsonl"
    args = ["--workload", "agent", "--clients", "2", "--requests", "12", "--time-scale", "2",
            "--records", str(records_path)]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    report, _ = bench_run(tmp_path, emulator, *args)
    assert report["ok"] == 12 and report["errors"] == 0
    records = {r["request_id"]: r for r in map(json.loads, records_path.read_text().splitlines())}
    workload, gaps = Agent(**params), 0
    for client in range(2):
        for index in range(6):
            steps = workload.draw(client, index)[1]
            for k in range(len(steps) - 1):
                prev, nxt = (records.get(f"agent-c{client}-{index}-step{j}") for j in (k, k + 1))
                if prev is None or nxt is None:
                    continue
                # sent no sooner than its tool's run (at --time-scale 2) after the answer ended
                assert nxt["start"] - (prev["start"] + prev["e2e"]) >= steps[k].think_s / 2 - 0.01
                gaps += 1
    assert gaps >= 6


def test_reasoning_answers_come_back_as_long_as_the_workload_draws_them(tmp_path, emulator):
    """The reasoning workload against a real emulator: each answer is the drawn length."""
    from bench.workloads.reasoning import Reasoning

    params = {"system_min_tokens": 20, "system_max_tokens": 60, "question_median": 10, "answer_median": 8,
              "context": 2000, "total_rps": 20.0}
    records_path = tmp_path / "records.jsonl"
    args = ["--workload", "reasoning", "--requests", "8", "--records", str(records_path)]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    report, _ = bench_run(tmp_path, emulator, *args)
    assert report["ok"] == 8 and report["errors"] == 0
    records = {r["request_id"]: r for r in map(json.loads, records_path.read_text().splitlines())}
    drawn = {f"reason-0-{d.i}": d.answer_tokens for d in itertools.islice(Reasoning(**params).draws(), 8)}
    assert {rid: r["output_tokens"] for rid, r in records.items()} == drawn


def test_programs_arriving_open_loop_are_each_their_own_user_and_counted_when_whole(tmp_path, emulator):
    """`--program-rate`: trees arrive as a Poisson stream, each its own user (as the simulator's
    `--load` drives them), and the run reports how many ran whole."""
    report, _ = bench_run(tmp_path, emulator, "--workload", "tot", "--program-rate", "4", "--duration", "3",
                          "--param", "output_tokens=8")
    programs = report["programs"]
    assert 4 <= programs["started"] <= 30  # 12 expected
    assert 0 < programs["finished"] <= programs["started"] and programs["finished_rps"] > 0
    assert len(report["per_tenant"]) == programs["started"]  # one user a tree
    assert report["errors"] == 0 and report["clients"] is None and report["program_rate"] == 4
    trees = {}
    for tenant, group in report["per_tenant"].items():
        trees[tenant] = group["requests"]
    assert sum(n == 15 for n in trees.values()) >= programs["finished"]  # a whole 2-branch tree: 15 calls


def test_a_program_rate_needs_a_program_workload(tmp_path, emulator):
    done = subprocess.run(lb_bench("run", "--target", emulator, "--workload", "azure-conv", "--program-rate", "2"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--program-rate 2.0" in done.stderr and "replays its own arrivals" in done.stderr


def test_a_client_without_lb_headers_sends_only_its_request_id_and_the_openai_user(tmp_path, emulator):
    """`--no-session-headers`: what the openai SDK sends. The agent's steps still run whole."""
    from bench.workloads import make_workload

    spec = make_workload("agent", seed=1).program(0, 0).start()[0]
    assert {k.lower() for k in spec.headers()} >= {"x-lb-session", "x-lb-interaction-id", "x-lb-user"}
    assert spec.headers(lb=False) == {"X-Request-Id": spec.request_id}
    assert spec.body("m")["user"] == spec.user  # the OpenAI field names the user
    params = {"system_tokens": 60, "task_tokens": [10, 20], "observation_tokens": [5, 20],
              "output_tokens": [4, 8], "steps": [2, 3], "think_mean_s": 0.0, "max_context": 1500}
    args = ["--workload", "agent", "--clients", "2", "--requests", "8", "--no-session-headers"]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    report, _ = bench_run(tmp_path, emulator, *args)
    assert report["ok"] == 8 and report["errors"] == 0 and report["lb_headers"] is False
