"""An answer the engine has finished while its stream is still being relayed is not a push on
its way to the engine: it must not hold the replica's SP-P headroom (lb.core.pushing.settle_probe).

The replica is a real-protocol stand-in (tests/daemon/tail_standin.py): SGLang's `/get_load`,
no KV room reported (so SP-P allows `push_credit` unseen pushes), and streamed answers that
leave the engine's count right after their first token while their tail comes `TAIL_S` later.
"""
from __future__ import annotations

import asyncio
import sys

import aiohttp

from lb.core.pushing import DEFAULT_PUSH_CREDIT
from tests.daemon.conftest import start_lb
from tests.procs import Proc, free_port

TAIL_S = 3.0


def tail_standin() -> tuple[Proc, str]:
    port = free_port()
    proc = Proc([sys.executable, "-m", "tests.daemon.tail_standin", str(port), str(TAIL_S)],
                ready_url=f"http://127.0.0.1:{port}/health", name="tail-standin")
    return proc, f"http://127.0.0.1:{port}"


async def streams(url: str) -> tuple[bool, list[int]]:
    """Open `push_credit` streams and read each one's first token; then ask once more. Returns
    whether the last one's first token came while all the earlier streams were still open, and
    every status."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ended: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async def one(i: int, first: asyncio.Event) -> int:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        first.set()
                ended.append(i)
                return r.status

        firsts = [asyncio.Event() for _ in range(DEFAULT_PUSH_CREDIT)]
        earlier = [asyncio.ensure_future(one(i, e)) for i, e in enumerate(firsts)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 30)
        last_first = asyncio.Event()
        last = asyncio.ensure_future(one(DEFAULT_PUSH_CREDIT, last_first))
        await asyncio.wait_for(last_first.wait(), 30)
        before_any_end = not ended
        statuses = await asyncio.gather(*earlier, last)
    return before_any_end, list(statuses)


def test_answers_finished_in_the_engine_do_not_hold_its_headroom_while_their_tails_are_relayed(procs, tmp_path):
    standin, url = tail_standin()
    procs.append(standin)
    cfg = tmp_path / "lb.toml"
    cfg.write_text(f'[[replicas]]\nurl = "{url}"\nengine = "sglang"\nmodels = ["m"]\n')
    lb = start_lb(config=cfg)
    procs.append(lb.proc)
    taken_at_once, statuses = asyncio.run(streams(lb.url))
    assert statuses == [200] * (DEFAULT_PUSH_CREDIT + 1)
    # The engine reports nothing running while the earlier answers' tails are relayed: the
    # replica has room, so the next request goes there at once instead of waiting for a tail.
    assert taken_at_once
