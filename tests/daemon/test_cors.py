"""Browser pages calling `lb` (CORS, lb.core.cors): preflights and answers through a real `lb`
over a real emulator, as a browser's fetch() sends them; off by default, reloaded on SIGHUP."""
from __future__ import annotations

import http.client
import json
import signal
import time

import pytest

from lb.core.cors import origin_problem, preflight, response_headers
from lb.daemon.config import ConfigError, load
from tests.daemon.conftest import needs_emulator, start_lb_with_emulator

APP = "https://app.example.com"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def call(url: str, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={**headers, **({"Content-Type": "application/json"} if data else {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def preflight_of(url: str, origin: str, method: str = "POST", path: str = "/v1/chat/completions") -> tuple[int, dict, bytes]:
    return call(url, "OPTIONS", path, {"Origin": origin, "Access-Control-Request-Method": method,
                                      "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


@needs_emulator
def test_an_allowed_origin_gets_its_preflight_and_every_answer_carries_the_header(procs, tmp_path):
    lb, _ = start_lb_with_emulator(procs, tmp_path, f'[server]\ncors_allowed_origins = ["{APP}"]\n')
    status, h, _ = preflight_of(lb.url, APP)
    assert status == 204
    assert h["access-control-allow-origin"] == APP and h["vary"] == "Origin"
    assert "POST" in h["access-control-allow-methods"] and h["access-control-max-age"] == "600"
    assert h["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
    # the real request: JSON, streamed, and an error all carry the origin, or the page cannot read them
    status, h, body = call(lb.url, "POST", "/v1/chat/completions", {"Origin": APP}, CHAT)
    assert status == 200 and h["access-control-allow-origin"] == APP and json.loads(body)["choices"]
    status, h, body = call(lb.url, "POST", "/v1/chat/completions", {"Origin": APP}, {**CHAT, "stream": True})
    assert status == 200 and h["access-control-allow-origin"] == APP and body.rstrip().endswith(b"data: [DONE]")
    status, h, body = call(lb.url, "POST", "/v1/chat/completions", {"Origin": APP}, {**CHAT, "model": "nope"})
    assert status == 404 and h["access-control-allow-origin"] == APP and json.loads(body)["error"]["code"]
    # another origin: its preflight is refused in the OpenAI shape, and answers do not name it
    status, h, body = preflight_of(lb.url, "https://evil.example")
    assert status == 400 and "access-control-allow-origin" not in h
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert "server.cors_allowed_origins" in json.loads(body)["error"]["message"]
    status, h, _ = call(lb.url, "POST", "/v1/chat/completions", {"Origin": "https://evil.example"}, CHAT)
    assert status == 200 and "access-control-allow-origin" not in h  # served; the browser withholds it
    status, h, body = preflight_of(lb.url, APP, method="PATCH")
    assert status == 400 and "PATCH" in json.loads(body)["error"]["message"]


@needs_emulator
def test_cors_is_off_by_default_and_a_reload_turns_it_on(procs, tmp_path):
    lb, urls = start_lb_with_emulator(procs, tmp_path, "")
    status, h, body = preflight_of(lb.url, APP)
    assert status == 405 and "access-control-allow-origin" not in h  # as before: no route takes OPTIONS
    status, h, _ = call(lb.url, "POST", "/v1/chat/completions", {"Origin": APP}, CHAT)
    assert status == 200 and "access-control-allow-origin" not in h
    cfg = tmp_path / "lb.toml"
    cfg.write_text(cfg.read_text() + '[server]\ncors_allowed_origins = ["*"]\n')
    lb.proc.signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status, h, _ = preflight_of(lb.url, "https://any.example")
        if status == 204:
            break
        time.sleep(0.1)
    assert status == 204 and h["access-control-allow-origin"] == "*" and "vary" not in h
    status, h, _ = call(lb.url, "GET", "/v1/models", {"Origin": "https://any.example"})
    assert status == 200 and h["access-control-allow-origin"] == "*"


def test_origins_are_checked_when_the_config_is_read(tmp_path):
    for bad in ("https://app.example.com/", "app.example.com", "https://app.example.com/chat", "ftp://x.example"):
        cfg = tmp_path / "lb.toml"
        cfg.write_text(f'[server]\ncors_allowed_origins = ["{bad}"]\n')
        with pytest.raises(ConfigError, match=r"server\.cors_allowed_origins\[0\].*scheme://host\[:port\]"):
            load(str(cfg))
    assert origin_problem("http://127.0.0.1:3000", "k") is None and origin_problem("http://[::1]:5173", "k") is None


def test_the_decision_without_a_server():
    assert response_headers(None, (APP,)) == {} and response_headers(APP, ()) == {}
    assert response_headers(APP, (APP,), vary="Accept-Encoding")["Vary"] == "Accept-Encoding, Origin"
    headers, why = preflight(APP, "post", None, ("*",))
    assert why is None and headers["Access-Control-Allow-Origin"] == "*" and "Access-Control-Allow-Headers" not in headers
    headers, why = preflight(None, "POST", None, (APP,))
    assert why is not None and headers == {"Vary": "Origin"}
