"""Scaling actuators for real: a subprocess, a signed webhook to a local aiohttp server,
the Kubernetes scale PATCH against a fake API server process, local emulator processes."""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from lb.core.scaling import ScalingDecision
from lb.daemon.scaling_hooks import (ActuatorError, CommandActuator, KubernetesActuator, LocalActuator,
                                     ScalingHooks, WebhookActuator, make_actuator, sign)
from tests.procs import PYTHON, Proc, free_port

HERE = Path(__file__).resolve().parent
SECRET = "s3cret"


def decision(desired: int = 3, current: int = 2, region: str = "us", model: str = "m") -> dict:
    return ScalingDecision(region, model, current, desired, "test", "reactive", 12.0).to_json()


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.02)


class Receiver:
    """A real aiohttp server on 127.0.0.1 that checks signatures; fails the first `fail` posts."""

    def __init__(self, fail: int = 0, status: int = 500):
        self.fail, self.status = fail, status
        self.received: list[dict] = []
        self.attempts = 0
        self.bad_signatures = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.attempts += 1
        body = await request.read()
        ts = request.headers["X-LB-Timestamp"]
        if not hmac.compare_digest(request.headers["X-LB-Signature"], sign(SECRET, ts, body)):
            self.bad_signatures += 1
            return web.Response(status=401)
        if self.fail:
            self.fail -= 1
            return web.Response(status=self.status, text="try later")
        self.received.append(json.loads(body))
        return web.Response(text="ok")

    async def __aenter__(self) -> "Receiver":
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/hook"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def test_command_gets_the_decision_on_stdin(tmp_path):
    out = tmp_path / "got.json"
    act = CommandActuator([PYTHON, "-c", f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"])
    await act.apply(decision(5))
    assert json.loads(out.read_text())["desired"] == 5


async def test_command_failure_and_timeout_are_errors():
    with pytest.raises(ActuatorError, match="exited 3"):
        await CommandActuator([PYTHON, "-c", "import sys; sys.exit(3)"]).apply(decision())
    t0 = time.monotonic()
    with pytest.raises(ActuatorError, match="timed out"):
        await CommandActuator([PYTHON, "-c", "import time; time.sleep(30)"], timeout_s=0.5).apply(decision())
    assert time.monotonic() - t0 < 10


async def test_webhook_is_signed_and_retried_on_500():
    async with Receiver(fail=2) as rx:
        act = WebhookActuator(rx.url, secret=SECRET, retries=3, backoff_s=0.05)
        await act.apply(decision(4))
        await act.close()
    assert rx.attempts == 3 and rx.bad_signatures == 0
    assert rx.received == [decision(4)]


async def test_webhook_gives_up_without_retrying_a_client_error():
    async with Receiver(fail=5, status=400) as rx:
        act = WebhookActuator(rx.url, secret=SECRET, retries=3, backoff_s=0.05)
        with pytest.raises(ActuatorError, match="HTTP 400"):
            await act.apply(decision())
        await act.close()
    assert rx.attempts == 1


async def test_webhook_with_the_wrong_secret_is_refused():
    async with Receiver() as rx:
        act = WebhookActuator(rx.url, secret="wrong", retries=0)
        with pytest.raises(ActuatorError, match="401"):
            await act.apply(decision())
        await act.close()
    assert rx.bad_signatures == 1 and not rx.received


async def test_a_hanging_actuator_blocks_neither_submit_nor_the_others(tmp_path):
    async with Receiver() as rx:
        hang = CommandActuator([PYTHON, "-c", "import time; time.sleep(30)"], timeout_s=20)
        hooks = ScalingHooks([hang, WebhookActuator(rx.url, secret=SECRET, backoff_s=0.05)], min_interval_s=0)
        hooks.start()
        t0 = time.monotonic()
        assert hooks.submit(decision(3))
        assert time.monotonic() - t0 < 0.05  # submit never waits for an actuator
        await until(lambda: rx.received)
        assert not any(o["actuator"] == "command" for o in hooks.outcomes)  # still hanging
        assert hooks.submit(decision(4, region="eu"))
        await until(lambda: len(rx.received) == 2)
        await hooks.stop()


async def test_failures_are_recorded_and_the_next_decision_still_runs(tmp_path):
    marker = tmp_path / "runs"
    script = f"import sys; open({str(marker)!r}, 'a').write('x'); sys.exit(1)"
    hooks = ScalingHooks([CommandActuator([PYTHON, "-c", script])], min_interval_s=0)
    hooks.start()
    hooks.submit(decision(3))
    await until(lambda: len(hooks.outcomes) == 1)
    hooks.submit(decision(4))
    await until(lambda: len(hooks.outcomes) == 2)
    assert [o["ok"] for o in hooks.outcomes] == [False, False]
    assert "exited 1" in hooks.outcomes[0]["error"] and marker.read_text() == "xx"
    await hooks.stop()


async def test_decisions_are_rate_limited_per_pool():
    now = [0.0]
    hooks = ScalingHooks([], min_interval_s=30.0, clock=lambda: now[0])
    assert not hooks.submit(decision(2, current=2))  # no change asked
    assert hooks.submit(decision(3))
    assert not hooks.submit(decision(3))  # the same again
    now[0] = 10.0
    assert not hooks.submit(decision(4))  # too soon for this pool
    assert hooks.submit(decision(4, region="eu"))  # another pool is free
    now[0] = 31.0
    assert hooks.submit(decision(4))


async def test_kubernetes_patches_the_scale_subresource(tmp_path):
    port = free_port()
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    with Proc([PYTHON, str(HERE / "fake_k8s_api.py"), str(port), "tok-1"],
              f"http://127.0.0.1:{port}/healthz", name="fake-k8s"):
        act = KubernetesActuator(api_server=f"http://127.0.0.1:{port}", namespace="llm",
                                 deployment="sglang-{model}-{region}", token_file=str(token), backoff_s=0.05)
        await act.apply(decision(7, model="llama3"))
        token.write_text("rotated")  # re-read at each call: the old token is gone
        with pytest.raises(ActuatorError, match="401"):
            await act.apply(decision(8, model="llama3"))
        await act.close()
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/_requests") as r:
                seen = await r.json()
    assert seen[0] == {"method": "PATCH", "path": "/apis/apps/v1/namespaces/llm/deployments/sglang-llama3-us/scale",
                       "body": '{"spec": {"replicas": 7}}', "content_type": "application/merge-patch+json",
                       "authorization": "Bearer tok-1"}
    assert seen[1]["authorization"] == "Bearer rotated"


async def test_local_actuator_starts_and_stops_emulators():
    pytest.importorskip("bench.emulator", reason="bench/emulator.py has not landed")
    changes = []

    async def on_change(region, model, added, removed):
        changes.append((region, model, added, removed))

    act = make_actuator({"type": "local"}, on_change=on_change)
    assert isinstance(act, LocalActuator)
    try:
        await act.apply(decision(2, model="tiny-model"))
        urls = act.urls("us", "tiny-model")
        assert len(urls) == 2 and changes == [("us", "tiny-model", urls, [])]
        async with aiohttp.ClientSession() as s:
            async with s.get(urls[0] + "/v1/models") as r:
                assert "tiny-model" in await r.text()
        await act.apply(decision(1, current=2, model="tiny-model"))
        assert act.urls("us", "tiny-model") == urls[:1]
        assert changes[-1] == ("us", "tiny-model", [], urls[1:])
    finally:
        await act.close()
    assert act.urls("us", "tiny-model") == []


def test_config_names_bad_actuators():
    with pytest.raises(ValueError, match="choose one of"):
        make_actuator({"type": "ssh"})
    with pytest.raises(ValueError, match="command"):
        make_actuator({"type": "command", "argv": ["x"], "bogus": 1})
    with pytest.raises(ValueError, match="secret"):
        make_actuator({"type": "webhook", "url": "http://127.0.0.1:1/"})
