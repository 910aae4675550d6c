"""Every error `lb` answers itself, in the OpenAI shape, from a real daemon over loopback."""
from __future__ import annotations

import pytest

from tests.daemon.conftest import dead_url, http_json, start_lb


@pytest.fixture(scope="module")
def lone_lb():
    """An LB whose only replica is down: everything it can answer without a replica."""
    d = start_lb("--replica", dead_url(), "--engine", "vllm", "--model", "m", ready=False)
    yield d
    d.proc.stop()


def _assert_openai_error(doc: dict, code: str) -> None:
    err = doc["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code, doc


def chat(url: str, body, headers=None):
    return http_json("POST", url + "/v1/chat/completions", body, headers)


def test_health_live_but_not_ready(lone_lb):
    assert http_json("GET", lone_lb.url + "/health")[0] == 200
    status, doc = http_json("GET", lone_lb.url + "/ready")
    assert status == 503 and doc["ready"] is False


def test_malformed_json_is_400(lone_lb):
    status, doc = chat(lone_lb.url, b'{"model": "m", "messages": [')
    assert status == 400
    _assert_openai_error(doc, "invalid_json")
    status, doc = chat(lone_lb.url, b'[1, 2]')
    assert status == 400


def test_missing_field_is_400_naming_param(lone_lb):
    status, doc = chat(lone_lb.url, {"model": "m"})
    assert status == 400 and doc["error"]["param"] == "messages"


def test_unknown_model_is_404(lone_lb):
    status, doc = chat(lone_lb.url, {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert status == 404
    _assert_openai_error(doc, "model_not_found")


def test_body_over_limit_is_413(lone_lb):
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]}
    status, doc = chat(lone_lb.url, big)
    assert status == 413
    _assert_openai_error(doc, "body_too_large")


def test_no_replica_is_503_with_retry_after(lone_lb):
    status, doc = chat(lone_lb.url, {"model": "m", "messages": [{"role": "user", "content": "x"}]},
                       {"X-Request-Id": "req-42"})
    assert status == 503 and doc["_headers"]["Retry-After"] == "1"
    assert doc["_headers"]["X-Request-Id"] == "req-42"
    _assert_openai_error(doc, "no_replica")


def test_admin_needs_the_token(lone_lb):
    assert http_json("GET", lone_lb.url + "/admin/replicas")[0] == 401
    assert http_json("GET", lone_lb.url + "/admin/replicas", headers={"Authorization": "Bearer wrong"})[0] == 401
    status, doc = http_json("GET", lone_lb.url + "/admin/replicas", headers={"Authorization": f"Bearer {lone_lb.token}"})
    assert status == 200 and len(doc["replicas"]) == 1 and doc["replicas"][0]["healthy"] is False


def test_upstream_errors_are_normalized_to_openai_shape():
    import json

    from lb.daemon.errors import normalize_upstream_error
    flat = json.loads(normalize_upstream_error(400, b'{"object": "error", "message": "bad temp", "type": "BadRequestError", "param": null, "code": 400}'))
    assert flat == {"error": {"message": "bad temp", "type": "BadRequestError", "param": None, "code": 400}}
    nested = {"error": {"message": "no such model", "type": "NotFoundError", "param": "model", "code": 404}}
    assert json.loads(normalize_upstream_error(404, json.dumps(nested).encode())) == nested
    text = json.loads(normalize_upstream_error(502, b"Bad Gateway"))
    assert text["error"]["message"] == "Bad Gateway" and text["error"]["type"] == "server_error"


def test_internal_and_identity_headers_do_not_go_upstream():
    from lb.core.routes import BY_NAME
    from lb.daemon.config import Config
    from lb.daemon.surface import upstream_headers

    class Req:
        headers = {"Authorization": "Bearer k", "X-LB-Hop": "1", "X-LB-Peer-Region": "eu", "X-LB-User": "u",
                   "Accept": "text/event-stream", "Cookie": "c"}

    sent = upstream_headers(Req(), "rid-1", Config(), BY_NAME["chat"])
    assert sent == {"Content-Type": "application/json", "x-request-id": "rid-1", "Accept": "text/event-stream",
                    "Authorization": "Bearer k"}
