"""Fairness wiring over loopback: a real lb in front of a real emulator."""
from __future__ import annotations

import pytest

from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb

pytestmark = needs_emulator
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def lb_with(tmp_path):
    started = []

    def start(toml: str):
        emu, url = start_emulator("--speed", "50")
        started.append(emu)
        cfg = tmp_path / "lb.toml"
        cfg.write_text(f'[[replicas]]\nurl = "{url}"\nengine = "sglang"\nmodels = ["m"]\n\n{toml}')
        lb = start_lb(config=cfg)
        started.append(lb.proc)
        return lb

    yield start
    for p in reversed(started):
        p.stop()


def chat(lb, headers=None):
    return http_json("POST", lb.url + "/v1/chat/completions", BODY, headers=headers)


def test_bad_or_missing_identity_is_400_with_param(lb_with):
    lb = lb_with("[identity]\nrequire_user = true\n")
    status, doc = chat(lb)
    assert status == 400 and doc["error"]["param"] == "x-lb-user"
    status, doc = chat(lb, {"x-lb-user": "bad name"})
    assert status == 400 and doc["error"]["param"] == "x-lb-user"
    assert chat(lb, {"x-lb-user": "alice"})[0] == 200


def test_rpm_baseline_throttles_with_openai_error_and_ratelimit_headers(lb_with):
    lb = lb_with('[fairness]\nthrottle = "rpm"\nuser_rpm = 2\n')
    alice = {"x-lb-user": "alice"}
    assert [chat(lb, alice)[0] for _ in range(2)] == [200, 200]
    status, doc = chat(lb, {**alice, "x-lb-interaction-id": "i", "x-lb-interaction-stage": "1"})
    assert status == 429 and doc["error"]["code"] == "rate_limit_exceeded"
    h = {k.lower(): v for k, v in doc["_headers"].items()}
    assert int(h["retry-after"]) >= 1
    assert h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"].endswith("s")
    assert chat(lb, {"x-lb-user": "bob"})[0] == 200  # limits are per tenant
    # over the limit, alice may still tokenize (no engine time) and is still refused embeddings
    tok = http_json("POST", lb.url + "/tokenize", {"model": "m", "prompt": "hi"}, headers=alice)
    emb = http_json("POST", lb.url + "/v1/embeddings", {"model": "m", "input": "hi"}, headers=alice)
    assert (tok[0], emb[0]) == (200, 429)


def test_oit_does_not_throttle_when_the_region_is_not_overloaded(lb_with):
    lb = lb_with('[fairness]\nthrottle = "oit"\nuser_rpm = 1\noverload_queue_len = 1000\n'
                 '[queue]\norder = "wsc"\n')
    assert [chat(lb, {"x-lb-user": "alice"})[0] for _ in range(4)] == [200] * 4
