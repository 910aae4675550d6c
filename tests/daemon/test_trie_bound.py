"""The prefix trie remembers no more for a replica than its KV holds: through a real `lb` over
an emulator whose `/v1/loads` reports 2,048 KV tokens (64 blocks of 128 characters at ~4 per
token), a prompt pushed out by a later one is no longer counted as cached where it ran; the
engine evicted it too. Without the bound the trie kept every prompt it ever sent."""
from __future__ import annotations

import json

from tests.daemon.conftest import http_json, needs_emulator, start_emulator, start_lb

pytestmark = needs_emulator


def ask(url: str, content: str) -> None:
    status, doc = http_json("POST", url + "/v1/chat/completions",
                            {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert status == 200, doc


def test_a_prompt_the_engine_no_longer_holds_is_not_counted_as_cached(procs):
    emu, emu_url = start_emulator("--speed", "1")
    procs.append(emu)
    d = start_lb("--replica", emu_url, "--engine", "sglang")
    procs.append(d.proc)
    first = "First conversation about ledgers and their balances. " * 100  # ~42 blocks
    second = "Second, unrelated: a tour of mountain railways in winter. " * 90  # ~42 blocks
    for content in (first, second, first):
        ask(d.url, content)
    d.proc.stop()
    access = [json.loads(x) for x in d.proc.log_path.read_text().splitlines() if x.startswith('{"request_id"')]
    a, b, again = access[-3:]
    assert a["matched_blocks"] == 0 and b["matched_blocks"] == 0
    # 64 blocks fit: the second prompt's took the first one's deepest blocks, its leading ones stay
    assert a["prompt_blocks"] + b["prompt_blocks"] > 64
    assert again["matched_blocks"] == 64 - b["prompt_blocks"] < a["prompt_blocks"], (a, b, again)
