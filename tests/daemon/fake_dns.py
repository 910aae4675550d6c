"""A tiny authoritative DNS server on loopback UDP (dnslib) whose records a test rewrites.

    python tests/daemon/fake_dns.py PORT ZONE.json

ZONE.json is re-read at every query: {"name.": [{"type": "SRV", "port": 8000, "target": "a.",
"glue": "127.0.0.1"}, {"type": "A", "address": "127.0.0.1"}], "_servfail": false}. An SRV
record with "glue" carries the target's A record in the additional section (as CoreDNS does
for headless services); without it the client must look the target up. A name not in the
zone is NXDOMAIN; "_servfail": true answers SERVFAIL to everything. Each query appends its
name and type to ZONE.json.log, so a test can wait for lookups without sleeping.
"""
from __future__ import annotations

import json
import sys
import threading

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A
from dnslib.server import BaseResolver, DNSServer


class ZoneResolver(BaseResolver):
    def __init__(self, path: str):
        self.path = path
        self.lock = threading.Lock()

    def resolve(self, request, handler):
        reply = request.reply()
        qname, qtype = str(request.q.qname), QTYPE[request.q.qtype]
        with self.lock, open(self.path + ".log", "a") as log:
            log.write(f"{qname} {qtype}\n")
        with open(self.path) as f:
            zone = json.load(f)
        if zone.get("_servfail"):
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        if qname not in zone:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        for rec in zone[qname]:
            if rec["type"] != qtype:
                continue
            if qtype == "SRV":
                reply.add_answer(RR(qname, QTYPE.SRV, ttl=5, rdata=SRV(10, 10, rec["port"], rec["target"])))
                if rec.get("glue"):
                    reply.add_ar(RR(rec["target"], QTYPE.A, ttl=5, rdata=A(rec["glue"])))
            elif qtype == "A":
                reply.add_answer(RR(qname, QTYPE.A, ttl=5, rdata=A(rec["address"])))
            elif qtype == "AAAA":
                reply.add_answer(RR(qname, QTYPE.AAAA, ttl=5, rdata=AAAA(rec["address"])))
        return reply  # no matching type: NOERROR with no answer


def main() -> None:
    port, path = int(sys.argv[1]), sys.argv[2]
    server = DNSServer(ZoneResolver(path), address="127.0.0.1", port=port, logger=_Quiet())
    server.start()  # serves in this thread until killed


class _Quiet:
    def __getattr__(self, name):
        return lambda *a, **k: None


if __name__ == "__main__":
    main()
