"""`engine = "auto"` (the default) over real processes: the engine each replica runs is told
by how its load endpoints answer, and scheduling uses what was found (lb.core.engines)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb
from tests.procs import Proc, free_port, metric, poll

VLLM_PAGE = Path(__file__).parent.parent / "data" / "vllm-0.25.1-h200-metrics-idle.txt"


def standin(metrics: Path) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc([sys.executable, "-m", "tests.daemon.engine_standin", str(port), str(metrics)],
                ready_url=f"http://127.0.0.1:{port}/health", name="standin")
    return proc, f"http://127.0.0.1:{port}"


def engines(lb_url: str, replica_url: str) -> dict[str, float]:
    rid = urlsplit(replica_url).netloc
    return {e: metric(lb_url, "lb_replica_engine", replica=rid, engine=e)
            for e in ("auto", "sglang", "vllm", "llamacpp", "openai")}


def replica(lb, url: str) -> dict:
    doc = http_json("GET", lb.url + "/admin/replicas", headers={"Authorization": f"Bearer {lb.token}"})[1]
    return next(r for r in doc["replicas"] if r["url"] == url)


@needs_emulator
def test_unset_engines_are_detected_sglang_from_its_load_endpoint_and_vllm_from_its_metrics(procs, tmp_path):
    emu, emu_url = start_emulator()
    procs.append(emu)
    page = tmp_path / "metrics.txt"
    shutil.copy(VLLM_PAGE, page)
    vllm, vllm_url = standin(page)
    procs.append(vllm)
    lb = start_lb("--replica", emu_url, "--replica", vllm_url)  # no --engine
    procs.append(lb.proc)
    poll(lambda: engines(lb.url, emu_url)["sglang"] == 1.0, what="the emulator seen as SGLang")
    poll(lambda: engines(lb.url, vllm_url)["vllm"] == 1.0, what="the vLLM page seen as vLLM")
    seen = replica(lb, vllm_url)
    assert seen["engine"] == "vllm" and seen["reports_pending"] and seen["kv_free_tokens"] == 65536
    assert seen["kv_total_tokens"] == 65536  # idle: all of it free
    assert replica(lb, emu_url)["reports_pending"]
    assert sum(engines(lb.url, emu_url).values()) == 1.0  # one engine series per replica


def test_a_server_without_load_endpoints_is_openai_until_its_metrics_appear(procs, tmp_path):
    page = tmp_path / "metrics.txt"  # absent: /metrics answers 404
    server, url = standin(page)
    procs.append(server)
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f'[probes]\nredetect_s = 0.3\n\n[[replicas]]\nurl = "{url}"\n')
    lb = start_lb(config=cfg)
    procs.append(lb.proc)
    poll(lambda: engines(lb.url, url)["openai"] == 1.0, what="a plain OpenAI server seen as openai")
    status, doc = http_json("POST", lb.url + "/v1/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and doc["choices"][0]["message"]["content"] == "ok"
    assert not replica(lb, url)["reports_pending"]
    shutil.copy(VLLM_PAGE, page)  # its metrics come up later
    poll(lambda: engines(lb.url, url)["vllm"] == 1.0, what="the same server seen as vLLM once it has metrics")
    assert replica(lb, url)["reports_pending"]


@needs_emulator
def test_a_configured_engine_is_not_second_guessed(procs):
    emu, emu_url = start_emulator()
    procs.append(emu)
    lb = start_lb("--replica", emu_url, "--engine", "vllm")  # the emulator speaks both; vLLM's face is read
    procs.append(lb.proc)
    poll(lambda: replica(lb, emu_url)["healthy"], what="the replica healthy")
    assert engines(lb.url, emu_url)["vllm"] == 1.0 and engines(lb.url, emu_url)["sglang"] == 0.0


@needs_emulator
def test_a_vllm_replica_s_first_tokens_are_read_from_its_ttft_histogram(procs):
    """Answers that come back whole show the LB no first token; vLLM's /metrics counts them
    (`vllm:time_to_first_token_seconds_count`), and the probe reads that count for the backlog."""
    emu, emu_url = start_emulator()
    procs.append(emu)
    lb = start_lb("--replica", emu_url, "--engine", "vllm")
    procs.append(lb.proc)
    poll(lambda: replica(lb, emu_url)["healthy"], what="the replica healthy")
    assert replica(lb, emu_url)["first_tokens"] == 0
    for i in range(3):
        status, _ = http_json("POST", lb.url + "/v1/chat/completions",
                              {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4})
        assert status == 200
    poll(lambda: replica(lb, emu_url)["first_tokens"] == 3, what="three first tokens counted by the engine")


@needs_emulator
def test_an_sglang_replica_s_first_tokens_are_read_from_its_metrics_while_whole_answers_wait(procs):
    """SGLang's /v1/loads counts no first tokens; while a push answered whole waits there the
    probe reads them from its /metrics (`sglang:time_to_first_token_seconds_count`)."""
    emu, emu_url = start_emulator()
    procs.append(emu)
    lb = start_lb("--replica", emu_url)  # detected as SGLang
    procs.append(lb.proc)
    poll(lambda: engines(lb.url, emu_url)["sglang"] == 1.0, what="the emulator seen as SGLang")
    assert replica(lb, emu_url)["first_tokens"] is None  # nothing waits: /metrics not read
    for i in range(3):  # long answers, whole: each waits across probes
        status, _ = http_json("POST", lb.url + "/v1/chat/completions",
                              {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}],
                               "max_tokens": 200, "ignore_eos": True}, timeout=30)
        assert status == 200
    poll(lambda: (replica(lb, emu_url)["first_tokens"] or 0) >= 1, what="first tokens read from /metrics")
