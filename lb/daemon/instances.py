"""Several LBs per region: each instance tells the others, through the shared Redis store, of
every push it makes to a replica, so SP-P's headroom is not spent twice, and of the prefix it
sent there, so every instance's prefix trie holds the region's history (lb.core.instances).

A push is published on the channel `PREFIX pushes` as [instance, replica id, wall time, KV
tokens, prefix chain, request id, prompt tokens, interaction, the answered prompt end it
continues, and its LoRA adapter where it has one], and its answer as ["end", instance, replica
id, request id, the prompt's last block, answer tokens] (where a conversation's next turn finds
its history) and, for a call of
an interaction, ["lease", instance, replica id, interaction, leased tokens, lease seconds, the
prompt's end, its size when shorter than a block, user, and the fair queue's anchor where it
keeps one] (the KV lease, and how a next call
without headers is known: every instance holds the leases and recognizes the interactions as
one LB would), by a sender task (a bounded queue: the request path never waits on
Redis); a subscriber counts the others' pushes as unseen on the replica's view until their
answer or one of our probes includes them, and each of our probes re-counts the ones it
cannot include. On with `[state] backend = "redis"` (turn off with
`share_pushes = false`). Replicas are matched by id, so give every instance the same replica
set (the same config, or the same discovery).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time

import orjson

from lb.core.continuations import CONTINUED
from lb.core.instances import (HeardEnd, HeardLease, encode_chain, end_message, heard_answer, heard_interaction,
                               heard_lease, heard_prefill, lease_message, note_remote_end, note_remote_push,
                               parse_message, push_message, remote_unseen)
from lb.core.leases import ANSWERED, lease_key
from lb.core.prefix import request_chain
from lb.core.pushing import push_tokens

log = logging.getLogger("lb.instances")
MAX_UNSENT = 10_000  # pushes waiting to be published; beyond, new ones are dropped (and counted)


class SharedPushes:
    def __init__(self, state: dict, registry, dispatcher, prober):
        self.url = state.get("url", "redis://127.0.0.1:6379/0")
        self.channel = state.get("prefix", "lb:") + "pushes"
        self.id = secrets.token_hex(8)
        self.registry = registry
        self.policy = dispatcher.policy
        self.leases = dispatcher.scheduler.leases  # the interactions' leases and how calls continue
        self.queue = dispatcher.scheduler.queue  # the rank each interaction keeps there
        self.backlog = dispatcher.scheduler.backlog  # the first tokens an engine counts for both of us
        self.adapters = dispatcher.scheduler.adapters  # the LoRA adapters each replica's batch runs
        self.probe_started: dict[str, float] = {}  # replica id -> our last answered probe's start, wall clock
        self.unsent: asyncio.Queue = asyncio.Queue(MAX_UNSENT)
        self.dropped = 0
        self.received = 0
        self.tasks: list[asyncio.Task] = []
        self.redis = None
        dispatcher.on_dispatch.append(self.pushed)
        dispatcher.on_complete.append(self.answered)
        registry.on_gone(lambda rep: self.probe_started.pop(rep.id, None))
        prober.on_probe.append(self.probed)

    async def start(self) -> None:
        import redis.asyncio as aioredis  # the `redis` extra, needed for the redis state backend anyway

        self.redis = aioredis.from_url(self.url)
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._send(), name="pushes-send"),
                      loop.create_task(self._listen(), name="pushes-listen")]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.redis is not None:
            await self.redis.aclose()

    # -- our side ------------------------------------------------------------------------
    def pushed(self, facts, rep, waited: float, now: float) -> None:
        """The dispatcher's on_dispatch: one push of ours, to be published."""
        mem = self.policy.prefix_memory  # the prefix-trie policies: share where this prefix went
        chain = encode_chain(request_chain(facts, mem.block_chars, mem.isolate_tenants)) if mem is not None else ""
        self._publish(push_message(self.id, rep.id, time.time(), push_tokens(facts), chain, facts.request_id,
                                   facts.prompt_tokens, lease_key(facts) or "", facts.extra.get(CONTINUED, b""),
                                   facts.adapter or ""))

    def answered(self, facts, rep, out, now: float) -> None:
        """The dispatcher's on_complete: the replica is done with our push, tell the others,
        with where its answer sits (the prompt's last block), as the scheduler records it."""
        mem, tokens = self.policy.prefix_memory, out.answer_tokens()
        end = mem.prompt_end(facts) if mem is not None and tokens else b""
        self._publish(end_message(self.id, rep.id, facts.request_id, end, tokens))
        answered = facts.extra.get(ANSWERED)  # what the scheduler leased there, and the prompt's end
        if answered is not None:
            message = lease_message(self.id, rep.id, answered, self.queue.anchor(answered.key))  # and its rank
            if message is not None:
                self._publish(message)

    def _publish(self, message: list) -> None:
        try:
            self.unsent.put_nowait(message)
        except asyncio.QueueFull:
            self.dropped += 1

    def probed(self, rep, load, started_mono: float) -> None:
        """The prober's on_probe (after lb.core.pushing.settle_probe set our own unseen pushes):
        add the others' pushes this probe cannot include."""
        started = time.time() - (time.monotonic() - started_mono)
        self.probe_started[rep.id] = started
        n, tokens, prefill = remote_unseen(rep.view.remote_log, started)
        rep.view.pushed_since_probe += n
        rep.view.pushed_tokens_since_probe += tokens
        rep.view.remote_since_probe = n
        rep.view.remote_prefill_since_probe = prefill
        self.adapters.prune_remote(rep.id, {key for _, _, key, _ in rep.view.remote_log})

    async def _send(self) -> None:
        while True:
            batch = [await self.unsent.get()]
            while not self.unsent.empty() and len(batch) < 256:
                batch.append(self.unsent.get_nowait())
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for message in batch:
                        pipe.publish(self.channel, orjson.dumps(message))
                    await pipe.execute()
            except Exception as e:  # Redis away: each instance still counts its own pushes
                log.warning("could not publish %d pushes to the other instances: %s: %s", len(batch),
                            type(e).__name__, e)
                await asyncio.sleep(1.0)

    # -- theirs --------------------------------------------------------------------------
    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(self.channel)
                async for msg in pubsub.listen():
                    if msg.get("type") == "message":
                        self._heard(msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("lost the other instances' pushes channel: %s: %s; resubscribing", type(e).__name__, e)
                await asyncio.sleep(1.0)

    def _heard(self, data: bytes) -> None:
        try:
            heard = parse_message(orjson.loads(data))
        except orjson.JSONDecodeError:
            return
        if heard is None or heard.sender == self.id:
            return
        rep = self.registry.replicas.get(heard.replica)
        if rep is None:
            return
        self.received += 1
        log, probe_started = rep.view.remote_log, self.probe_started.get(rep.id)
        mem = self.policy.prefix_memory  # the other instance sent this prefix there: so would we now
        if isinstance(heard, HeardEnd):
            known = note_remote_end(rep.view, log, heard.key, probe_started)
            self.backlog.remote_ended(heard.key, rep.id)
            self.adapters.ended(heard.key)
            if mem is not None:
                heard_answer(mem.trie, heard)
            if known:  # as one LB would on its own answer's end: the room it freed, seen at once
                self.registry.ended(rep)
            return
        if isinstance(heard, HeardLease):
            heard_lease(self.leases, self.queue, heard, time.monotonic())
            return
        heard_interaction(self.leases, heard, time.monotonic())
        prefill = heard_prefill(mem.trie, heard, time.monotonic()) if mem is not None else float(heard.prompt_tokens)
        note_remote_push(rep.view, log, heard.at, heard.tokens, probe_started, heard.key, prefill)
        self.backlog.remote_placed(heard.key, rep.id, prefill, rep.view.engine_first_tokens)
        if heard.adapter and heard.key:  # its adapter takes a slot there until its end is heard
            self.adapters.placed(heard.key, rep.id, heard.adapter, remote=True)
