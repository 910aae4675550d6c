"""Peering over a real intercontinental link: 150 ms each way through bench/delay_proxy.

`near` serves model `x` only, so a request for `m` can only go to its peer `far`, which is
reached through the delay proxy (a 300 ms round trip, 450 ms for a new connection). With
probe timeouts derived from the measured RTT (lb.core.peering.probe_timeout) `near` sees
`far` as available and forwards to it; `fixed`, the same LB with the old fixed 0.1 s
timeout (floor = cap = 0.1 s), probes the same link in the same run and never does.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon.conftest import http_json, needs_emulator, start_emulator
from tests.procs import PYTHON, Proc, free_port, lb, metric, poll

pytestmark = [needs_emulator, pytest.mark.timeout(90)]

SECRET = "link-test-secret"
ONE_WAY_MS = 150


def _lb(tmp: Path, name: str, replica: str, model: str, peering: str = "", peers: str = "") -> tuple[Proc, str]:
    port = free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f'[server]\nport = {port}\naccess_log = false\n\n'
                   f'[peering]\nregion = "{name}"\n{peering}\n'
                   f'[[replicas]]\nurl = "{replica}"\nengine = "sglang"\nmodels = ["{model}"]\n\n{peers}')
    url = f"http://127.0.0.1:{port}"
    return Proc(lb("serve", "--config", str(cfg)), ready_url=url + "/ready", name=f"lb-{name}",
                env={"LB_PEER_SECRET": SECRET}), url


def test_a_peer_150ms_away_is_available_and_takes_forwards(tmp_path: Path, procs):
    for model, name in (("m", "emu-far"), ("x", "emu-near")):
        emu, url = start_emulator(model=model, name=name)
        procs.append(emu)
        if model == "m":
            far_emu = url
        else:
            near_emu = url
    far, far_url = _lb(tmp_path, "far", far_emu, "m")
    procs.append(far)
    link, health = free_port(), free_port()
    procs.append(Proc([PYTHON, "-m", "bench.delay_proxy", "--health-port", str(health), "--route",
                       f"{link}=127.0.0.1:{far_url.rsplit(':', 1)[1]}@{ONE_WAY_MS}"],
                      ready_url=f"http://127.0.0.1:{health}/", name="wan"))
    peer = f'[[peers]]\nregion = "far"\nurl = "http://127.0.0.1:{link}"\n'
    near, near_url = _lb(tmp_path, "near", near_emu, "x", peers=peer)  # default peering: RTT-derived timeouts
    procs.append(near)
    fixed, fixed_url = _lb(tmp_path, "fixed", near_emu, "x", peers=peer,
                           peering="probe_timeout_s = 0.1\nprobe_timeout_max_s = 0.1\n")
    procs.append(fixed)

    poll(lambda: metric(near_url, "lb_peer_available", peer="far") == 1, timeout=30, what="near to see far available")
    rtt = metric(near_url, "lb_peer_rtt_seconds", peer="far")
    assert rtt >= 2 * ONE_WAY_MS / 1000  # the link really is that slow

    status, doc = http_json("POST", near_url + "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=30)
    assert status == 200, doc
    assert doc["_headers"].get("X-LB-Replica") == "peer:far"
    assert metric(near_url, "lb_peer_forwards_total", peer="far", outcome="ok") == 1
    assert metric(far_url, "lb_peer_received_total", peer="near") == 1

    # the same link, probed at least as long, with a timeout fixed below its round trip
    assert metric(fixed_url, "lb_peer_available", peer="far") == 0
    assert metric(fixed_url, "lb_peer_rtt_seconds", peer="far") != metric(fixed_url, "lb_peer_rtt_seconds", peer="far")  # NaN: never answered in time
