"""Fairness wiring over loopback: a real lb in front of a real emulator."""
from __future__ import annotations

import time

import pytest

from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb

pytestmark = needs_emulator
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def lb_with(tmp_path):
    started = []

    def start(toml: str, *emu_args: str):
        emu, url = start_emulator(*(emu_args or ("--speed", "50")))
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


@pytest.mark.timeout(90)
def test_oit_never_cuts_an_interaction_its_client_did_not_declare(lb_with):
    """The `openai` SDK sends no `x-lb-*` header; an agent's next step is known by its prompt
    (it extends the last step's prompt and answer). While the region is overloaded and the
    agent is over its limit, OIT refuses it a new question (429) and still serves the step
    that continues its interaction."""
    import threading

    import openai

    from tests.procs import metric

    lb = lb_with('[fairness]\nthrottle = "oit"\nuser_rpm = 2\noverload_queue_len = 1\n'
                  'user_rpm_overrides = { bob = 100 }\n[queue]\norder = "wsc"\n', "--speed", "1", "--max-running", "1")
    client = openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=0)
    system = {"role": "system", "content": "You are a travel agent with a booking tool. " * 20}
    messages = [system, {"role": "user", "content": "Book a train from Lyon to Turin next Friday. " * 6}]
    for step in range(2):  # two steps, within the limit; the region is idle
        answer = client.chat.completions.create(model="m", user="alice", max_tokens=8, messages=messages)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": f"Tool result {step}: " + "seat 42, coach 7, 89 EUR. " * 10}]

    def flood() -> None:  # another tenant's long answers fill the one engine slot and the LB queue
        client.chat.completions.create(model="m", user="bob", max_tokens=250, extra_body={"ignore_eos": True},
                                       messages=[{"role": "user", "content": "Write a long story. " * 8}])

    flooders = [threading.Thread(target=flood) for _ in range(6)]
    for t in flooders:
        t.start()
    deadline = time.monotonic() + 20
    while metric(lb.url, "lb_queue_length") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(lb.url, "lb_queue_length") >= 3  # overloaded: more queued than overload_queue_len

    with pytest.raises(openai.RateLimitError):  # a new question, over the limit: OIT refuses it
        client.chat.completions.create(model="m", user="alice", max_tokens=8, messages=[
            system, {"role": "user", "content": "Unrelated: what is the capital of Peru? " * 6}])
    answer = client.chat.completions.create(model="m", user="alice", max_tokens=8, messages=messages)
    assert answer.choices[0].message.content  # the agent's third step: served, not cut
    for t in flooders:
        t.join(timeout=30)
