"""The predicted-TTFT policy in the daemon, over real emulators of different speed: it learns
each replica's speed from the responses and sends sequential requests to the fast one,
with nothing configured about either (the heterogeneous fleet, untuned). Streamed answers
give TTFT and inter-token times; answers that come back whole give only their end-to-end
time, and must do too (batch and third-party clients often do not stream)."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.daemon.conftest import needs_emulator, start_emulator, start_lb
from tests.procs import metric

pytestmark = needs_emulator

N = 24


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_learns_the_faster_replica_from_its_answers(procs, stream):
    fast, fast_url = start_emulator("--speed", "8", name="fast")
    slow, slow_url = start_emulator("--speed", "2", name="slow")  # 4x slower steps
    procs += [fast, slow]
    d = start_lb("--replica", fast_url, "--replica", slow_url, "--engine", "vllm", "--policy", "predicted-ttft")
    procs.append(d.proc)
    for i in range(N):  # one at a time: equal load, no shared prefix; only speed tells them apart
        body = {"model": "m", "max_tokens": 12, "ignore_eos": True, "stream": stream,
                "messages": [{"role": "user", "content": f"question {i}: " + "why? " * 20}]}
        req = urllib.request.Request(d.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            assert r.status == 200 and (b"[DONE]" in body if stream else json.loads(body)["usage"]["completion_tokens"] == 12)
    served = {u: metric(d.url, "lb_requests_total", target=u.split("//")[1]) for u in (fast_url, slow_url)}
    print("requests per replica:", served)
    assert sum(served.values()) == N, served
    assert served[fast_url] >= 0.7 * N, served
