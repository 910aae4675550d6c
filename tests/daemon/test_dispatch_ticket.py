"""The dispatcher's side of keeping a retried request's queue place (in-process, no I/O)."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from lb.core.policies import make_policy
from lb.core.types import RequestFacts
from lb.daemon.config import Config
from lb.daemon.dispatch import Dispatcher
from lb.daemon.registry import Registry


@pytest.mark.parametrize("order", ["fcfs", "wsc", "vtc", "dpa"])
async def test_retry_keeps_its_ticket_ahead_of_later_arrivals(order):
    cfg = Config()
    cfg = replace(cfg, queue=replace(cfg.queue, order=order))  # one tenant: every order keeps arrival order
    registry = Registry(cfg)  # no replicas: everything waits in the LB queue
    d = Dispatcher(registry, cfg, make_policy("round-robin"))
    first = d.ticket()  # request "a" arrived first; its replica then failed
    waits = [asyncio.create_task(d.acquire(RequestFacts(request_id=n, model="m"), lambda v: True))
             for n in ("b", "c")]
    await asyncio.sleep(0)
    waits.append(asyncio.create_task(d.acquire(RequestFacts(request_id="a", model="m"), lambda v: True,
                                               frozenset({"r1"}), first)))
    await asyncio.sleep(0)
    assert [e.facts.request_id for e in d.queue.iter_in_order(0.0)] == ["a", "b", "c"]
    await d.close()
    await asyncio.gather(*waits, return_exceptions=True)
