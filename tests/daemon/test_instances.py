"""Two `lb` instances of one region over one emulated replica and one real redis-server.

The replica runs at most 4 requests (it reports `max_running_requests`), probes are rare (5 s),
so between probes SP-P decides on the pushes the last probe cannot have seen. 8 long streams
arrive alternately at `a` and `b`: together they push at most 4 (the replica's headroom) and
queue the rest, because each instance counts the other's pushes (lb.daemon.instances); the
engine never queues a request. `share_pushes = false`, the same run pushes 8. And a
conversation keeps its replica whichever instance gets each turn: its prompts and its answers
travel between them.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from lb.core.affinity import AffinityConfig
from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb
from tests.daemon.test_affinity_hold import BUSY_WITHOUT_PREEMPTING, conversation
from tests.procs import metric, poll

pytestmark = [needs_emulator, pytest.mark.timeout(90)]

STREAMS = 8
MAX_RUNNING = 4


def open_stream(port: int) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 500, "stream": True,
        "ignore_eos": True}), {"Content-Type": "application/json"})
    return conn


def engine_load(emu_url: str) -> dict:
    with urllib.request.urlopen(emu_url + "/get_load", timeout=5) as r:
        return json.loads(r.read())[0]


def outstanding(lb) -> int:
    status, doc = http_json("GET", lb.url + "/admin/replicas", headers={"Authorization": f"Bearer {lb.token}"})
    assert status == 200, doc
    return sum(r["outstanding"] for r in doc["replicas"])


def both_subscribed(redis_url: str, prefix: str) -> None:
    """Wait until both instances listen on the pushes channel (else the first pushes go unheard)."""
    import redis
    r = redis.Redis.from_url(redis_url)
    channel = f"{prefix}pushes"
    try:
        poll(lambda: dict(r.pubsub_numsub(channel)).get(channel.encode()) == 2, what="both instances subscribed")
    finally:
        r.close()


def run_pair(tmp_path: Path, procs, redis_url: str, share: bool) -> tuple[int, int]:
    """(pushed by both instances, waiting in the engine) once every stream is pushed or queued."""
    emu, emu_url = start_emulator("--max-running", str(MAX_RUNNING), "--speed", "0.2", name=f"emu-{share}")
    procs.append(emu)
    cfg = tmp_path / f"lb-{share}.toml"
    cfg.write_text(f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "pair-{share}:"\n'
                   f'share_pushes = {"true" if share else "false"}\n\n'
                   f'[probes]\ninterval_s = 5.0\nearly_reprobe_s = 4.0\n\n'
                   f'[[replicas]]\nurl = "{emu_url}"\nengine = "sglang"\nmodels = ["m"]\n')
    pair = [start_lb(config=cfg, name=f"lb-{share}-{i}") for i in range(2)]
    procs.extend(lb.proc for lb in pair)
    if share:  # both subscribers listen before the first push
        both_subscribed(redis_url, f"pair-{share}:")
    conns = []
    try:
        for i in range(STREAMS):
            conns.append(open_stream(pair[i % 2].port))
            time.sleep(0.05)  # alternate arrivals, as behind an L4 balancer
        poll(lambda: sum(outstanding(lb) + int(metric(lb.url, "lb_queue_length")) for lb in pair) == STREAMS,
             what="every stream pushed or queued", interval=0.1)
        return sum(outstanding(lb) for lb in pair), engine_load(emu_url)["num_waiting_reqs"]
    finally:
        for c in conns:
            c.close()


def test_two_instances_share_one_replicas_headroom(tmp_path: Path, procs, redis_url):
    pushed, waiting = run_pair(tmp_path, procs, redis_url, share=True)
    assert pushed <= MAX_RUNNING and waiting == 0
    pushed_alone, _ = run_pair(tmp_path, procs, redis_url, share=False)
    assert pushed_alone > MAX_RUNNING  # each instance spent the whole headroom: the case sharing exists for


def test_a_prefix_lands_on_the_same_replica_whichever_instance_receives_it(tmp_path: Path, procs, redis_url):
    urls = []
    for i in range(2):
        emu, url = start_emulator("--seed", str(i), name=f"emu-affinity-{i}")
        procs.append(emu)
        urls.append(url)
    cfg = tmp_path / "lb-affinity.toml"
    cfg.write_text(f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "affinity:"\n\n'
                   + "".join(f'[[replicas]]\nurl = "{u}"\nengine = "sglang"\nmodels = ["m"]\n\n' for u in urls))
    a, b = (start_lb(config=cfg, name=f"lb-affinity-{n}") for n in "ab")
    procs.extend([a.proc, b.proc])

    def ask(lb, text: str) -> str:
        status, doc = http_json("POST", lb.url + "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}, timeout=30)
        assert status == 200, doc
        return doc["_headers"]["X-LB-Replica"]

    first_seen = set()
    for s in range(8):  # each conversation starts at one instance and goes on at the other
        first, then = (a, b) if s % 2 else (b, a)
        history = f"conversation {s}: " + " ".join(f"word{s}-{i}" for i in range(400))
        holder = ask(first, history)
        first_seen.add(holder)
        # The next turn a moment later, as a user or a tool call sends it. Sent in the same
        # millisecond, it can reach the other instance before the news that this answer ended
        # (Redis pub/sub, never awaited on the request path): that instance then still counts
        # the 400-word prompt as prefill ahead on the holder, level with recomputing it on the
        # idle replica. Its next probe (every 100 ms) settles it either way.
        time.sleep(0.25)
        assert ask(then, history + " and one more question") == holder, f"conversation {s} moved"
    assert len(first_seen) == 2  # the conversations were spread, so landing together is not chance


def test_a_conversations_next_turn_at_another_instance_waits_for_its_last_answer(tmp_path: Path, procs, redis_url):
    """Turn one through `a`, turn two, mostly turn one's answer, through `b` while the holder runs
    a batch with more waiting: `b` learned from `a` where the answer sits, not only the prompt (which matches
    under `min_gain` of turn two), so it waits for the holder as `a` would (the one-instance
    case: tests/daemon/test_affinity_hold.py)."""
    urls = {}
    for i in range(2):
        emu, url = start_emulator("--speed", "1", *BUSY_WITHOUT_PREEMPTING, name=f"emu-turns-{i}")
        procs.append(emu)
        urls[url.removeprefix("http://")] = url
    cfg = tmp_path / "lb-turns.toml"
    cfg.write_text(f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "turns:"\n\n'
                   '[probes]\ninterval_s = 0.02\n\n[affinity]\nhold_s = 30.0\nmax_bypass_s = 60.0\n\n'
                   + "".join(f'[[replicas]]\nurl = "{u}"\nengine = "sglang"\nmodels = ["m"]\n\n' for u in urls.values()))
    a, b = (start_lb(config=cfg, name=f"lb-turns-{n}") for n in "ab")
    procs.extend([a.proc, b.proc])
    both_subscribed(redis_url, "turns:")
    holder, served_by, sizes = asyncio.run(asyncio.wait_for(conversation(a.url, urls, b.url), 60))
    deadline = time.monotonic() + 5  # the access log is written after the answer went out
    while not (access := [json.loads(x) for x in b.proc.log_path.read_text().splitlines()
                          if x.startswith('{"request_id"')]):
        assert time.monotonic() < deadline, "b never logged the second turn"
        time.sleep(0.02)
    second = access[-1]
    print(sizes, {k: second[k] for k in ("target", "decision", "matched_blocks", "prompt_blocks")})
    assert second["matched_blocks"] < AffinityConfig().min_gain * second["prompt_blocks"], second  # the prompt alone would not hold it
    assert served_by == holder


def test_an_agent_without_headers_holds_one_lease_whichever_instance_answers(tmp_path: Path, procs, redis_url):
    """The `openai` SDK's agent (no `x-lb-*` header) alternates between instances `a` and `b`:
    the lease its last answer holds on the replica is the same at both (the answering instance
    tells the other; lb.daemon.instances), so neither pushes other work into it, and it ends at
    both when the next step arrives at either."""
    import openai

    emu, url = start_emulator("--speed", "4", name="emu-agent")
    procs.append(emu)
    cfg = tmp_path / "lb-agent.toml"
    cfg.write_text(f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "agent:"\n\n'
                   f'[pushing]\nlease_s = 60\n\n[[replicas]]\nurl = "{url}"\nengine = "sglang"\nmodels = ["m"]\n')
    pair = [start_lb(config=cfg, name=f"lb-agent-{n}") for n in "ab"]
    procs.extend(lb.proc for lb in pair)
    both_subscribed(redis_url, "agent:")
    clients = [openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=0) for lb in pair]
    messages = [{"role": "system", "content": "You are a coding agent. Tools: read, edit, run. " * 30},
                {"role": "user", "content": "Fix the failing test in parser.py. " * 8}]
    seen = []
    for step in range(6):
        answer = clients[step % 2].chat.completions.create(model="m", user="bot", max_tokens=8, messages=messages)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": f"read('parser{step}.py'): " + "def parse(text): ... " * 40}]
        here = metric(pair[step % 2].url, "lb_replica_leased_tokens")
        poll(lambda: metric(pair[1 - step % 2].url, "lb_replica_leased_tokens") == here,
             what="the other instance holds the same lease", interval=0.05)
        seen.append(here)
    assert seen[0] == 0 and all(x > 0 for x in seen[3:]), seen  # leased once the agent's calls are known continued


def test_room_the_other_instance_frees_takes_our_queued_request_without_waiting_for_a_probe(
        tmp_path: Path, procs, redis_url):
    """`a`'s request fills the replica (it runs one at a time); `b`'s, arriving meanwhile, waits
    in `b`'s queue, since `b` heard of `a`'s push. When `a`'s answer ends, `b` hears it and
    places its request then, as one LB would on its own answer's end, not at its next probe
    (30 s away here)."""
    import threading

    emu, url = start_emulator("--max-running", "1", "--speed", "0.5", name="emu-freed")
    procs.append(emu)
    cfg = tmp_path / "lb-freed.toml"
    cfg.write_text(f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "freed:"\n\n'
                   f'[probes]\ninterval_s = 30.0\nearly_reprobe_s = 20.0\n\n'
                   f'[[replicas]]\nurl = "{url}"\nengine = "sglang"\nmodels = ["m"]\n')
    a, b = (start_lb(config=cfg, name=f"lb-freed-{n}") for n in "ab")
    procs.extend([a.proc, b.proc])
    both_subscribed(redis_url, "freed:")
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 40, "ignore_eos": True}
    ended = {}

    def ask(name: str, lb) -> None:
        status, doc = http_json("POST", lb.url + "/v1/chat/completions", body, timeout=25)
        assert status == 200, doc
        ended[name] = time.monotonic()

    first = threading.Thread(target=ask, args=("a", a))
    first.start()
    poll(lambda: engine_load(url)["num_reqs"] == 1, what="a's request running", interval=0.02)
    time.sleep(0.3)  # the push's news reaches b
    started = time.monotonic()
    ask("b", b)
    first.join()
    assert ended["b"] > ended["a"]  # it waited for the room: the engine ran one at a time
    assert ended["b"] - started < 15.0  # placed when a's answer ended, long before b's next probe


def test_the_other_instance_s_answers_sent_whole_wait_on_the_engine_s_first_token_count_at_both(
        tmp_path: Path, procs, redis_url):
    """vLLM counts every first token it produces, this LB's and the other instance's alike. A
    push answered whole at `a` stands in that count's line at `b` too (heard over Redis), so a
    first token of `a`'s does not release one of `b`'s early (lb.core.backlog.remote_placed),
    and it leaves the line when its answer ends at `a`."""
    emu, emu_url = start_emulator("--speed", "0.02", name="emu-count")  # a slow prefill: time to look
    procs.append(emu)
    cfg = tmp_path / "lb-count.toml"
    cfg.write_text(f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "pair-count:"\n\n'
                   f'[probes]\ninterval_s = 0.1\n\n'
                   f'[[replicas]]\nurl = "{emu_url}"\nengine = "vllm"\nmodels = ["m"]\n')
    a, b = (start_lb(config=cfg, name=f"lb-count-{i}") for i in range(2))
    procs.extend([a.proc, b.proc])
    both_subscribed(redis_url, "pair-count:")

    def awaited(lb) -> dict:
        doc = http_json("GET", lb.url + "/admin/replicas", headers={"Authorization": f"Bearer {lb.token}"})[1]
        (rep,) = doc["replicas"]
        return rep["first_tokens"], rep["first_tokens_awaited"]

    poll(lambda: awaited(a)[0] is not None and awaited(b)[0] is not None, what="both read the engine's count")
    assert awaited(b)[1] == {"ours": 0, "others": 0}  # `b` has placed nothing: its line starts at this count
    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "count these words " * 400}], "max_tokens": 4}),
        {"Content-Type": "application/json"})
    try:
        poll(lambda: awaited(a)[1]["ours"] == 1 and awaited(b)[1]["others"] == 1,
             what="the push waiting on the count at both instances", interval=0.02)
        r = conn.getresponse()
        assert r.status == 200, r.read()
        r.read()
    finally:
        conn.close()
    poll(lambda: awaited(a)[1] == {"ours": 0, "others": 0} and awaited(b)[1] == {"ours": 0, "others": 0},
         what="the line empty once the count or the answer passed it")


def test_each_instance_knows_the_lora_adapters_the_other_runs_on_engines_that_name_none(tmp_path: Path, procs, redis_url):
    """Two instances over two emulators on SGLang's face (its load endpoints name no adapters),
    each serving 3 adapters with a batch of one, probes 10 s apart: lora-0 decodes on a replica
    through `a`; at `b`, lora-1 goes to the other replica and lora-2 waits in `b`'s queue, in no
    engine's, because `a`'s push told `b` which adapter runs where (lb.core.adapters)."""
    from openai import OpenAI

    from tests.daemon.test_lora import MSG, decode
    from tests.daemon.test_parallel_samples import lb_queue

    emus = []
    for i in range(2):
        emu, url = start_emulator("--lora-adapters", "3", "--max-loras", "1", "--speed", "1", name=f"emu-lora-{i}")
        procs.append(emu)
        emus.append(url)
    cfg = tmp_path / "lb-lora.toml"
    cfg.write_text(f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "lora:"\n\n'
                   '[probes]\ninterval_s = 10.0\nearly_reprobe_s = 5.0\n\n'
                   + "".join(f'[[replicas]]\nurl = "{u}"\nengine = "sglang"\n\n' for u in emus))
    a, b = (start_lb(config=cfg, name=f"lb-lora-{i}") for i in range(2))
    procs.extend((a.proc, b.proc))
    both_subscribed(redis_url, "lora:")
    clients = [OpenAI(base_url=lb.url + "/v1", api_key="none", max_retries=0, timeout=60) for lb in (a, b)]
    streams = [decode(clients[0], "lora-0")]
    time.sleep(0.5)  # a's push reaches b through redis
    streams.append(decode(clients[1], "lora-1"))
    assert sorted(engine_load(u)["num_reqs"] for u in emus) == [1, 1]  # one adapter on each replica
    late = {}

    def short() -> None:
        late["choices"] = len(clients[1].chat.completions.create(model="lora-2", messages=MSG, max_tokens=4).choices)

    t = threading.Thread(target=short)
    t.start()
    poll(lambda: lb_queue(b.url) == 1, what="lora-2 waiting in b's queue")
    assert [engine_load(u)["num_waiting_reqs"] for u in emus] == [0, 0]
    assert metric(b.url, "lb_replica_lora_adapters") == 2  # a's lora-0 and its own lora-1, one on each
    for chunks in streams:
        for _ in chunks:
            pass
    t.join(timeout=60)
    assert late == {"choices": 1}
