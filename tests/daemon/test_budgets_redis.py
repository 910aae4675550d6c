"""Tenant token budgets across two real `lb` processes sharing one real redis-server.

team-a may spend 100 tokens a minute; team-b has no budget. team-a spends 2 x (prompt + 50
output) tokens through `a`; `b` (another LB of the region, same store) then refuses team-a
with a 429 in the OpenAI shape with Retry-After, and still serves team-b. The spend ledger
in Redis holds what both served team-a, equal to their exported per-tenant spend.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb
from tests.procs import metric, poll

pytestmark = [needs_emulator, pytest.mark.timeout(90)]


def chat(url: str, key: str) -> tuple[int, dict]:
    return http_json("POST", url + "/v1/chat/completions",
                     {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50,
                      "ignore_eos": True}, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_budget_spent_through_one_lb_is_enforced_by_the_other(tmp_path: Path, procs, redis_url):
    emu, emu_url = start_emulator()
    procs.append(emu)
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f'[identity]\napi_keys = {{ "sk-a" = "team-a", "sk-b" = "team-b" }}\nrequire_api_key = true\n\n'
                   f'[budgets]\noverrides = {{ "team-a" = 100 }}\n\n'
                   f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "budget-test:"\nsync_interval_s = 0.1\n\n'
                   f'[[replicas]]\nurl = "{emu_url}"\nengine = "sglang"\nmodels = ["m"]\n')
    a = start_lb(config=cfg, name="lb-a")
    procs.append(a.proc)
    b = start_lb(config=cfg, name="lb-b")
    procs.append(b.proc)

    spent = 0
    for _ in range(2):
        status, doc = chat(a.url, "sk-a")
        assert status == 200, doc
        assert doc["usage"]["completion_tokens"] == 50
        spent += doc["usage"]["prompt_tokens"] + doc["usage"]["completion_tokens"]
    assert spent >= 100

    def refused() -> tuple[int, dict] | None:
        status, doc = chat(b.url, "sk-a")
        return (status, doc) if status == 429 else None

    status, doc = poll(refused, timeout=10, what="b to refuse team-a once a's spend reached the store")
    err = doc["error"]
    assert err["code"] == "rate_limit_exceeded" and "tokens per min" in err["message"] and err["type"]
    headers = {k.lower(): v for k, v in doc["_headers"].items()}
    assert 1 <= int(headers["retry-after"]) <= 65
    assert headers["x-ratelimit-limit-tokens"] == "100" and headers["x-ratelimit-remaining-tokens"] == "0"
    assert chat(b.url, "sk-b")[0] == 200  # no budget, not affected
    assert chat(a.url, "sk-a")[0] == 429  # a sees the same shared window

    assert metric(b.url, "lb_tenant_budget_rejected_total", tenant="team-a") >= 1
    a_prompt = metric(a.url, "lb_tenant_spend_tokens_total", tenant="team-a", kind="prompt")
    assert metric(a.url, "lb_tenant_spend_tokens_total", tenant="team-a", kind="output") == 100
    assert a_prompt + 100 == spent

    import redis
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        # the ledger is the region's: a's spend plus whatever b served team-a before a's spend reached it
        served = {kind: sum(metric(lb.url, "lb_tenant_spend_tokens_total", tenant="team-a", kind=kind) for lb in (a, b))
                  for kind in ("prompt", "output")}
        poll(lambda: r.get("budget-test:spend:team-a:output") == f"{served['output']:g}", timeout=5,
             what=f"the ledger in redis to reach {served}")
        assert float(r.get("budget-test:spend:team-a:prompt")) == served["prompt"]
        assert 0 < r.ttl("budget-test:spend:team-a:output")  # bounded: it expires
    finally:
        r.close()
