"""`lb` in front of real llama.cpp servers (an engine no one here wrote), end to end.

Proxying (plain and streamed, through the `openai` SDK), cancellation reaching the engine,
probing of `llamacpp:requests_deferred`, and selective pushing: with `sp-pending` the excess
of a burst waits in lb's queue while the servers' deferred queues stay near empty; with
`blind` it piles up inside the servers."""
from __future__ import annotations

import json
import random
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

from lb.core.pushing import DEFAULT_PUSH_CREDIT
from tests.llamacpp.llama import (MODEL, SLOTS, LlamaServer, chat, chat_body, get_json, get_metrics,
                                  openai_client, wait_until)
from tests.procs import Proc, free_port, lb, metric

pytestmark = pytest.mark.llamacpp
pytest.importorskip("openai")


@contextmanager
def lb_over(servers: list[LlamaServer], pushing: str = "sp-pending", policy: str = "least-load",
            engine: str = "llamacpp"):
    """An lb daemon over `servers` (engine llamacpp unless told); yields its URL once it has a
    usable replica."""
    port = free_port()
    args = ["serve", "--port", str(port), "--engine", engine, "--pushing", pushing,
            "--policy", policy]
    for s in servers:
        args += ["--replica", s.url]
    url = f"http://127.0.0.1:{port}"
    with Proc(lb(*args), ready_url=url + "/ready", timeout=30.0, name=f"lb-{pushing}"):
        yield url


def lb_pending(lb_url: str, server: LlamaServer) -> float | None:
    """lb's view of the server's pending requests (replica ids default to host:port)."""
    return get_metrics(lb_url).get(f'lb_replica_pending{{replica="{urlsplit(server.url).netloc}"}}')


def test_proxies_plain_and_streaming(idle_servers):
    with lb_over(idle_servers) as lb_url:
        models = get_json(lb_url + "/v1/models")
        direct = get_json(idle_servers[0].url + "/v1/models")
        assert {m["id"] for m in models["data"]} == {m["id"] for m in direct["data"]}

        c = openai_client(lb_url)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=12, extra_body={"ignore_eos": True})
        assert r.choices[0].message.content and r.usage.completion_tokens == 12

        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=20, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) > 1
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_an_unset_engine_is_detected_as_llamacpp_from_its_metrics(idle_servers):
    with lb_over(idle_servers, engine="auto") as lb_url:
        for s in idle_servers:
            rid = urlsplit(s.url).netloc
            wait_until(lambda: metric(lb_url, "lb_replica_engine", replica=rid, engine="llamacpp") == 1.0,
                       timeout=10.0, what=f"{rid} seen as llama.cpp")


def test_client_disconnect_frees_the_llama_slot(idle_servers):
    """A client that goes away mid-stream: lb aborts upstream and llama.cpp stops decoding,
    freeing the slot long before the requested tokens (~30 s of decoding) were generated."""
    # /slots shows each task's parameters but not its prompt: a max_tokens of its own
    # tells this request's slot apart.
    max_tokens = 29000 + random.randrange(1000)
    predicted_before = {s.url: s.metrics()["llamacpp:tokens_predicted_total"] for s in idle_servers}
    with lb_over(idle_servers) as lb_url:
        req = urllib.request.Request(
            lb_url + "/v1/chat/completions",
            data=json.dumps(chat_body("Never stop.", max_tokens, stream=True)).encode(),
            headers={"Content-Type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=30)
        for _ in range(5):  # a few SSE events: generation is under way
            assert resp.readline()

        def slot_of_request() -> tuple[LlamaServer, dict] | None:
            for s in idle_servers:
                for slot in get_json(s.url + "/slots"):
                    if slot.get("is_processing") and slot["params"]["max_tokens"] == max_tokens:
                        return s, slot
            return None

        server, slot = wait_until(slot_of_request, 5, "the request's slot in /slots")
        resp.close()  # the client disconnects

        wait_until(lambda: not next(s for s in get_json(server.url + "/slots")
                                    if s["id"] == slot["id"])["is_processing"],
                   10, "the slot to stop processing after the disconnect")
        metrics = server.metrics()
        assert metrics["llamacpp:requests_processing"] == 0
        generated = metrics["llamacpp:tokens_predicted_total"] - predicted_before[server.url]
        assert 0 < generated < max_tokens / 2, "the engine went on decoding: the abort never reached it"


def test_probes_see_requests_deferred(idle_servers):
    """Overload one server behind lb's back: lb's pending gauge for it rises above 0 from the
    100 ms probes of `llamacpp:requests_deferred`, and returns to 0 once the queue drains."""
    server = idle_servers[0]
    burst = SLOTS * 3
    with lb_over(idle_servers[:1], pushing="blind") as lb_url:
        assert lb_pending(lb_url, server) == 0
        with ThreadPoolExecutor(burst) as pool:
            futures = [pool.submit(chat, server.url, chat_body("Go on and on.", 800))
                       for _ in range(burst)]
            seen = wait_until(lambda: lb_pending(lb_url, server), 20,
                              "lb_replica_pending > 0 while the server defers requests")
            assert seen <= burst - SLOTS
            for f in futures:
                f.result()
        wait_until(lambda: lb_pending(lb_url, server) == 0, 10,
                   "lb_replica_pending back to 0 after the burst")


class Sampler:
    """Samples, until stopped, the peaks of each server's requests_deferred, of their sum,
    and of lb's queue length."""

    def __init__(self, servers: list[LlamaServer], lb_url: str):
        self.servers, self.lb_url = servers, lb_url
        self.peak_each = [0.0] * len(servers)
        self.peak_deferred = self.peak_lb_queue = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            deferred = [s.metrics()["llamacpp:requests_deferred"] for s in self.servers]
            queue = get_metrics(self.lb_url)["lb_queue_length"]
            self.peak_each = [max(p, d) for p, d in zip(self.peak_each, deferred)]
            self.peak_deferred = max(self.peak_deferred, sum(deferred))
            self.peak_lb_queue = max(self.peak_lb_queue, queue)
            self._stop.wait(0.01)

    def stop(self) -> "Sampler":
        self._stop.set()
        self._thread.join()
        return self


def burst_through_lb(servers: list[LlamaServer], pushing: str, burst: int, max_tokens: int) -> Sampler:
    with lb_over(servers, pushing=pushing) as lb_url:
        sampler = Sampler(servers, lb_url)
        with ThreadPoolExecutor(burst) as pool:
            results = list(pool.map(lambda i: chat(lb_url, chat_body(f"Story {i}.", max_tokens)),
                                    range(burst)))
        sampler.stop()
    assert all(r["usage"]["completion_tokens"] == max_tokens for r in results), "all served"
    for s in servers:
        s.wait_idle()
    return sampler


# Long enough that a round of generation outlasts the burst's arrival: on a busy 2-core CI
# machine 40 client threads took long enough to send that with 800 tokens the first round
# was finishing before the last requests arrived, and the piles never reached their size.
GENERATED = 1600


def test_selective_pushing_holds_the_excess_in_lb(idle_servers):
    """A burst of 5x the total slots. sp-pending: each llama-server's deferred queue stays
    within the push credit (the unseen pushes lb allows between two probes of an engine that
    reports no KV room) and lb's queue holds the excess. blind: lb's queue stays empty and
    the excess piles up in the servers."""
    servers = idle_servers[:2]
    slots = SLOTS * len(servers)
    burst, excess = 5 * slots, 4 * slots

    sp = burst_through_lb(servers, "sp-pending", burst, max_tokens=GENERATED)
    bp = burst_through_lb(servers, "blind", burst, max_tokens=GENERATED)

    print(f"\nburst {burst} onto {slots} slots; peak deferred per llama-server: "
          f"sp-pending {sp.peak_each}, blind {bp.peak_each}; "
          f"peak lb queue: sp-pending {sp.peak_lb_queue:.0f}, blind {bp.peak_lb_queue:.0f}")
    assert max(sp.peak_each) <= DEFAULT_PUSH_CREDIT
    assert sp.peak_lb_queue >= excess / 2
    assert bp.peak_lb_queue == 0
    assert bp.peak_deferred >= excess / 2
    assert bp.peak_deferred > 2 * sp.peak_deferred
