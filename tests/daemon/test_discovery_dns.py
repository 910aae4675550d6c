"""DNS discovery (SRV and A records, as a headless Service or Consul serves them) against a
real DNS server on loopback UDP, with real emulator replicas behind the records."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.daemon.conftest import needs_emulator, start_emulator, start_lb
from tests.daemon.test_reload_admin import finish, open_stream, replicas
from tests.procs import PYTHON, Proc, free_port, lb_bench, metric, poll

pytest.importorskip("dns.asyncresolver", reason="the dns extra: pip install 'lb[dns]'")
pytest.importorskip("dnslib", reason="the test extra: pip install 'lb[test]'")
pytestmark = needs_emulator
HERE = Path(__file__).parent
SRV_NAME = "_http._tcp.sglang.inference.svc.cluster.local."


class FakeDNS:
    def __init__(self, tmp_path: Path, zone: dict):
        self.port = free_port()
        self.zone = tmp_path / "zone.json"
        self.set(zone)
        self.proc = Proc([PYTHON, str(HERE / "fake_dns.py"), str(self.port), str(self.zone)], name="fake-dns")
        import dns.exception
        import dns.resolver

        r = dns.resolver.Resolver(configure=False)
        r.nameservers, r.port, r.lifetime = ["127.0.0.1"], self.port, 0.5

        def answers() -> bool:
            try:
                r.resolve(SRV_NAME, "SRV")
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                pass  # an answer all the same
            except dns.exception.DNSException:
                return False
            return True
        poll(answers, what="the DNS server to answer")

    def set(self, zone: dict) -> None:
        tmp = self.zone.with_suffix(".tmp")
        tmp.write_text(json.dumps(zone))
        tmp.replace(self.zone)

    def queries(self) -> int:
        log = Path(str(self.zone) + ".log")
        return len(log.read_text().splitlines()) if log.exists() else 0


def key(url: str) -> str:
    return url.split("//")[1]


def srv(url: str, glue: bool) -> tuple[dict, str]:
    host, port = url.split("//")[1].rsplit(":", 1)
    target = f"pod-{port}.sglang.inference.svc.cluster.local."
    return {"type": "SRV", "port": int(port), "target": target, **({"glue": host} if glue else {})}, target


def test_srv_records_followed_drained_kept_on_servfail_emptied_on_nxdomain(tmp_path, procs):
    emus = []
    for i in range(2):
        p, url = start_emulator("--speed", "2", name=f"emu{i}")
        procs.append(p)
        emus.append(url)
    a, b = emus
    rec_a, _ = srv(a, glue=True)  # the target's address rides in the additional section
    rec_b, target_b = srv(b, glue=False)  # the target needs its own A lookup
    dns = FakeDNS(tmp_path, {SRV_NAME: [rec_a, rec_b], target_b: [{"type": "A", "address": "127.0.0.1"}]})
    procs.append(dns.proc)
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f'[[discovery]]\nkind = "dns"\nname = "{SRV_NAME}"\nnameservers = ["127.0.0.1:{dns.port}"]\n'
                   f'interval_s = 0.2\nengine = "sglang"\nmodels = ["m"]\n')
    d = start_lb(config=cfg)
    procs.append(d.proc)
    poll(lambda: {k for k, r in replicas(d).items() if r["healthy"]} == {key(a), key(b)}, what="both found, healthy")
    assert {r["source"] for r in replicas(d).values()} == {"discovery[0]"}

    # A record goes away while a request is in flight on it: drained, the request completes.
    conn, resp = open_stream(d)
    target = resp.getheader("X-LB-Replica")
    keep = rec_b if target == key(a) else rec_a
    dns.set({SRV_NAME: [keep], target_b: [{"type": "A", "address": "127.0.0.1"}]})
    poll(lambda: replicas(d).get(target, {}).get("draining"), what="the dropped record's replica draining")
    finish(resp)
    conn.close()
    poll(lambda: target not in replicas(d), what="the drained replica to go")

    # The resolver fails (SERVFAIL): lookups go on, the current replicas stay.
    left = set(replicas(d))
    dns.set({"_servfail": True})
    seen = dns.queries()
    poll(lambda: dns.queries() >= seen + 5, what="lookups during the outage")
    assert set(replicas(d)) == left
    assert metric(d.url, "lb_discovery_errors_total", source="discovery[0]", kind="dns") >= 1
    assert metric(d.url, "lb_discovery_replicas", source="discovery[0]", kind="dns") == len(left)
    # The name is gone (NXDOMAIN): nothing left to serve.
    dns.set({})
    poll(lambda: not replicas(d), what="NXDOMAIN to empty the set")


def test_a_records_with_the_configured_port(tmp_path, procs):
    port = free_port()
    for host in ("127.0.0.1", "127.0.0.2"):  # one port, two addresses: as a headless Service's pods
        procs.append(Proc(lb_bench("emulate", "--host", host, "--port", str(port), "--profile", "tiny", "--model", "m"),
                          ready_url=f"http://{host}:{port}/health", name=f"emu-{host}"))
    name = "sglang.inference.svc.cluster.local."
    dns = FakeDNS(tmp_path, {SRV_NAME: [], name: [{"type": "A", "address": "127.0.0.1"},
                                                   {"type": "A", "address": "127.0.0.2"}]})
    procs.append(dns.proc)
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f'[[discovery]]\nkind = "dns"\nname = "{name}"\nrecord = "A"\nport = "{port}"\n'
                   f'nameservers = ["127.0.0.1:{dns.port}"]\ninterval_s = 0.2\nengine = "sglang"\n')
    d = start_lb(config=cfg)
    procs.append(d.proc)
    want = {f"127.0.0.1:{port}", f"127.0.0.2:{port}"}
    poll(lambda: {k for k, r in replicas(d).items() if r["healthy"]} == want, what="both addresses healthy")
    assert all(r["models"] == ["m"] for r in replicas(d).values())  # read from /v1/models
