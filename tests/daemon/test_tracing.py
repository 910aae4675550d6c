"""OpenTelemetry tracing (the `otel` extra), with the SDK's in-memory exporter.

`near` runs in this process (tracing on, a provider with InMemorySpanExporter installed
first, as an embedding app would) over a real emulator serving model `x`, and peers with
`far`, a real `lb` process (tracing off: it passes `traceparent` on unchanged) over an
emulator serving `m`. Each emulator records the last `traceparent` it received.
Off by default: building lb's app imports no opentelemetry at all.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra: pip install 'lb[otel]'")

from aiohttp import ClientSession, web  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from lb.daemon.app import build_app  # noqa: E402
from lb.daemon.config import load  # noqa: E402
from tests.daemon.conftest import needs_emulator, start_emulator  # noqa: E402
from tests.procs import PYTHON, REPO, Proc, free_port, lb, poll  # noqa: E402

pytestmark = [needs_emulator, pytest.mark.timeout(90)]

SECRET = "trace-secret"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


def last_traceparent(emu_url: str) -> str | None:
    with urllib.request.urlopen(emu_url + "/debug/traceparent", timeout=5) as r:
        return json.loads(r.read())["traceparent"]


async def test_spans_for_request_queue_attempts_and_peer_forward_with_traceparent_propagated(tmp_path: Path, procs):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    emu_x, x_url = start_emulator(model="x", name="emu-x")
    procs.append(emu_x)
    emu_m, m_url = start_emulator(model="m", name="emu-m")
    procs.append(emu_m)
    far_port = free_port()
    far_cfg = tmp_path / "far.toml"
    far_cfg.write_text(f'[server]\nport = {far_port}\naccess_log = false\n[peering]\nregion = "far"\n'
                       f'[[replicas]]\nurl = "{m_url}"\nengine = "sglang"\nmodels = ["m"]\n')
    procs.append(Proc(lb("serve", "--config", str(far_cfg)), ready_url=f"http://127.0.0.1:{far_port}/ready",
                      name="lb-far", env={"LB_PEER_SECRET": SECRET}))
    near_cfg = tmp_path / "near.toml"
    near_cfg.write_text(f'[server]\ntracing = true\naccess_log = false\n[peering]\nregion = "near"\nsecret = "{SECRET}"\n'
                        f'[[replicas]]\nurl = "{x_url}"\nengine = "sglang"\nmodels = ["x"]\n'
                        f'[[peers]]\nregion = "far"\nurl = "http://127.0.0.1:{far_port}"\n')
    runner = web.AppRunner(build_app(load(near_cfg)))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with ClientSession() as http:
            async def ready_and_peered() -> bool:  # the peer available and the local replica probed healthy
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                return ('lb_peer_available{peer="far"} 1.0' in text
                        and any(line.startswith("lb_replica_healthy{") and line.endswith(" 1.0")
                                for line in text.splitlines()))
            for _ in range(200):
                if await ready_and_peered():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("near never saw far available")

            async def chat(model: str) -> str:
                async with http.post(url + "/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                    return r.headers["X-LB-Replica"]

            assert await chat("x") == x_url.split("//")[1]
            local_tp = await asyncio.to_thread(last_traceparent, x_url)
            assert await chat("m") == "peer:far"
            far_tp = await asyncio.to_thread(last_traceparent, m_url)
    finally:
        await runner.cleanup()

    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    requests = [s for s in by_name["lb.request"] if s.attributes.get("http.route") == "chat"]
    assert len(requests) == 2
    for req in requests:  # children of the client's span, in the client's trace
        assert f"{req.context.trace_id:032x}" == CLIENT_TRACE and f"{req.parent.span_id:016x}" == CLIENT_PARENT
        assert req.attributes["http.response.status_code"] == 200
    upstream, = by_name["lb.upstream"]
    forward, = by_name["lb.peer_forward"]
    assert len(by_name["lb.queue_wait"]) == 2
    for child in (upstream, forward, *by_name["lb.queue_wait"]):
        assert child.parent.span_id in {r.context.span_id for r in requests}
    # each replica saw the context of the attempt that reached it (far passes it on unchanged)
    assert local_tp == f"00-{CLIENT_TRACE}-{upstream.context.span_id:016x}-01"
    assert far_tp == f"00-{CLIENT_TRACE}-{forward.context.span_id:016x}-01"
    assert forward.attributes["lb.replica"] == "peer:far" and upstream.attributes["http.response.status_code"] == 200


def test_tracing_off_imports_no_opentelemetry(tmp_path: Path):
    cfg = tmp_path / "lb.toml"
    cfg.write_text('[[replicas]]\nurl = "http://127.0.0.1:9"\n')
    code = ("import asyncio, sys\nfrom aiohttp import web\nfrom lb.daemon.app import build_app\n"
            "from lb.daemon.config import load\n"
            "async def main():\n"
            f"    runner = web.AppRunner(build_app(load({str(cfg)!r})))\n"
            "    await runner.setup()  # the LB's parts (proxy, tracing hooks) are made at startup\n"
            "    await runner.cleanup()\n"
            "asyncio.run(main())\n"
            "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported while off'\nprint('clean')")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr
