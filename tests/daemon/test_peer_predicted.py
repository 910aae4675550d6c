"""Forwarding by predicted TTFT over two real `lb` processes (us, eu), one L4 emulator each.

Both LBs run the default SP-P pushing: a replica with KV room stays available, so SkyWalker's
Algorithm 1 alone never forwards while us's replica takes requests. What changes with
`[peering] forward = "predicted"` (the default): once us's replica holds seconds of prefill
work, a request us's replica would take goes to eu, whose advert (`ttft` in
`/lb/peer/status`) says it would start at once. Each LB first learns its own prediction
from streamed first tokens (lb.core.backlog needs 20).
"""
from __future__ import annotations

import http.client
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.tokenizer import filler_text
from lb.daemon.peer_links import STATUS_PATH, auth_headers
from tests.daemon.conftest import http_json, needs_emulator, start_emulator
from tests.procs import Proc, free_port, lb, metric, poll

pytestmark = [needs_emulator, pytest.mark.timeout(120)]

SECRET = "predicted-test-secret"
SPEED = "4"  # L4 timing 4x faster: 0.12 ms of prefill per token, 14 ms steps


class Region:
    def __init__(self, name: str, tmp: Path):
        self.name, self.tmp = name, tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.emu, self.emu_url = start_emulator("--speed", SPEED, profile="l4-llama3-8b", name=f"emu-{name}")
        self.emu_id = self.emu_url.split("//")[1]
        self.proc: Proc | None = None

    def start(self, peer: "Region", allowed: list[str]) -> None:
        cfg = self.tmp / f"{self.name}.toml"
        cfg.write_text(f'[server]\nport = {self.port}\naccess_log = false\n\n'
                       f'[probes]\ninterval_s = 0.05\n\n'
                       f'[peering]\nregion = "{self.name}"\nprobe_interval_s = 0.05\n\n'
                       f'[[replicas]]\nurl = "{self.emu_url}"\nengine = "sglang"\nmodels = ["m"]\n\n'
                       f'[[peers]]\nregion = "{peer.name}"\nurl = "{peer.url}"\nallowed_residency = {json.dumps(allowed)}\n')
        self.proc = Proc(lb("serve", "--config", str(cfg)), ready_url=self.url + "/ready", name=f"lb-{self.name}",
                         env={"LB_PEER_SECRET": SECRET})

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()
        self.emu.stop()

    def metric(self, name: str, **labels) -> float:
        return metric(self.url, name, **labels)

    def emu_requests(self) -> int:
        with urllib.request.urlopen(self.emu_url + "/get_load", timeout=5) as r:
            return json.loads(r.read())[0]["num_reqs"]




def stream(region: Region, tokens: int, salt: int, max_tokens: int = 2, headers: dict | None = None) -> str:
    """A streamed chat request, read to its end; the replica (or peer) that served it."""
    conn = http.client.HTTPConnection("127.0.0.1", region.port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": "m", "messages": [{"role": "user", "content": filler_text(tokens, salt)}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}), {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200 and b"data:" in data, data[:300]
        return resp.getheader("X-LB-Replica")
    finally:
        conn.close()


def warm(region: Region) -> None:
    """First tokens at different amounts of work ahead: what the prediction is fitted on (once
    a fit exists the LB may already forward some of these: each side serves what either sends)."""
    with ThreadPoolExecutor(4) as pool:
        for batch in range(7):
            list(pool.map(lambda i: stream(region, 200 + 400 * i, 1000 * batch + i), range(4)))


def advert(region: Region) -> dict:
    status, doc = http_json("GET", region.url + STATUS_PATH,
                            headers=auth_headers(SECRET, "test", "GET", STATUS_PATH))
    assert status == 200, doc
    return doc.get("ttft", {})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("predicted")
    us, eu = Region("us", tmp), Region("eu", tmp)
    try:
        us.start(eu, allowed=["eu"])  # eu may hold eu-tagged data (and untagged)
        eu.start(us, allowed=["us"])
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(warm, (us, eu)))
        poll(lambda: advert(eu).get("m") and advert(us).get("m"), what="both LBs to advertise a prediction")
        yield us, eu
    finally:
        us.stop()
        eu.stop()


def busy(region: Region, n: int = 6, tokens: int = 3000):
    """`n` long prompts streaming from `region`'s own replica (seconds of prefill ahead there),
    all pushed before this returns; the pool ends when they are answered. They carry the
    region's own residency tag, which its peer may not hold: otherwise, once the first few
    made the replica busy, the rest would rightly go to the peer."""
    pool = ThreadPoolExecutor(n)
    tag = {"x-lb-residency": region.name}
    futures = [pool.submit(stream, region, tokens, 90_000 + i, headers=tag) for i in range(n)]
    poll(lambda: region.emu_requests() >= n, what=f"{region.name}'s replica to hold the long prompts")
    return pool, futures


def test_advert_carries_the_fit_and_the_work_ahead(pair):
    us, eu = pair
    ad = advert(eu)["m"]
    assert ad["per_token_s"] > 0 and ad["base_s"] >= 0 and ad["error_s"] >= 0
    assert ad["ahead"] == [0]  # one replica, nothing in prefill there now


def test_a_request_goes_where_it_starts_sooner_not_only_when_home_is_full(pair):
    us, eu = pair
    before = us.metric("lb_peer_forwards_total", peer="eu", outcome="ok")
    received = eu.metric("lb_peer_received_total", peer="us")
    eu_forwards = eu.metric("lb_peer_forwards_total")  # warming up, eu may have sent some of its own
    faster = us.metric("lb_routing_decisions_total", reason="peer-faster")
    # its prompt cached at home first (the replica is idle: it stays), so only a sooner start
    # may move it, not the lighter load of a peer (which moves only work new to this region)
    assert stream(us, 100, 1) == us.emu_id
    pool, futures = busy(us)
    try:
        # us's replica still takes requests (SP-P: KV room, nothing waiting), yet this one
        # would wait for ~18k tokens of prefill there: eu starts it sooner
        assert stream(us, 100, 1) == "peer:eu"
        # a tag eu may not hold stays home, however long it waits
        assert stream(us, 100, 2, headers={"x-lb-residency": "us"}) == us.emu_id
    finally:
        assert all(f.result(timeout=60) == us.emu_id for f in futures)  # the long prompts stayed home
        pool.shutdown()
    assert us.metric("lb_peer_forwards_total", peer="eu", outcome="ok") == before + 1
    # the decision says why: a local replica would have taken it, the peer was predicted faster
    assert us.metric("lb_routing_decisions_total", reason="peer-faster") == faster + 1
    assert eu.metric("lb_peer_received_total", peer="us") == received + 1
    assert eu.metric("lb_peer_forwards_total") == eu_forwards  # a forwarded request is never forwarded again


def test_an_idle_home_keeps_its_requests_even_when_the_peer_is_idle_too(pair):
    us, eu = pair
    poll(lambda: advert(us)["m"]["ahead"] == [0], what="us idle again")
    before = us.metric("lb_peer_forwards_total")
    for i in range(3):
        assert stream(us, 100, 10 + i) == us.emu_id  # within the predictions' error: no reason to cross
    pool, futures = busy(eu)
    try:
        assert stream(us, 100, 20) == us.emu_id  # the busy one is eu: us's request stays home
    finally:
        assert all(f.result(timeout=60) == eu.emu_id for f in futures)
        pool.shutdown()
    assert us.metric("lb_peer_forwards_total") == before


def test_new_work_goes_to_the_peer_whose_replica_runs_far_fewer(pair):
    """us's replica decodes 8 long answers (short prompts: nothing much to prefill, so no
    TTFT says leave); eu's runs none. A request with nothing cached at us starts its work in
    eu (`lighter_peer`), and the status it decided on carries eu's replica loads."""
    us, eu = pair
    poll(lambda: advert(eu)["m"].get("load") == [0], what="eu idle, advertising its replica's load")
    lighter = us.metric("lb_routing_decisions_total", reason="peer-lighter")
    tag = {"x-lb-residency": "us"}  # eu may not hold these: they stay and fill us's batch
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(stream, us, 50, 70_000 + i, 400, tag) for i in range(8)]
        try:
            poll(lambda: us.emu_requests() >= 8, what="us's replica to run the long answers")
            poll(lambda: us.metric("lb_replica_running", replica=us.emu_id) >= 8, what="us's probe to count them")
            assert stream(us, 100, 77_001) == "peer:eu"
        finally:
            assert all(f.result(timeout=60) == us.emu_id for f in futures)
    assert us.metric("lb_routing_decisions_total", reason="peer-lighter") == lighter + 1
