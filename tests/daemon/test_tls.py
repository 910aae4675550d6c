"""TLS on loopback, with certificates the test makes (openssl CLI) and real processes:

- lb serves HTTPS; its replica is an emulator serving HTTPS that requires a client
  certificate, reached with [upstream] tls_ca_file/tls_client_cert; SIGHUP after the
  certificate files were rewritten: new connections get the new certificate.
- mTLS between peer LBs: `far` requires client certificates from the test CA; `near` reaches
  it with [peering] tls_* and forwards; a client without a certificate fails the handshake.
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import urllib.request
from pathlib import Path

import pytest

from tests.daemon.conftest import needs_emulator
from lb.daemon.config import ConfigError, load
from tests.procs import Proc, free_port, lb, lb_bench, poll
from tests.tls_certs import CertAuthority, needs_openssl

pytestmark = [needs_emulator, needs_openssl, pytest.mark.timeout(90)]

SECRET = "tls-peer-secret"


def https_json(url: str, ctx: ssl.SSLContext, body: dict | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20, context=ctx) as r:
        return r.status, json.loads(r.read()), dict(r.headers)


def chat(model: str = "m") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def served_cert_cn(port: int, ctx: ssl.SSLContext) -> str:
    """The common name of the certificate a new connection to 127.0.0.1:port is given."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        return dict(x[0] for x in s.getpeercert()["subject"])["commonName"]


def wait_https(url: str, ctx: ssl.SSLContext, proc: Proc) -> None:
    def up() -> bool:
        assert proc.popen.poll() is None, proc.log()
        try:
            with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
                return r.status == 200
        except OSError:
            return False
    poll(up, timeout=20, what=url)


def start_emulator_tls(ca: CertAuthority, model: str) -> tuple[Proc, str]:
    srv = ca.issue(f"emu-{model}")
    port = free_port()
    proc = Proc(lb_bench("emulate", "--port", str(port), "--profile", "tiny", "--model", model,
                         "--tls-cert", srv.cert, "--tls-key", srv.key, "--tls-client-ca", ca.cert), name="emu-tls")
    client = ca.issue("probe-client")
    ctx = ssl.create_default_context(cafile=ca.cert)
    ctx.load_cert_chain(client.cert, client.key)
    wait_https(f"https://127.0.0.1:{port}/health", ctx, proc)
    return proc, f"https://127.0.0.1:{port}"


def start_lb_tls(tmp: Path, name: str, toml: str) -> tuple[Proc, int]:
    port = free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f"[server]\nport = {port}\naccess_log = false\n{toml}")
    return Proc(lb("serve", "--config", str(cfg)), name=f"lb-{name}", env={"LB_PEER_SECRET": SECRET}), port


def test_https_listener_https_replica_with_client_cert_and_cert_reload(tmp_path: Path, procs):
    ca = CertAuthority(tmp_path / "pki")
    emu, emu_url = start_emulator_tls(ca, "m")
    procs.append(emu)
    first, lb_client = ca.issue("lb-first"), ca.issue("lb-client")
    cert, key = tmp_path / "live.pem", tmp_path / "live.key"  # the paths a renewal rewrites
    shutil.copy(first.cert, cert)
    shutil.copy(first.key, key)
    proc, port = start_lb_tls(tmp_path, "lb", f'tls_cert = "{cert}"\ntls_key = "{key}"\n\n'
                              f'[upstream]\ntls_ca_file = "{ca.cert}"\ntls_client_cert = "{lb_client.cert}"\n'
                              f'tls_client_key = "{lb_client.key}"\n\n'
                              f'[[replicas]]\nurl = "{emu_url}"\nengine = "sglang"\nmodels = ["m"]\n')
    procs.append(proc)
    trust = ssl.create_default_context(cafile=ca.cert)
    url = f"https://127.0.0.1:{port}"
    wait_https(url + "/ready", trust, proc)  # ready: its probe reached the mTLS replica

    status, doc, headers = https_json(url + "/v1/chat/completions", trust, chat())
    assert status == 200 and doc["choices"][0]["message"]["content"], doc
    assert headers.get("X-LB-Replica") == emu_url.split("//")[1]
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not a CA the client trusts
        urllib.request.urlopen(url + "/health", timeout=5, context=ssl.create_default_context())
    with pytest.raises(OSError):  # the replica really demands a client certificate
        urllib.request.urlopen(emu_url + "/health", timeout=5, context=trust)

    assert served_cert_cn(port, trust) == "lb-first"
    second = ca.issue("lb-second")
    shutil.copy(second.cert, cert)
    shutil.copy(second.key, key)
    proc.signal(signal.SIGHUP)
    poll(lambda: served_cert_cn(port, trust) == "lb-second", timeout=10, what="the new certificate after SIGHUP")
    status, _, _ = https_json(url + "/v1/chat/completions", trust, chat())
    assert status == 200


def test_peer_lbs_over_mutual_tls(tmp_path: Path, procs):
    ca = CertAuthority(tmp_path / "pki")
    emu, emu_url = start_emulator_tls(ca, "m")
    procs.append(emu)
    other, other_url = start_emulator_tls(ca, "x")
    procs.append(other)
    far_srv, near_srv, near_client = ca.issue("far"), ca.issue("near"), ca.issue("near-client")
    upstream = f'[upstream]\ntls_ca_file = "{ca.cert}"\ntls_client_cert = "{near_client.cert}"\n' \
               f'tls_client_key = "{near_client.key}"\n'
    far, far_port = start_lb_tls(tmp_path, "far", f'tls_cert = "{far_srv.cert}"\ntls_key = "{far_srv.key}"\n'
                                 f'tls_client_ca = "{ca.cert}"\n\n{upstream}\n[peering]\nregion = "far"\n\n'
                                 f'[[replicas]]\nurl = "{emu_url}"\nengine = "sglang"\nmodels = ["m"]\n')
    procs.append(far)
    near, near_port = start_lb_tls(tmp_path, "near", f'tls_cert = "{near_srv.cert}"\ntls_key = "{near_srv.key}"\n\n'
                                   f'{upstream}\n[peering]\nregion = "near"\ntls_ca_file = "{ca.cert}"\n'
                                   f'tls_client_cert = "{near_client.cert}"\ntls_client_key = "{near_client.key}"\n\n'
                                   f'[[replicas]]\nurl = "{other_url}"\nengine = "sglang"\nmodels = ["x"]\n\n'
                                   f'[[peers]]\nregion = "far"\nurl = "https://127.0.0.1:{far_port}"\n')
    procs.append(near)
    trust = ssl.create_default_context(cafile=ca.cert)
    with_cert = ssl.create_default_context(cafile=ca.cert)
    with_cert.load_cert_chain(near_client.cert, near_client.key)
    wait_https(f"https://127.0.0.1:{far_port}/ready", with_cert, far)
    near_url = f"https://127.0.0.1:{near_port}"
    wait_https(near_url + "/ready", trust, near)

    with pytest.raises(OSError):  # far takes no connection without a client certificate
        urllib.request.urlopen(f"https://127.0.0.1:{far_port}/health", timeout=5, context=trust)
    scrape = urllib.request.build_opener(urllib.request.HTTPSHandler(context=trust))
    poll(lambda: b'lb_peer_available{peer="far"} 1.0' in scrape.open(near_url + "/metrics", timeout=5).read(),
         what="near to see far over mTLS")
    status, doc, headers = https_json(near_url + "/v1/chat/completions", trust, chat("m"))
    assert status == 200, doc
    assert headers.get("X-LB-Replica") == "peer:far"


@pytest.mark.parametrize("toml, key", [
    ('[server]\ntls_key = "k.pem"\n', "server.tls_key"),
    ('[server]\ntls_cert = "/nonexistent/c.pem"\n', "server.tls_cert"),
    ('[upstream]\ntls_ca_file = "/nonexistent/ca.pem"\n', "upstream.tls_ca_file"),
    ('[peering]\ntls_client_key = "k.pem"\n', "peering.tls_client_key"),
])
def test_tls_config_errors_name_the_key(tmp_path: Path, toml: str, key: str):
    path = tmp_path / "lb.toml"
    path.write_text(toml + '\n[[replicas]]\nurl = "http://127.0.0.1:9"\n')
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load(str(path))
