"""Cross-region peering over three real `lb` processes (us, eu, asia), one emulator each.

Every LB runs SP-O with `max_outstanding = 1`, so one held streaming request makes a region
"full": what the tests control is exactly when local replicas are available. Peer probes
run every 50 ms; τ = 0 (a peer with anything queued takes no forwards). `forward =
"overflow"`: these tests are about SkyWalker's Algorithm 1 itself; forwarding by predicted
TTFT (the default) has its own, tests/daemon/test_peer_predicted.py.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lb.daemon.peer_links import STATUS_PATH, auth_headers
from tests.daemon.conftest import http_json, needs_emulator, start_emulator
from tests.procs import Proc, free_port, lb, metric, poll

pytestmark = [needs_emulator, pytest.mark.timeout(120)]

SECRET = "peer-test-secret"
INTERVAL = 0.05
REGIONS = ("us", "eu", "asia")
# us may send eu-tagged data only to eu; nobody sends tagged data to asia.
ALLOWED = {"eu": ["eu"], "us": ["us"], "asia": []}


class Region:
    def __init__(self, name: str, tmp: Path):
        self.name, self.tmp = name, tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.emu, self.emu_url = start_emulator("--seed", str(len(name)), name=f"emu-{name}")
        self.emu_id = self.emu_url.split("//")[1]
        self.proc: Proc | None = None

    def config(self, peers: list["Region"], adopt: bool) -> Path:
        lines = [f'[server]\nport = {self.port}\nadmin_token = "admin"\naccess_log = false\n',
                 '[pushing]\nmode = "sp-outstanding"\nmax_outstanding = 1\n',
                 f"[probes]\ninterval_s = {INTERVAL}\n",
                 f'[peering]\nregion = "{self.name}"\nprobe_interval_s = {INTERVAL}\nprobe_timeout_s = 0.2\n'
                 f'tau = 0\nadopt_after_s = 0.5\npolicy = "nearest"\nforward = "overflow"\n',
                 f'[[replicas]]\nurl = "{self.emu_url}"\nengine = "sglang"\nmodels = ["m"]\n']
        for p in peers:
            lines.append(f'[[peers]]\nregion = "{p.name}"\nurl = "{p.url}"\n'
                         f'allowed_residency = {json.dumps(ALLOWED[p.name])}\nadopt = {"true" if adopt else "false"}\n')
        path = self.tmp / f"{self.name}.toml"
        path.write_text("\n".join(lines))
        return path

    def start(self, peers: list["Region"], adopt: bool = False) -> None:
        cfg = self.config(peers, adopt)
        self.proc = Proc(lb("serve", "--config", str(cfg)), ready_url=self.url + "/ready", name=f"lb-{self.name}",
                         env={"LB_PEER_SECRET": SECRET})

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()
        self.emu.stop()

    def metric(self, name: str, **labels) -> float:
        return metric(self.url, name, **labels)

    def replicas(self) -> list[dict]:
        status, doc = http_json("GET", self.url + "/admin/replicas", headers={"Authorization": "Bearer admin"})
        assert status == 200, doc
        return doc["replicas"]

    def emu_running(self) -> int:
        with urllib.request.urlopen(self.emu_url + "/get_load", timeout=5) as r:
            return json.loads(r.read())[0]["num_reqs"]


def start_cluster(tmp: Path, adopt: bool = False) -> dict[str, Region]:
    regions = {n: Region(n, tmp) for n in REGIONS}
    try:
        for r in regions.values():
            r.start([p for p in regions.values() if p is not r], adopt=adopt)
        for r in regions.values():  # every LB sees both peers before a test starts
            poll(lambda r=r: all(r.metric("lb_peer_available", peer=p) == 1 for p in REGIONS if p != r.name),
                 what=f"{r.name} to see its peers")
    except BaseException:
        for r in regions.values():
            r.stop()
        raise
    return regions


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    regions = start_cluster(tmp_path_factory.mktemp("peers"))
    yield regions
    for r in regions.values():
        r.stop()


def body(max_tokens: int = 4, stream: bool = False, text: str = "hello") -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}


def signed_forward(doc: dict, secret: str = SECRET, **identity: str) -> dict:
    """The headers `us` would sign a forward of `doc` with (sent as json.dumps(doc))."""
    ident = {"x-lb-hop": "1", **identity}
    return {**ident, **auth_headers(secret, "us", "POST", "/v1/chat/completions",
                                    body=json.dumps(doc).encode(), identity=ident)}


def chat(url: str, headers: dict | None = None, timeout: float = 30.0, **kw) -> tuple[int, dict]:
    return http_json("POST", url + "/v1/chat/completions", body(**kw), headers=headers, timeout=timeout)


class Hold:
    """A long streaming request, open until released: it keeps one replica busy."""

    def __init__(self, region: Region, headers: dict | None = None):
        self.conn = http.client.HTTPConnection("127.0.0.1", region.port, timeout=30)
        self.conn.request("POST", "/v1/chat/completions", json.dumps(body(max_tokens=1500, stream=True)),
                          {"Content-Type": "application/json", **(headers or {})})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.replica = self.resp.getheader("X-LB-Replica")
        assert self.resp.readline().startswith(b"data:")  # the first token has arrived

    def release(self) -> None:
        if self.conn.sock is not None:
            self.conn.sock.close()
        self.conn.close()


def idle(region: Region) -> bool:
    return all(r["outstanding"] == 0 for r in region.replicas())


def settle(cluster: dict[str, Region]) -> None:
    """Every LB idle and seeing both peers available again (each test starts from rest)."""
    for r in cluster.values():
        poll(lambda r=r: idle(r) and r.metric("lb_queue_length") == 0, what=f"{r.name} idle")
    for r in cluster.values():
        poll(lambda r=r: all(r.metric("lb_peer_available", peer=p) == 1 for p in REGIONS if p != r.name),
             what=f"{r.name} peers available")


def test_forwards_only_when_every_local_replica_is_full(cluster):
    us = cluster["us"]
    settle(cluster)
    for _ in range(3):
        status, doc = chat(us.url)
        assert status == 200 and doc["_headers"]["X-LB-Replica"] == us.emu_id
    assert us.metric("lb_peer_forwards_total") == 0
    hold = Hold(us)
    assert hold.replica == us.emu_id
    try:
        status, doc = chat(us.url)
        assert status == 200, doc
        assert doc["_headers"]["X-LB-Replica"] in ("peer:eu", "peer:asia")
        assert us.metric("lb_peer_forwards_total", outcome="ok") == 1
    finally:
        hold.release()
    poll(lambda: idle(us), what="us idle")
    status, doc = chat(us.url)
    assert doc["_headers"]["X-LB-Replica"] == us.emu_id


def test_a_forwarded_request_is_placed_locally_never_forwarded_again(cluster):
    us, eu, asia = cluster["us"], cluster["eu"], cluster["asia"]
    settle(cluster)
    eu_forwards = eu.metric("lb_peer_forwards_total")
    hold = Hold(eu)
    try:
        # A forward signed as from us arrives at a full eu while asia is free: eu must queue it.
        headers = signed_forward(body())
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(http_json, "POST", eu.url + "/v1/chat/completions", json.dumps(body()).encode(), headers)
            poll(lambda: eu.metric("lb_queue_length") == 1, what="the forward to wait in eu's queue")
            assert eu.metric("lb_peer_available", peer="asia") == 1
            assert not fut.done()
            hold.release()
            status, doc = fut.result(timeout=30)
        assert status == 200 and doc["_headers"]["X-LB-Replica"] == eu.emu_id
        assert eu.metric("lb_peer_forwards_total") == eu_forwards
    finally:
        hold.release()

    # A burst at a full us: each forward crosses exactly one LB.
    settle(cluster)
    sent = us.metric("lb_peer_forwards_total")
    received = eu.metric("lb_peer_received_total") + asia.metric("lb_peer_received_total")
    others = eu.metric("lb_peer_forwards_total") + asia.metric("lb_peer_forwards_total")
    hold = Hold(us)
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: chat(us.url), range(6)))
    finally:
        hold.release()
    assert all(s == 200 for s, _ in results)
    forwarded = us.metric("lb_peer_forwards_total") - sent
    assert forwarded >= 1
    assert eu.metric("lb_peer_received_total") + asia.metric("lb_peer_received_total") - received == forwarded
    assert eu.metric("lb_peer_forwards_total") + asia.metric("lb_peer_forwards_total") == others


def test_residency_rules_hold_and_are_counted(cluster):
    us, eu = cluster["us"], cluster["eu"]
    settle(cluster)
    tagged = {"x-lb-residency": "eu"}
    hold_us, hold_eu = Hold(us), Hold(eu)
    try:
        poll(lambda: us.metric("lb_peer_available", peer="eu") == 0, what="us to see eu full")
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(chat, us.url, tagged)
            # asia is free but may not hold eu data: the request waits at home.
            poll(lambda: us.metric("lb_peer_residency_blocked_total", peer="asia", residency="eu") >= 1,
                 what="the residency block to be counted")
            assert us.metric("lb_queue_length") == 1 and not fut.done()
            status, doc = chat(us.url)  # untagged traffic may go to asia
            assert status == 200 and doc["_headers"]["X-LB-Replica"] == "peer:asia"
            hold_us.release()
            status, doc = fut.result(timeout=30)
        assert status == 200 and doc["_headers"]["X-LB-Replica"] == us.emu_id
        assert us.metric("lb_peer_residency_blocked_total", peer="eu") == 0
    finally:
        hold_us.release()
        hold_eu.release()
    settle(cluster)
    hold_us = Hold(us)
    try:  # eu free again: eu-tagged data may go there
        status, doc = chat(us.url, tagged)
        assert status == 200 and doc["_headers"]["X-LB-Replica"] == "peer:eu"
    finally:
        hold_us.release()


def test_unauthenticated_peer_calls_are_rejected(cluster):
    eu = cluster["eu"]
    status, doc = http_json("GET", eu.url + STATUS_PATH)
    assert status == 401 and doc["error"]["code"] == "invalid_peer_auth"
    bad = auth_headers("wrong-secret", "us", "GET", STATUS_PATH)
    assert http_json("GET", eu.url + STATUS_PATH, headers=bad)[0] == 401
    stale = auth_headers(SECRET, "us", "GET", STATUS_PATH, now_wall=time.time() - 3600)
    assert http_json("GET", eu.url + STATUS_PATH, headers=stale)[0] == 401
    status, doc = http_json("GET", eu.url + STATUS_PATH, headers=auth_headers(SECRET, "us", "GET", STATUS_PATH))
    assert status == 200 and doc["region"] == "eu" and doc["models"] == ["m"]
    # a forward with a forged signature is refused, not served
    forged = signed_forward(body(), secret="wrong-secret")
    status, doc = chat(eu.url, forged)
    assert status == 401 and doc["error"]["type"] == "authentication_error"
    assert eu.metric("lb_peer_auth_failures_total", endpoint="forward") >= 1


def test_a_captured_peer_call_cannot_be_replayed_rebodied_or_relabelled(cluster):
    """Issue 13 case 6: the signature covers a nonce, the body and the identity headers."""
    eu = cluster["eu"]
    settle(cluster)
    url, raw = eu.url + "/v1/chat/completions", json.dumps(body()).encode()
    captured = signed_forward(body(), **{"x-lb-user": "alice"})
    status, doc = http_json("POST", url, raw, captured)
    assert status == 200, doc  # the original call
    status, doc = http_json("POST", url, raw, captured)  # the same bytes again: a replay
    assert status == 401 and "nonce already used" in doc["error"]["message"], doc
    fresh = signed_forward(body(), **{"x-lb-user": "alice"})
    status, doc = http_json("POST", url, json.dumps(body(max_tokens=400)).encode(), fresh)  # another body
    assert status == 401 and "signature" in doc["error"]["message"], doc
    fresh = signed_forward(body(), **{"x-lb-user": "alice"})
    status, doc = http_json("POST", url, raw, {**fresh, "x-lb-user": "mallory"})  # another identity
    assert status == 401, doc
    for ts in ("nan", "inf", "-inf", "1e999"):  # never within the skew window
        bad = {**signed_forward(body()), "x-lb-peer-ts": ts}
        status, doc = http_json("POST", url, raw, bad)
        assert status == 401 and "finite" in doc["error"]["message"], (ts, doc)


def test_a_client_cannot_pose_as_a_peer(cluster):
    """Hop and peer headers without a signature do not make an LB skip forwarding: a client's request."""
    us = cluster["us"]
    settle(cluster)
    hold = Hold(us)
    try:
        status, doc = chat(us.url, {"x-lb-hop": "1", "x-lb-peer-region": "eu"})
        assert status == 200 and doc["_headers"]["X-LB-Replica"].startswith("peer:")
    finally:
        hold.release()


def test_cancellation_propagates_across_both_hops(cluster):
    us = cluster["us"]
    settle(cluster)
    hold = Hold(us)
    try:
        forwarded = Hold(us)  # streams from a peer's replica through two LBs
        peer = cluster[forwarded.replica.split(":", 1)[1]]
        assert peer.emu_running() == 1
        cancelled_before = peer.metric("lb_client_cancellations_total")
        forwarded.release()
        poll(lambda: peer.emu_running() == 0, what=f"{peer.name}'s replica to abort the request")
        poll(lambda: peer.metric("lb_client_cancellations_total") > cancelled_before,
             what=f"{peer.name}'s LB to see the cancellation")
    finally:
        hold.release()


def test_dead_peer_is_avoided_then_its_replicas_adopted_and_given_back(tmp_path):
    cluster = start_cluster(tmp_path, adopt=True)
    us, eu, asia = cluster["us"], cluster["eu"], cluster["asia"]
    try:
        killed_at = time.monotonic()
        eu.proc.kill()
        poll(lambda: us.metric("lb_peer_available", peer="eu") == 0, what="us to drop eu")
        noticed = time.monotonic() - killed_at
        # 3 probe intervals is the bound; scraping /metrics on a loaded 2-core box adds the rest
        assert noticed < 3 * INTERVAL + 1.0, noticed
        hold = Hold(us)
        try:  # us is full, eu is dead: nothing hangs, everything goes to asia
            with ThreadPoolExecutor(3) as pool:
                results = list(pool.map(lambda _: chat(us.url, timeout=20), range(3)))
            assert [s for s, _ in results] == [200] * 3
            assert {d["_headers"]["X-LB-Replica"] for _, d in results} <= {"peer:asia", us.emu_id}
        finally:
            hold.release()
        # after the grace period us adopts eu's replica and serves on it
        poll(lambda: any(r["id"] == f"eu@{eu.emu_id}" and r["healthy"] for r in us.replicas()),
             what="us to adopt eu's replica")
        holds = [Hold(us), Hold(us)]  # local first: its own replica and the adopted one
        try:
            assert {h.replica for h in holds} == {us.emu_id, f"eu@{eu.emu_id}"}
        finally:
            for h in holds:
                h.release()
        # eu comes back on its address: us gives the replica back
        eu.start([us, asia], adopt=True)
        poll(lambda: not any(r["id"].startswith("eu@") for r in us.replicas()), what="us to give eu's replica back")
        assert us.metric("lb_peer_adopted_replicas", peer="eu") == 0
        poll(lambda: us.metric("lb_peer_available", peer="eu") == 1, what="eu to rejoin")
    finally:
        for r in cluster.values():
            r.stop()
