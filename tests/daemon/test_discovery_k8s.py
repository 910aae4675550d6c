"""Kubernetes discovery against a stand-in API server on loopback that speaks the real list +
watch protocol (resourceVersion, JSON-lines watch stream, bookmarks, 410 Gone), with real
emulator replicas behind its EndpointSlices."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from tests.daemon.conftest import dead_url, http_json, needs_emulator, start_emulator, start_lb
from tests.daemon.test_reload_admin import finish, open_stream, replicas
from tests.procs import PYTHON, Proc, free_port, metric, poll

pytest.importorskip("kubernetes_asyncio", reason="the k8s extra: pip install 'lb[k8s]'")
pytestmark = needs_emulator
HERE = Path(__file__).parent
NS = "inference"


def endpoint_slice(name: str, url: str, *, ready: bool = True, terminating: bool = False,
                   labels: dict | None = None) -> dict:
    host, port = url.split("//")[1].rsplit(":", 1)
    return {"metadata": {"name": name, "namespace": NS,
                         "labels": {"app": "sglang", "kubernetes.io/service-name": "sglang", "lb/engine": "sglang",
                                    **(labels or {})}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
            "endpoints": [{"addresses": [host], "targetRef": {"kind": "Pod", "name": f"{name}-pod", "namespace": NS},
                           "conditions": {"ready": ready, "serving": ready or terminating, "terminating": terminating}}]}


class FakeAPI:
    def __init__(self, tmp_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc([PYTHON, str(HERE / "fake_k8s_api.py"), str(self.port), "sa-token"],
                         f"{self.url}/healthz", name="fake-k8s")
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({  # kubeconfig is YAML; JSON is YAML
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "loop", "cluster": {"server": self.url}}],
            "users": [{"name": "lb", "user": {"token": "sa-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "loop", "user": "lb", "namespace": NS}}]}))

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode() if body is not None else None,
                                     method=method, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def put(self, slice_: dict) -> None:
        self.call("PUT", f"/_control/slices/{NS}/{slice_['metadata']['name']}", slice_)


@pytest.fixture
def setup(tmp_path, procs):
    api = FakeAPI(tmp_path)
    procs.append(api.proc)
    emus = []
    for i in range(2):
        p, url = start_emulator("--speed", "2", name=f"emu{i}")
        procs.append(p)
        emus.append(url)
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f'[[discovery]]\nkind = "kubernetes"\nkubeconfig = "{api.kubeconfig}"\nnamespace = "{NS}"\n'
                   f'selector = "app=sglang"\nport = "http"\nwatch_timeout_s = 2\n')
    return api, emus, cfg


def key(url: str) -> str:
    return url.split("//")[1]


def test_follows_endpointslices_drains_terminating_and_relists_after_410(setup, procs):
    api, (a, b), cfg = setup
    api.put(endpoint_slice("sglang-a", a))
    api.put(endpoint_slice("other", b, labels={"app": "vllm"}))  # the selector does not match it
    d = start_lb(config=cfg)  # ready: a was listed, probed and found healthy
    procs.append(d.proc)
    reps = replicas(d)
    assert set(reps) == {key(a)}
    assert reps[key(a)]["source"] == "discovery[0]" and reps[key(a)]["engine"] == "sglang"  # from the label
    assert reps[key(a)]["models"] == ["m"]  # no model label: read from the replica's /v1/models

    # An added slice is followed by the watch; a dead endpoint is probed and never takes work.
    dead = dead_url()
    api.put(endpoint_slice("sglang-b", b))
    api.put(endpoint_slice("sglang-dead", dead))
    poll(lambda: replicas(d).get(key(b), {}).get("healthy"), what="b discovered and healthy")
    assert replicas(d)[key(dead)]["healthy"] is False
    served = {http_json("POST", d.url + "/v1/chat/completions", {"model": "m", "max_tokens": 2,
                                                                   "messages": [{"role": "user", "content": f"q{i}"}]}
                        )[1]["_headers"]["X-LB-Replica"] for i in range(8)}
    assert key(dead) not in served

    # The pod behind a request in flight starts terminating: drained, the request completes.
    conn, resp = open_stream(d)
    target = resp.getheader("X-LB-Replica")
    name = "sglang-a" if target == key(a) else "sglang-b"
    api.put(endpoint_slice(name, a if target == key(a) else b, ready=False, terminating=True))
    poll(lambda: replicas(d).get(target, {}).get("draining"), what="the terminating replica draining")
    finish(resp)
    conn.close()
    poll(lambda: target not in replicas(d), what="the drained replica to go")
    other = key(b) if target == key(a) else key(a)
    status, doc = http_json("POST", d.url + "/v1/chat/completions", {"model": "m", "max_tokens": 2,
                                                                     "messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and doc["_headers"]["X-LB-Replica"] == other

    # The watch is lost while slices change and history is compacted: the resumed watch gets
    # 410 Gone, lb relists, and what was deleted meanwhile leaves no ghost.
    gone_before = api.call("GET", "/_control/stats")["gone"]
    api.call("POST", "/_control/lose", {"delete": [[NS, "sglang-dead"], [NS, name]],
                                         "put": [endpoint_slice("sglang-a2", f"http://{target}")]})
    poll(lambda: key(dead) not in replicas(d) and target in replicas(d), what="the relist to apply")
    stats = api.call("GET", "/_control/stats")
    assert stats["gone"] > gone_before and stats["lists"] >= 2
    poll(lambda: replicas(d)[target]["healthy"], what="the re-added replica healthy")
    assert set(replicas(d)) == {key(a), key(b)}
    src = {"source": "discovery[0]", "kind": "kubernetes"}
    assert metric(d.url, "lb_discovery_replicas", **src) == 2
    assert metric(d.url, "lb_discovery_lists_total", **src) >= 2  # the first list and the relist
    assert metric(d.url, "lb_discovery_errors_total", **src) >= 2  # the cut watch and the 410

    # The watch carries on after the relist: a deleted slice drains its replica.
    api.call("DELETE", f"/_control/slices/{NS}/sglang-a2")
    poll(lambda: set(replicas(d)) == {other}, what="the deleted slice's replica to go")


def test_a_wrong_token_keeps_retrying_and_static_replicas_serve(setup, procs, tmp_path):
    api, (a, b), cfg = setup
    api.put(endpoint_slice("sglang-b", b))
    bad = tmp_path / "bad-kubeconfig"
    bad.write_text(api.kubeconfig.read_text().replace("sa-token", "wrong"))
    cfg.write_text(f'[[replicas]]\nurl = "{a}"\nengine = "sglang"\n\n'
                   + cfg.read_text().replace(str(api.kubeconfig), str(bad)))
    d = start_lb(config=cfg)
    procs.append(d.proc)
    assert set(replicas(d)) == {key(a)}  # 401 from the API: nothing discovered, the static one serves
    assert http_json("POST", d.url + "/v1/chat/completions", {"model": "m", "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "x"}]})[0] == 200
    poll(lambda: "401" in d.proc.log() or "Unauthorized" in d.proc.log(), what="the 401 logged")
