"""The prefix trie remembers no more for a replica than its KV holds: through a real `lb` over
an emulator whose `/v1/loads` reports 2,048 KV tokens, a prompt pushed out by later ones is no
longer counted as cached where it ran; the engine evicted it too. The bound is in the trie's
128-byte blocks, at the bytes per token the engine's own counts (`usage.prompt_tokens`) show:
the emulator's word tokenizer takes ~5-6 bytes a token, not the 4 assumed before any answer.
Without the bound the trie kept every prompt it ever sent."""
from __future__ import annotations

import json

from lb.core.facts import prompt_text
from lb.core.prefix import BytesPerToken
from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb

pytestmark = needs_emulator

KV_TOKENS = 2048  # the tiny profile's
BLOCK = 128


def body(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 1}


def test_a_prompt_the_engine_no_longer_holds_is_not_counted_as_cached(procs):
    emu, emu_url = start_emulator("--speed", "1")
    procs.append(emu)
    d = start_lb("--replica", emu_url, "--engine", "sglang")
    procs.append(d.proc)
    topics = ["ledgers and their balances", "mountain railways in winter", "the tides of a northern harbour"]
    prompts = [f"A conversation about {t}: " + f"notes on {t}, " * 110 for t in topics]  # ~4.5 kB each
    for content in (*prompts, prompts[0]):
        status, doc = http_json("POST", d.url + "/v1/chat/completions", body(content))
        assert status == 200, doc
    d.proc.stop()
    access = [json.loads(x) for x in d.proc.log_path.read_text().splitlines() if x.startswith('{"request_id"')]
    a, b, c, again = access[-4:]
    tokens = [r["usage"]["prompt_tokens"] for r in (a, b, c)]
    assert sum(tokens) > KV_TOKENS  # the engine cannot hold all three: it evicted the oldest's tail
    assert again["usage"]["cached_tokens"] < tokens[0]
    # the trie forgot as much: when the third was placed its bound was the KV at the bytes per
    # token the first two answers showed, and the first prompt, the least recently used, gave way
    per_token = BytesPerToken()
    for r, content in zip((a, b), prompts):
        per_token.observe(len(prompt_text("chat", body(content)).encode()), r["usage"]["prompt_tokens"])
    assert 5 < per_token.value() < 7  # the emulator's words, not 4 bytes a token
    bound = int(KV_TOKENS * per_token.value()) // BLOCK
    assert a["prompt_blocks"] + b["prompt_blocks"] <= bound < a["prompt_blocks"] + b["prompt_blocks"] + c["prompt_blocks"]
    assert again["matched_blocks"] == bound - b["prompt_blocks"] - c["prompt_blocks"] < a["prompt_blocks"], \
        (a, b, c, again, per_token.value())
