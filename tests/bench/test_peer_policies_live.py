"""Each peer model in bench/sim/peer_policies.py makes one known decision the way the live
router does: the same requests, in the same order, through the real router in front of
real emulators, and through the model; both must land where the model's source says.

Small on purpose: tiny-profile emulators, a handful of requests per router.
"""
from __future__ import annotations

import json
import re
import threading
import urllib.request

import pytest

from bench.fleet import Fleet
from bench.sim.peer_policies import PEERS, PeerRequest
from bench.systems import nginx, sglang_router, start, unavailable, vllm_router
from tests.procs import poll

pytestmark = pytest.mark.thirdparty

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def text(seed: int, n: int = 300) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] + str(i % 10) for i in range(n))


def served(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        body = r.read().decode()
    return int(sum(float(v) for v in re.findall(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", body, re.M)))


def send(url: str, prompt: str, *, max_tokens: int = 4, headers: dict | None = None) -> None:
    body = json.dumps({"model": "tiny-llama", "max_tokens": max_tokens, "ignore_eos": True,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


class Live:
    """A router over `n` tiny emulators; `where(...)` says which emulator a request reached."""

    def __init__(self, fleet: Fleet, system, n: int):
        self.emulators = fleet.emulators(n, profile="tiny")
        self.urls = [e.url for e in self.emulators]
        self.router = start(system, fleet, self.urls)[0]

    def where(self, prompt: str, **kw) -> int:
        before = [served(u) for u in self.urls]
        send(self.router, prompt, **kw)
        # the emulator counts a request when it finishes; the response is complete by now
        after = [served(u) for u in self.urls]
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
        assert len(changed) == 1, (before, after)
        return changed[0]

    def hold(self, prompt: str) -> threading.Thread:
        """A long request kept in flight (about 6 s of decode on the tiny profile)."""
        def run():
            try:
                send(self.router, prompt, max_tokens=1500)
            except Exception:
                pass  # the fleet stops under it at the end of the test

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def running(url: str) -> int:
    with urllib.request.urlopen(url + "/get_load", timeout=5) as r:
        return json.loads(r.read())[0]["num_reqs"]


def skip_unless(system) -> None:
    why = unavailable(system)
    if why:
        pytest.skip(why)


def model_picks(spec_name: str, calls: list[PeerRequest], workers: list[str], inflight: list[dict]) -> list[str]:
    policy = PEERS[spec_name].build(0)
    return [policy.choose(c, workers, load, float(i)) for i, (c, load) in enumerate(zip(calls, inflight))]


def tokens(prompt: str) -> list[int]:
    from bench.tokenizer import encode, render_chat

    return encode(render_chat([{"role": "user", "content": prompt}]))


@pytest.mark.parametrize("router", ["sglang-router", "vllm-router"])
def test_cache_aware_at_balanced_load_keeps_every_prompt_on_one_worker(tmp_path, router):
    """Unrelated prompts one after another: no worker is a tenant of the tree until a request
    is inserted under it, and the no-tenant fallback inserts nothing, so all go to one."""
    system = sglang_router("cache_aware") if router == "sglang-router" else vllm_router("cache_aware")
    skip_unless(system)
    prompts = [text(k) for k in range(1, 5)] + [text(1) + " and then some more words"]
    workers = ["w0", "w1", "w2"]
    model = model_picks(f"{router} cache_aware", [PeerRequest(f"r{i}", tokens(p)) for i, p in enumerate(prompts)],
                        workers, [dict.fromkeys(workers, 0)] * len(prompts))
    with Fleet(tmp_path / "logs") as fleet:
        live = Live(fleet, system, 3)
        got = [live.where(p) for p in prompts]
    print(f"{router} cache_aware: live {got}, model {model}")
    assert len(set(model)) == 1
    assert len(set(got)) == 1


@pytest.mark.parametrize("system", [sglang_router("round_robin"), vllm_router("round_robin")], ids=str)
def test_round_robin_cycles_whatever_the_prompt(tmp_path, system):
    skip_unless(system)
    prompts = [text(1)] * 4  # the same prompt four times: round robin ignores it
    workers = ["w0", "w1", "w2"]
    model = model_picks(f"{system.family} round_robin", [PeerRequest(f"r{i}", tokens(p)) for i, p in enumerate(prompts)],
                        workers, [dict.fromkeys(workers, 0)] * 4)
    with Fleet(tmp_path / "logs") as fleet:
        live = Live(fleet, system, 3)
        got = [live.where(p) for p in prompts]
    print(f"{system}: live {got}, model {model}")
    assert len(set(model[:3])) == 3 and model[3] == model[0]
    assert len(set(got[:3])) == 3 and got[3] == got[0]


@pytest.mark.parametrize("system", [vllm_router("power_of_two"), nginx("least_conn"), sglang_router("power_of_two")],
                         ids=str)
def test_load_aware_peers_and_a_worker_with_a_request_in_flight(tmp_path, system):
    """vllm-router power_of_two and nginx least_conn count their own open requests and avoid
    the busy worker; sglang-router power_of_two reads polled loads that never separate the
    emulators, so it keeps drawing both (the model draws uniformly)."""
    skip_unless(system)
    name = f"{system.family} {system.policy}"
    avoids = system != sglang_router("power_of_two")
    probes = 12
    model = model_picks(name, [PeerRequest(f"r{i}", [1]) for i in range(probes)], ["w0", "w1"],
                        [{"w0": 1, "w1": 0}] * probes)
    assert (set(model) == {"w1"}) == avoids
    with Fleet(tmp_path / "logs") as fleet:
        live = Live(fleet, system, 2)
        live.hold("hold this one")
        busy = poll(lambda: [i for i, u in enumerate(live.urls) if running(u)], what="the long request to start")[0]
        got = [live.where(f"short {k}", max_tokens=1) for k in range(probes)]
        still = running(live.urls[busy])
    print(f"{system}: busy emulator {busy}, next requests to {got}; model {model}")
    assert still  # the long request was in flight throughout
    if avoids:
        assert busy not in got
    else:
        assert busy in got and len(set(got)) == 2


def test_vllm_consistent_hash_keys_on_the_request_id_the_client_sends(tmp_path):
    system = vllm_router("consistent_hash")
    skip_unless(system)
    ids = [f"req-{i}" for i in range(8)]
    session = {"X-LB-Session": "conv-1", "X-LB-User": "alice"}
    policy = PEERS["vllm-router consistent_hash"].build(0)
    workers = ["w0", "w1", "w2", "w3"]
    picks = [policy.choose(PeerRequest(i, [1], session="conv-1", user="alice"), workers, {}, 0.0) for i in ids]
    assert len(set(picks)) > 1
    with Fleet(tmp_path / "logs") as fleet:
        live = Live(fleet, system, 4)
        got = [live.where(text(k), headers={**session, "X-Request-Id": i}) for k, i in enumerate(ids)]
        again = [live.where(text(50 + k), headers={**session, "X-Request-Id": i}) for k, i in enumerate(ids[:3])]
    print(f"vllm-router consistent_hash: one session, 8 request ids -> {got}; same ids again -> {again}")
    assert len(set(got)) > 1  # one session spread: the key is X-Request-Id
    assert again == got[:3]  # the same request id lands on the same worker whatever the prompt


def test_nginx_hash_session_keeps_a_session_on_one_replica(tmp_path):
    system = nginx("hash-session")
    skip_unless(system)
    policy = PEERS["nginx hash-session"].build(0)
    workers = ["w0", "w1", "w2", "w3"]
    one = {policy.choose(PeerRequest(f"r{i}", [1], session="conv-9"), workers, {}, 0.0) for i in range(5)}
    many = {policy.choose(PeerRequest(f"q{i}", [1], session=f"conv-{i}"), workers, {}, 0.0) for i in range(12)}
    assert len(one) == 1 and len(many) > 1
    with Fleet(tmp_path / "logs") as fleet:
        live = Live(fleet, system, 4)
        same = {live.where(text(k), headers={"X-LB-Session": "conv-9"}) for k in range(5)}
        spread = {live.where(text(20 + k), headers={"X-LB-Session": f"conv-{k}"}) for k in range(12)}
    print(f"nginx hash-session: one session -> {same}; 12 sessions -> {spread}")
    assert len(same) == 1 and len(spread) > 1
