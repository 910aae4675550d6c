"""Cache-affine scheduling through a real `lb` over two emulators: a request whose prefix holder
is busy (its engine queue is full) waits for it up to `affinity.hold_s` instead of being
recomputed on the idle replica; with `hold_s = 0` it goes to the idle one at once.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from lb.core.affinity import AffinityConfig
from tests.daemon.conftest import needs_emulator, start_emulator, start_lb

pytestmark = needs_emulator

PREFIX = "Background for every question in this conversation: " + "the ledger balances. " * 30
FILLER = "Unrelated long work to keep the engine queue full. " * 16  # ~200 tokens
# The holder is busy, not preempting: its engine reserves a filler's whole answer (200 tokens)
# at admission, so 5 fillers run and 11 wait. On tiny's default reservation (16) it admitted
# more than could decode and preempted, and lb holds nothing for a holder that preempts beside
# a free replica that does not (tests/core/test_affinity.py): since lb hears SGLang's
# retractions, these engines' faces told it so.
BUSY_WITHOUT_PREEMPTING = ("--decode-reserve", "200")


async def post(s: aiohttp.ClientSession, url: str, content: str, max_tokens: int) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        await r.read()
        assert r.status == 200
        return r.headers.get("X-LB-Replica", "")


async def pending(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url + "/get_load") as r:
        return sum(x["num_waiting_reqs"] for x in await r.json())


async def lb_sees_pending(s: aiohttp.ClientSession, lb_url: str, replica: str) -> bool:
    async with s.get(lb_url + "/metrics") as r:
        line = next((x for x in (await r.text()).splitlines()
                     if x.startswith(f'lb_replica_pending{{replica="{replica}"}}')), "")
    return bool(line) and float(line.split()[-1]) > 0


async def scenario(lb_url: str, emu_urls: dict[str, str]) -> tuple[str, str, float]:
    """(holder, where the follow-up ran, how long it took) with the holder's queue full."""
    async with aiohttp.ClientSession() as s:
        holder = await post(s, lb_url, PREFIX + "First question?", 1)
        fillers = [asyncio.ensure_future(post(s, emu_urls[holder], f"{i} {FILLER}", 200)) for i in range(16)]
        deadline = time.monotonic() + 10
        while await pending(s, emu_urls[holder]) == 0:  # straight to the engine: the LB cannot see them coming
            assert time.monotonic() < deadline, "the holder's queue never filled"
            await asyncio.sleep(0.01)
        while not await lb_sees_pending(s, lb_url, holder):  # and then the LB's probe
            assert time.monotonic() < deadline, "the LB never saw the holder's queue"
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        served_by = await post(s, lb_url, PREFIX + "Second question?", 1)
        took = time.monotonic() - t0
        await asyncio.gather(*fillers)
        return holder, served_by, took


def two_replicas_behind_lb(tmp_path, hold_s: float, run, *lb_args: str) -> tuple[tuple, list[dict]]:
    """`run(lb_url, {replica: emulator url})` against a real lb (SP-P, SGLang faces, probes every
    20 ms) over two emulators; its result and lb's access log. The engines reserve each filler's
    whole answer (`BUSY_WITHOUT_PREEMPTING`)."""
    emus = [start_emulator("--speed", "1", *BUSY_WITHOUT_PREEMPTING, name=f"emu{i}") for i in range(2)]
    urls = {u.removeprefix("http://"): u for _, u in emus}
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f"[probes]\ninterval_s = 0.02\n[affinity]\nhold_s = {hold_s}\nmax_bypass_s = 60.0\n")
    d = start_lb(*[a for u in urls.values() for a in ("--replica", u)], "--engine", "sglang",
                 "--pushing", "sp-pending", *lb_args, config=cfg)
    try:
        result = asyncio.run(asyncio.wait_for(run(d.url, urls), 90))
    finally:
        d.proc.stop()
        access = [json.loads(x) for x in d.proc.log_path.read_text().splitlines() if x.startswith('{"request_id"')]
        for p, _ in emus:
            p.stop()
    return result, access


@pytest.mark.parametrize("hold_s", [30.0, 0.0])  # 30 s: far longer than the fillers take (~2 s)
def test_a_request_waits_for_its_busy_prefix_holder_only_within_hold_s(tmp_path, hold_s):
    (holder, served_by, took), access = two_replicas_behind_lb(tmp_path, hold_s, scenario, "--policy", "prefix-trie")
    print(f"hold_s={hold_s}: holder {holder}, follow-up on {served_by} after {took * 1000:.0f} ms")
    # the access log says why: the follow-up (the last request through lb) was placed on its
    # prefix, on the holder it waited for
    follow_up = access[-1]
    print("access log:", {k: follow_up[k] for k in ("target", "decision", "matched_blocks", "prompt_blocks")})
    if hold_s:
        assert (follow_up["decision"], follow_up["target"]) == ("prefix", holder)
        assert 0 < follow_up["matched_blocks"] <= follow_up["prompt_blocks"]
        assert follow_up["best_blocks"] == follow_up["matched_blocks"]  # it took the longest match there was
        assert served_by == holder  # waited for its cache rather than recomputing elsewhere
    else:
        assert served_by != holder  # no hold: the idle replica takes it at once


async def conversation(lb_url: str, emu_urls: dict[str, str], next_lb_url: str | None = None) -> tuple[str, str, dict]:
    """(holder of the first turn, where the second ran, the second's prompt size in blocks and
    the first's) with the holder's queue full when the second turn comes (through `next_lb_url`
    when given: another instance of the region)."""
    next_lb_url = next_lb_url or lb_url
    question = [{"role": "user", "content": "Plan a week in Lisbon for a family of four. " * 6}]
    async with aiohttp.ClientSession() as s:
        body = {"model": "m", "messages": question, "max_tokens": 1200, "ignore_eos": True}
        async with s.post(lb_url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            holder, answer = r.headers["X-LB-Replica"], (await r.json())["choices"][0]["message"]["content"]
        # 8 fillers: 5 run and 3 wait, a line shorter than the history's prefill elsewhere
        fillers = [asyncio.ensure_future(post(s, emu_urls[holder], f"{i} {FILLER}", 200)) for i in range(8)]
        deadline = time.monotonic() + 10
        while not await lb_sees_pending(s, next_lb_url, holder):
            assert time.monotonic() < deadline, "the LB never saw the holder's queue"
            await asyncio.sleep(0.005)
        second = question + [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "Now only the rainy days."}]
        body = {"model": "m", "messages": second, "max_tokens": 1, "ignore_eos": True}
        async with s.post(next_lb_url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            served_by = r.headers["X-LB-Replica"]
        await asyncio.gather(*fillers)
        return holder, served_by, {"question_chars": len(question[0]["content"]), "answer_chars": len(answer)}


def test_a_conversations_next_turn_waits_for_the_replica_holding_its_last_answer(tmp_path):
    """The second turn is mostly the first turn's answer, which the prefix trie (prompts only)
    does not hold: it matched under `min_gain` of the prompt there and the turn went to the idle
    replica, recomputing its history. lb records where each answer ended, so it waits for it and
    then goes there, though the holder still runs a batch with more waiting: its history (~1,600
    tokens, a 1,200-token answer) would take longer to prefill again than its line there takes to
    pass (lb.core.affinity `release`; the clients do not stream, so the policy's own estimate
    prices the prefill). With 16 fillers waiting and a 300-token answer it is released to the
    idle replica, rightly: the line there outlasts the prefill."""
    (holder, served_by, sizes), access = two_replicas_behind_lb(tmp_path, 30.0, conversation)  # the default policy
    second = access[-1]
    print(sizes, {k: second[k] for k in ("target", "decision", "matched_blocks", "prompt_blocks")})
    # what the trie alone knows of the holder is under `min_gain` of the prompt: the answer is the rest
    assert second["matched_blocks"] < AffinityConfig().min_gain * second["prompt_blocks"], second
    assert served_by == holder
