"""Selective pushing: may the LB push one more request to this target now? (SkyWalker §3.3)

Availability is a pure function of the replica view and the pushing mode; the dispatcher
asks it for every queued request and keeps the request in the LB queue when nothing is
available, so requests wait where their order can still be chosen, not inside an engine.
"""
from __future__ import annotations

from lb.core.types import Pushing, ReplicaView, RequestFacts

# SP-O's fixed cap, and SP-P's cap for servers that report no waiting queue. 32 sits inside
# the 20–50 concurrent chat requests a Llama-3-8B replica on one L4 admits (SkyWalker's
# testbed); set it per fleet from the engine's max running requests.
DEFAULT_MAX_OUTSTANDING = 32

# SP-P pushes to a replica whose last probe showed no pending request, but every push after
# that probe is invisible until the next one. How many unseen pushes it may take is its
# *headroom*, derived from that probe when the engine reports its KV room (SGLang
# `/v1/loads`: free tokens, batch cap): push while the unseen pushes' tokens (prompt plus a
# decode reservation, `push_tokens`) stay under the free KV and their count under the free
# batch slots, so a fast replica with room takes what it can admit without waiting for a
# probe, and a nearly full one takes at most the one request that tips it over. The early
# re-probe after a push (a loopback/LAN round trip) then replaces the estimate with the truth.
# `DEFAULT_MAX_UNSEEN` caps the unseen pushes whatever the room says, so one stale probe can
# never send a whole burst to one replica.
#
# vLLM reports it on `/metrics` (KV usage times `vllm:cache_config_info`'s blocks x block size;
# `loadparse.parse_vllm_metrics`), so it gets the same headroom; an engine that does not report
# its room (llama.cpp, a vLLM whose info gauge says `None`) gets a fixed credit of 4 unseen
# pushes: it bounds the overshoot onto a replica that was one request short of full to 4
# waiting requests (one or two prefill steps), while a burst still drains fast: 100 requests
# onto 4 idle replicas go out 16 at a time, one round per early re-probe, instead of piling
# onto one replica (no credit) or waiting 100 ms per request (credit 1 without early re-probes).
DEFAULT_PUSH_CREDIT = 4
DEFAULT_MAX_UNSEEN = 64
# An engine that does not report its batch cap (vLLM keeps max_num_seqs to itself; llama.cpp
# its slot count) shows it at its probes: requests waiting while most of its KV is free, and
# the count running not growing as answers end, means the batch is full and what runs is
# the cap (`learn_batch_cap`). Seen live on vLLM 0.32 (CPU, --max-num-seqs 4):
# 36 of a 40-request burst waited inside vLLM, "capacity" its reason, at 0.1 % KV usage,
# because a KV room of 524,288 tokens let SP-P push all 40 before a probe came back. Above
# this usage the KV may be what binds (it admits by blocks free), so nothing is learned.
KV_BOUND_USAGE = 0.8
# Until an engine's cap is known (reported, or learned from its probes), the pushes a probe
# has not seen may at most bring what runs there to twice the most it has been seen running
# with none waiting (`ReplicaView.proven_running`), and to this many at first: the first burst
# onto a fresh vLLM teaches the cap instead of landing whole (seen live on vLLM 0.32 with
# --max-num-seqs 4: 36 of a 40-request burst waited inside it before its cap was learned). A
# cap above this is reached by doubling, one round per probe, while the engine is still
# prefilling what it took, and is remembered: later bursts go out at once.
SLOW_START_RUNNING = 8
# A learned cap may be wrong low (above): pushes may go this fraction past it (1 / N, at
# least one request), and the cap grows to what the engine then runs.
LEARNED_CAP_STEP = 8
# An engine that preempts admits past its free KV: vLLM's V1 scheduler admits a waiting request
# when its prompt's blocks fit and preempts a running one when a decode step finds no block,
# so under a full KV it keeps admitting as answers end, and the free KV a probe showed says
# little of what it takes next. Seen on four real vLLM 0.25.1 replicas with 4,096 KV tokens each
# (docs/results.md, twenty-second session): SP-P, one push a probe round there, ran 49 requests
# where blind pushing ran 67, at 0.79x its throughput, its held requests losing their cached
# prefixes; with this floor 0.90x (one round). For such an engine the unseen pushes may reach
# this many whatever the free KV says (the waiting count still closes the gate). Simulated (L4
# engines, 4,096 KV tokens, no decode reservation, 30 ToT clients, 3 seeds): 1 (before) 14.91
# req/s, p90 6.17 s; 4: 15.97, 5.68; 8: 17.01, 4.57; blind 17.06, 5.75. Its cost: where every push
# carries a 2k-token prompt to a replica that preempts (the shared-prefix replay), a saturated
# fleet completes 6 % less.
OVERCOMMIT_UNSEEN = 8
# ...and it may queue, beside the prefix it holds, a request that would otherwise wait in the LB
# for it (`holder_queue_open`, lb.core.scheduler): under a full KV such an engine's waiting count
# is rarely zero (it keeps the requests it preempts there), so SP-P's gate stays shut while the
# engine admits as blocks free, and a tree's children held in the LB for their parent's replica
# lost that prefix before they got there. A request that finds its prefix there needs few new
# blocks and shares them; one that does not still waits in the LB (letting every request queue
# there matched blind pushing on small-prompt trees but cost 9 % on SGLang's shared-prefix
# benchmark, where requests queued at a replica without their system prompt evicted the ones it
# held). The engine's queue stays at most what it runs (at least this many). Measured over four
# engines that admit as vLLM V1 does (docs/results.md, twenty-third session, three interleaved
# rounds each), against holding them in the LB: 30 ToT clients on 4,096 KV tokens 1.07x the
# throughput at 0.91x the TTFT p90 (blind pushing 1.09x, 0.82x); shared-prefix at 1.3x capacity
# 1.09x at 0.72x (blind pushing 0.81x, 1.64x).
# Any engine that reports its KV room queues them too (forty-third session), preempting or not, for
# calls that continue no interaction (a tree's or a conversation's wait here keeps its rank in the
# fair queue; in an engine's queue it would not): held in the LB, such a call waits for its holder
# until its hold's bound and then goes to whichever replica frees a slot, its prefix not there.
# Where the LB queues for long that mixes every replica's prefixes: apps whose popularity moves
# (held-out `hot-shift`, 1,200-token system prompts, 1.3x) ran 16-21 apps a replica, each pinning
# its prompt in the KV, and 40-50 requests where 90 fit, 0.81x llm-d's throughput; queued beside
# their prefix (and `AffinityScheduler.release`), 0.99x. In an engine that admits in arrival order
# they wait behind what queued there before them: chat beside long documents on SGLang as it ships,
# live past capacity, TTFT p50 1.35x what holding them here gave. So a single call joins there only
# while this LB's pushes still prefilling there are on average no longer than it (a document's
# prefill is not ahead of a chat), and only where some replica that could serve it lacks its prefix
# (the scheduler's `_holder_queue`: where every one holds it, one line here drains into whichever
# frees a slot first); live, p50 back to 1.07x (docs/results.md).
OVERCOMMIT_QUEUE = 8
# An engine that orders its waiting queue by the cache (SGLang `--schedule-policy lpm`, the default
# of older releases; `ReplicaView.orders_by_prefix`, read from its /server_info) admits a request
# whose prefix it holds ahead of the requests waiting there without one, so for that request its
# waiting count is no queue: it joins a holder's queue as above, whether or not the engine
# preempts. Held out of SP-P's gate, a chat service's requests (300-token system prompts) waited
# in `lb` or on one holder behind 6,000-token documents the engine would have let them pass:
# long-short at 1.3x capacity, TTFT p90 6.7 s against the hash ring's 4.2; with this and the
# least-queued holder (lb.core.scheduler `_holder_queue`) 3.5 s (docs/results.md, forty-second
# session).
# ...while at most this many wait there: past it SGLang's lpm sorts no more and admits in arrival
# order (schedule_policy.py `_determine_active_policy`: "Turn off the expensive prefix matching and
# sorting when the #queue is large").
LPM_MAX_WAITING = 128
# Decode KV an admitted request is held to need, as engines reserve it at admission (SGLang:
# max_new_tokens times a new-token ratio; the bench engine: `decode_reserve`, 128 for 8B models).
DEFAULT_DECODE_RESERVE = 128


def push_tokens(req: RequestFacts, decode_reserve: int = DEFAULT_DECODE_RESERVE) -> int:
    """KV tokens one push may take on admission: its whole prompt (a cache hit only makes
    room) plus the decode reservation, capped by its max_tokens, for each of its parallel
    samples (they share the prompt's blocks; each answer holds its own)."""
    out = decode_reserve if req.max_tokens is None else min(req.max_tokens, decode_reserve)
    return req.prompt_tokens + max(1, out) * max(1, req.samples)


def has_headroom(view: ReplicaView, *, push_credit: int = DEFAULT_PUSH_CREDIT,
                 max_unseen: int = DEFAULT_MAX_UNSEEN) -> bool:
    """SP-P: no pending request at the last probe, and room for one more unseen push."""
    if view.pending:
        return False
    unseen = view.pushed_since_probe
    if view.kv_free_tokens is None:  # the engine does not say how much room it has
        return unseen < push_credit and not _over_learned_cap(view, unseen)
    if unseen >= max_unseen:
        return False
    if view.max_running is not None and view.running + unseen >= view.max_running:
        return False
    if _over_learned_cap(view, unseen) or _slow_start_full(view, unseen):
        return False
    if view.leased_tokens and view.pushed_tokens_since_probe >= view.kv_free_tokens - view.leased_tokens:
        return False  # what is left is the cache the interactions under way come back for (lb.core.leases)
    floor = OVERCOMMIT_UNSEEN if view.overcommits else 1
    return unseen < floor or view.pushed_tokens_since_probe < view.kv_free_tokens


def holder_queue_open(view: ReplicaView, max_unseen: int = DEFAULT_MAX_UNSEEN,
                      single_prompt: float | None = None) -> bool:
    """May a request whose prefix `view` holds join its engine's own queue, SP-P's gate shut?
    An engine seen to preempt (`OVERCOMMIT_QUEUE` says why) or one that admits the requests whose
    prefix it holds first (`view.orders_by_prefix`: the note under OVERCOMMIT_QUEUE); for a
    single call of `single_prompt` tokens (one that continues no interaction: what waits here
    for it is no rank in the fair queue's interactions, `lb.core.scheduler`) any engine that
    reports its KV room, while none of it is leased to the interactions under way
    (`lb.core.leases`) and this LB's pushes still prefilling there (`view.prefill_ahead`) are on
    average no longer than it: the note under OVERCOMMIT_QUEUE. With what waits there and the
    unseen pushes under what it runs (at least OVERCOMMIT_QUEUE), and, where its order is its
    reason, under LPM_MAX_WAITING."""
    unseen = view.pushed_since_probe
    keeps_queue = view.requeues or view.orders_by_prefix or (
        single_prompt is not None and view.kv_free_tokens is not None and not view.leased_tokens
        and view.prefill_ahead <= single_prompt * max(1, view.prefill_ahead_count))
    if not keeps_queue or not view.healthy or view.draining or unseen >= max_unseen:
        return False
    bound = max(OVERCOMMIT_QUEUE, view.running)
    if view.orders_by_prefix and not view.requeues:
        bound = min(bound, LPM_MAX_WAITING)
    return view.pending + unseen < bound


def note_preemptions(view: ReplicaView, total: float | None, at: float, *, lately: int | None = None,
                     reserves: bool = False) -> None:
    """A probe's preemption counter (None: the engine does not say), the probe sent at `at`.
    Once it has grown the engine is known to keep what it preempts in its own queue
    (`requeues`: `holder_queue_open`), and `preempted_at` says when it last did. A counter that
    went down is a restarted engine: it starts over from there. `lately`: what an engine that
    keeps no total says instead, the requests it preempted in its last stats window (SGLang's
    `/v1/loads` retractions): any is one now.

    `reserves`: the engine reserves KV for the answers it admits (SGLang's new-token ratio; an
    engine that says `lately` is SGLang), so a preemption says its estimate fell short, not
    that the probed free KV undersells what it admits as an engine admitting by prompt blocks
    does (vLLM: `overcommits`, the floor of unseen pushes `OVERCOMMIT_UNSEEN`). That floor on
    SGLang's engines cost throughput where documents and chats share a fleet (docs/results.md)."""
    reserves = reserves or lately is not None
    seen, grown = view.preemptions_seen, bool(lately)
    if total is not None:
        grown = grown or (seen is not None and total > seen)
        view.preemptions_seen = total
    if grown:
        view.requeues = True
        view.overcommits = view.overcommits or not reserves
        view.preempted_at = at


def _slow_start_full(view: ReplicaView, unseen: int) -> bool:
    """No batch cap known yet, and what runs plus the unseen pushes reach twice the most seen
    running with none waiting (SLOW_START_RUNNING at first)."""
    return (view.max_running is None and view.learned_max_running is None
            and view.running + unseen >= max(SLOW_START_RUNNING, 2 * view.proven_running))


def _over_learned_cap(view: ReplicaView, unseen: int) -> bool:
    """An eighth beyond a learned cap (at least one push) is allowed: it waits a step or so if
    the cap is real, and if the engine admits it, the next probe shows more running and the
    cap grows. A cap learned too low corrects itself by an eighth a probe round, not one
    request: vLLM's token budget holds running flat with requests waiting while its prefill is
    the bottleneck (a burst of long prompts on the emulator's vLLM face with a 256-token
    budget taught 6 where 64 may run), and when short prompts follow it may run many more."""
    cap = view.learned_max_running
    if view.max_running is not None or cap is None:
        return False
    past = -(-cap // LEARNED_CAP_STEP)  # an eighth, rounded up: at least one
    return view.running + unseen >= cap + past


def learn_batch_cap(view: ReplicaView, pending: int | None, running: int | None) -> None:
    """Learn, from one probe more, the batch cap of an engine that does not report it: it is
    at least what runs; it is what runs when requests wait beside free KV at two probes with
    the same count running and an answer ended between them (the engine refilled the freed
    slot from its queue instead of adding to what runs). Also the most seen running with
    none waiting, the slow start's ground (`_slow_start_full`).

    One probe is not enough: vLLM admits waiting requests only while its step's token budget
    (max_num_batched_tokens) lasts, so a burst of long prompts waits there for a few steps
    while running grows. Seen live on vLLM 0.32 (CPU, --max-num-batched-tokens 256, 200-token
    prompts, 24 clients): learned from single probes the cap came out 24 while 40 ran at once
    when more were sent."""
    cap = view.learned_max_running
    if not running:
        view.cap_seen = None
        return
    if not pending and running > view.proven_running:
        view.proven_running = running
    if cap is not None and running > cap:
        view.learned_max_running = cap = running
    if not pending or (view.kv_usage is not None and view.kv_usage >= KV_BOUND_USAGE):
        view.cap_seen = None  # nothing waits, or the KV may be what binds: no cap shown
        return
    seen = view.cap_seen
    if seen is None or seen[0] != running:
        view.cap_seen = (running, view.completions)
    elif view.completions > seen[1]:
        view.learned_max_running = running if cap is None else max(cap, running)


def is_available(
    view: ReplicaView,
    mode: Pushing | str,
    *,
    max_outstanding: int = DEFAULT_MAX_OUTSTANDING,
    push_credit: int = DEFAULT_PUSH_CREDIT,
    max_unseen: int = DEFAULT_MAX_UNSEEN,
) -> bool:
    if not view.healthy or view.draining:
        return False
    if mode.__class__ is not Pushing:
        mode = Pushing(mode)
    if mode is Pushing.BLIND:
        return True
    if mode is Pushing.SP_OUTSTANDING or not view.reports_pending:
        # a plain OpenAI server has no waiting queue to probe: LB-side counts are all we know
        return view.outstanding < max_outstanding
    return has_headroom(view, push_credit=push_credit, max_unseen=max_unseen)


# -- what the last probe has not seen (the estimate SP-P's headroom runs on) -----------------

def record_push(view: ReplicaView, tokens: int, now: float, samples: int = 1) -> None:
    """One request sent to `view` now; `tokens`: the KV it may take (`push_tokens`); `samples`:
    the answers it asks for (the API's `n`), each a request in the engine's running and waiting
    counts (SGLang's tokenizer manager and vLLM's parallel sampling fan it out), so each spends
    one of SP-P's unseen pushes. It is unseen by every probe until `settle_probe` says a
    probe's answer includes it."""
    view.outstanding += 1
    view.outstanding_samples += samples
    view.pushed_since_probe += samples
    view.pushed_tokens_since_probe += tokens
    log = view.push_log
    log.append((now, tokens, samples))
    while len(log) > view.outstanding:  # only a push still in flight can be unseen: bounded
        log.popleft()


def probe_gap(view: ReplicaView, interval_s: float, idle_intervals: int, *, health_steady: bool,
              models_known: bool) -> float:
    """How long after a probe started the next one is due. Every `interval_s` while the replica
    has work (this LB's requests on it, or a batch or queue its last probe saw: another LB's or
    a direct client's) or anything about it is in doubt (its health: `HealthTracker.steady`; its
    models, or its engine while `auto` is still undetected), since
    selective pushing decides on what the probes say; every `idle_intervals` intervals while it
    sits idle. At 100 ms an idle `lb` spent 5-6 ms of CPU a second per replica on probes
    (aiohttp's client ~40 % of it, py-spy), a third of a core at 64 replicas before any request.
    An idle replica's view is older, but it says idle, which is true unless another client
    reached it in that gap; the first push to it makes it busy here (`outstanding`), so the next
    probe comes within an interval, or at once where probes are cheap (`Scheduler.wants_probe`).
    The simulator probes on its grid as before: there `lb` is the engines' only client, so an
    idle replica's view cannot go stale and its figures are the same either way."""
    busy = view.outstanding > 0 or view.pending > 0 or view.running > 0
    settled = health_steady and models_known and view.engine != "auto"
    return interval_s if busy or not settled else interval_s * idle_intervals


def early_probe_delay(early_reprobe_s: float, probe_s: float, since_probe_s: float, max_share: float) -> float:
    """How long to wait before an early re-probe: at least `early_reprobe_s` (for the push to
    reach the engine's scheduler), and long enough after the last probe (`probe_s` long, ended
    `since_probe_s` ago) that probing takes at most `max_share` of the replica's time. A probe
    is work for the engine: vLLM 0.32's /metrics page takes 6-9 ms of its API server idle and
    17 ms under load, and early re-probes back to back would spend a third of its time on them."""
    gap = probe_s * (1.0 - max_share) / max_share
    return max(early_reprobe_s, gap - since_probe_s)


def settle_completion(view: ReplicaView, samples: int = 1) -> None:
    """A request on `view` ended (with `samples` answers, each an engine request): the engine
    admits as many it kept waiting into the freed room, so count that many fewer pending until
    the next probe says. Without it SP-P holds back from a replica that has room until a probe
    comes back: on a real vLLM under a batch cap, probed in 17 ms under load, a slot stayed
    empty that long after each answer."""
    view.completions += 1
    view.pending = max(0, view.pending - samples)


def record_direct(view: ReplicaView) -> None:
    """A DIRECT call (lb.core.routes) sent to `view`: in flight, so a drain waits for it, but no
    push SP-P's headroom spends; `settle_end` with one sample gives it back."""
    view.outstanding += 1
    view.outstanding_samples += 1


def pushed_samples(view: ReplicaView, samples: int) -> int:
    """What a push of `samples` parallel samples counted on `view` (`record_push`): each a request
    in a replica's engine; one forward to a peer LB, which counts its own."""
    return 1 if view.engine == "peer" else samples


def settle_end(view: ReplicaView, samples: int = 1) -> None:
    """A request of ours on `view` ended, with `samples` parallel samples (`record_push`): no
    longer in flight there."""
    view.outstanding -= 1
    view.outstanding_samples = max(0, view.outstanding_samples - samples)


def settle_probe(view: ReplicaView, started_at: float, outstanding_at_start: int, load_pending: int | None,
                 load_running: int | None, early_reprobe_s: float, answering_at_start: int = 0,
                 others_at_start: int = 0) -> None:
    """A probe that started at `started_at` answered: set the pushes (and their KV tokens)
    its answer cannot include — the ones sent after it started, plus the ones still on the
    wire. The engine's own count tells the latter: what we had in flight at the start that
    it does not yet hold (running + waiting), but never those whose first token had come
    back by then (`answering_at_start`): the engine has them, or has finished them and the
    LB has not yet relayed their end. Seen live (30 ToT clients, 4 emulated replicas, a
    2-core machine): one probe in eight counted finished answers as pushes on the wire, up
    to 24 of them, 0.1-2.7 s old; the predicted-TTFT scorer then priced their prompts as
    prefill still ahead, and a tree's next calls left the replica holding its prefix. Without
    a running count, pushes younger than `early_reprobe_s` are assumed still on the wire.
    Unseen pushes are the newest ones, so their tokens are the newest tokens.

    Counted as the engine counts, each parallel sample a request (`record_push`):
    `outstanding_at_start` is `view.outstanding_samples` at the start and `answering_at_start`
    the samples of the answers under way then. `others_at_start`: the other LB instances'
    pushes there not answered at the start, as heard (lb.core.instances). The engine's counts
    hold them too: taken for ours, they hid every push of ours still on the wire from the count."""
    log = view.push_log
    while len(log) > view.outstanding:  # only a push still in flight can be unseen
        log.popleft()
    # The log is in push order, so the unseen pushes are a suffix of it: walk it from the end.
    horizon = started_at - early_reprobe_s
    after = wire = 0
    for t, _, _ in reversed(log):
        if t > started_at:
            after += 1
        elif t > horizon and load_running is None:
            wire += 1
        else:
            break
    unseen = _newest(log, after + wire)
    view.pushed_since_probe = sum(log[i][2] for i in unseen)
    if load_running is not None:  # in the engine's count, each parallel sample one
        on_wire = max(0, min(outstanding_at_start + others_at_start - (load_pending or 0) - load_running,
                             outstanding_at_start - answering_at_start))
        view.pushed_since_probe += on_wire
        while on_wire > 0 and unseen.start > 0:  # the pushes before `after` that hold them
            unseen = range(unseen.start - 1, len(log))
            on_wire -= log[unseen.start][2]
    if view.max_running is None:
        learn_batch_cap(view, load_pending, load_running)
    view.pushed_tokens_since_probe = sum(log[i][1] for i in unseen)


def _newest(log, count: int) -> range:
    """The indexes of the `count` newest pushes in the log (all of it, if it holds fewer)."""
    return range(max(0, len(log) - count), len(log))
