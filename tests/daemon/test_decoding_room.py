"""The KV a replica's answers under way hold is not cache (lb.core.decoding): through a real `lb`
over an emulator that reports its KV (SGLang's `/v1/loads`, the tiny profile's 2,048 tokens),
while streamed answers decode there `/admin/replicas` shows the room the prefix trie gives that
replica's prompts shrink by what they have decoded, and the whole KV back once they end."""
from __future__ import annotations

import json
import threading
import urllib.request

from tests.daemon.conftest import needs_emulator, start_emulator, start_lb
from tests.daemon.test_engine_detect import replica
from tests.procs import poll

pytestmark = needs_emulator

KV_TOKENS = 2048  # the tiny profile's
ANSWERS, ANSWER_TOKENS = 3, 400


def stream(url: str, tag: str, tokens: int) -> bytes:
    body = {"model": "m", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"{tag}: tell me about tides"}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return r.read()


def test_answers_under_way_take_their_tokens_from_the_trie_s_room_until_they_end(procs):
    emu, emu_url = start_emulator("--speed", "1")
    procs.append(emu)
    d = start_lb("--replica", emu_url, "--engine", "sglang")
    procs.append(d.proc)
    assert b"[DONE]" in stream(d.url, "warm", 16)  # one answer teaches the replica's inter-token time
    assert replica(d, emu_url)["cache_room_tokens"] == KV_TOKENS  # nothing under way
    done: list[bytes] = []
    threads = [threading.Thread(target=lambda i=i: done.append(stream(d.url, f"long {i}", ANSWER_TOKENS)))
               for i in range(ANSWERS)]
    for t in threads:
        t.start()
    seen: list[int] = []

    def shrunk() -> bool:
        seen.append(replica(d, emu_url)["cache_room_tokens"])
        return seen[-1] <= KV_TOKENS - 100

    poll(shrunk, what="the room shrinking while the answers decode")
    assert seen[-1] >= KV_TOKENS - ANSWERS * ANSWER_TOKENS, seen  # at most what they can decode
    for t in threads:
        t.join(timeout=60)
    assert len(done) == ANSWERS and all(b"[DONE]" in b for b in done)
    poll(lambda: replica(d, emu_url)["cache_room_tokens"] == KV_TOKENS, what="the whole KV back once they ended")
