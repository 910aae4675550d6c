"""SP-P headroom derived from the last probe's KV room (lb.core.pushing.has_headroom)."""
from __future__ import annotations

from pathlib import Path

from lb.core.pushing import has_headroom, is_available, push_tokens
from lb.core.types import ReplicaView, RequestFacts


def view(**kw) -> ReplicaView:
    return ReplicaView(id="r", url="http://r", **kw)


def test_push_tokens_is_prompt_plus_capped_decode_reservation():
    assert push_tokens(RequestFacts("x", "m", prompt_tokens=200, max_tokens=40)) == 240
    assert push_tokens(RequestFacts("x", "m", prompt_tokens=200)) == 200 + 128
    assert push_tokens(RequestFacts("x", "m", prompt_tokens=200, max_tokens=4096), decode_reserve=64) == 264


def test_a_replica_with_room_takes_more_than_the_fixed_credit():
    v = view(kv_free_tokens=100_000, max_running=256, running=3, pushed_since_probe=20,
             pushed_tokens_since_probe=5000)
    assert has_headroom(v, push_credit=4)
    assert not has_headroom(view(pushed_since_probe=4), push_credit=4)  # no room reported: fixed credit


def test_room_spent_means_wait_for_a_probe():
    v = view(kv_free_tokens=1000, pushed_since_probe=4, pushed_tokens_since_probe=1000)
    assert not has_headroom(v)
    # the first push after a probe always goes when nothing waits: SP-P's own rule
    assert has_headroom(view(kv_free_tokens=0, pushed_since_probe=0))


def test_batch_cap_and_unseen_cap_bound_a_burst():
    assert not has_headroom(view(kv_free_tokens=10**6, max_running=8, running=6, pushed_since_probe=2))
    assert not has_headroom(view(kv_free_tokens=10**6, pushed_since_probe=64), max_unseen=64)
    assert not has_headroom(view(kv_free_tokens=10**6, pending=1))


def test_burst_onto_idle_replicas_fills_each_to_its_room_and_no_further():
    """100 requests of 250 tokens onto 4 idle replicas with room for 8 each: the LB pushes
    at most one request beyond the room (which then waits in the engine), the rest stay."""
    views = [view(kv_free_tokens=2048, max_running=256) for _ in range(4)]
    placed = 0
    for v in views:
        while is_available(v, "sp-pending"):
            v.pushed_since_probe += 1
            v.pushed_tokens_since_probe += 250
            placed += 1
    assert placed == 4 * 9  # 8 fit (2000 tokens), the 9th tips it over


def test_without_a_known_cap_a_burst_goes_out_by_doubling_and_the_most_seen_running_is_remembered():
    """vLLM reports KV room but not its batch cap: the first pushes stop at SLOW_START_RUNNING
    running-plus-unseen; each probe showing them all running (none waiting) doubles the next
    round; a cap learned from a probe with requests waiting takes over."""
    from lb.core.pushing import LEARNED_CAP_STEP, SLOW_START_RUNNING, settle_completion, settle_probe

    v = view(kv_free_tokens=10**6)

    def burst() -> int:
        n = 0
        while has_headroom(v):
            v.pushed_since_probe += 1
            v.outstanding += 1
            n += 1
        return n

    def probe(running: int, waiting: int) -> None:
        v.running, v.pending = running, waiting
        settle_probe(v, started_at=1.0, outstanding_at_start=v.outstanding, load_pending=waiting,
                     load_running=running, early_reprobe_s=0.002)

    assert burst() == SLOW_START_RUNNING
    probe(running=SLOW_START_RUNNING, waiting=0)
    assert v.proven_running == SLOW_START_RUNNING and v.learned_max_running is None
    assert burst() == SLOW_START_RUNNING  # up to twice what it was seen running
    probe(running=2 * SLOW_START_RUNNING, waiting=0)
    assert burst() == 2 * SLOW_START_RUNNING
    probe(running=3 * SLOW_START_RUNNING, waiting=SLOW_START_RUNNING)  # now some wait
    assert v.learned_max_running is None and not has_headroom(v)
    settle_completion(v)  # an answer ends, its slot refilled from the engine's queue: the cap
    probe(running=3 * SLOW_START_RUNNING, waiting=SLOW_START_RUNNING - 1)
    assert v.learned_max_running == 3 * SLOW_START_RUNNING
    assert not has_headroom(v)  # requests wait there
    v.outstanding = 0
    probe(running=0, waiting=0)  # all done; the next burst goes to the cap and an eighth past it at once
    assert burst() == 3 * SLOW_START_RUNNING + 3 * SLOW_START_RUNNING // LEARNED_CAP_STEP


def test_a_reported_cap_needs_no_slow_start():
    from lb.core.pushing import SLOW_START_RUNNING

    v = view(kv_free_tokens=10**6, max_running=256, pushed_since_probe=SLOW_START_RUNNING * 4)
    assert has_headroom(v)
    assert not has_headroom(view(kv_free_tokens=10**6, pushed_since_probe=SLOW_START_RUNNING))


def test_sglang_v1_loads_tells_the_room_and_the_batch_cap():
    import orjson

    from lb.core.loadparse import parse_sglang_v1_loads
    rank = {"num_running_reqs": 3, "num_waiting_reqs": 0, "token_usage": 0.25, "num_used_tokens": 8192,
            "max_total_num_tokens": 32768, "max_running_requests": 48}
    load = parse_sglang_v1_loads(orjson.dumps({"loads": [rank]}))
    assert (load.kv_free_tokens, load.max_running) == (32768 - 8192, 48)
    bare = parse_sglang_v1_loads(orjson.dumps({"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0}]}))
    assert (bare.kv_free_tokens, bare.max_running) == (None, None)


def test_a_batch_cap_the_engine_keeps_to_itself_is_learned_from_requests_waiting_beside_free_kv():
    """vLLM reports no max_num_seqs: probes showing requests waiting at low KV usage, with the
    same count running after an answer ended, say the batch is full at what runs. Seen live:
    vLLM 0.32 with --max-num-seqs 4 reported 4 running, 36 waiting at 0.1 % KV usage."""
    from lb.core.pushing import learn_batch_cap, settle_completion

    def learned(*probes, kv_usage: float | None = 0.001, cap: int | None = None, answers_between: int = 1):
        v = view(kv_usage=kv_usage, learned_max_running=cap)
        for i, (pending, running) in enumerate(probes):
            if i:
                for _ in range(answers_between):
                    settle_completion(v)
            learn_batch_cap(v, pending, running)
        return v.learned_max_running

    assert learned((36, 4), (33, 4)) == 4
    assert learned((36, 4)) is None  # one probe: it may be admitting them a few a step
    assert learned((36, 4), (33, 4), answers_between=0) is None  # no answer ended: maybe the same step
    assert learned((30, 10), (22, 18), (14, 26)) is None  # running grows: a token budget, not a cap
    assert learned((0, 4), (0, 4)) is None  # nothing waits: no cap shown
    assert learned((5, 30), (5, 30), kv_usage=0.95) is None  # the KV may be what binds
    assert learned((3, 2), (3, 2), cap=4) == 4  # a passing moment does not lower it
    assert learned((0, 6), cap=4) == 6  # it admitted more: at least that
    assert learned((2, 3), (1, 3), kv_usage=None) == 3  # llama.cpp: slots full, no KV figure


def test_a_large_learned_cap_lets_an_eighth_past_it():
    from lb.core.pushing import LEARNED_CAP_STEP

    big = dict(kv_free_tokens=500_000, running=64, learned_max_running=64)
    past = 64 // LEARNED_CAP_STEP
    assert has_headroom(view(**big, pushed_since_probe=past - 1))
    assert not has_headroom(view(**big, pushed_since_probe=past))


def test_a_learned_cap_lets_one_push_past_it_and_a_reported_cap_wins():
    full = dict(kv_free_tokens=500_000, running=4, learned_max_running=4)
    assert has_headroom(view(**full, pushed_since_probe=0))  # one beyond: the engine may have grown
    assert not has_headroom(view(**full, pushed_since_probe=1))
    assert has_headroom(view(**{**full, "running": 2}, pushed_since_probe=2))
    assert not has_headroom(view(**{**full, "running": 2}, pushed_since_probe=3))
    # an engine that reports its cap is taken at its word
    assert has_headroom(view(kv_free_tokens=500_000, running=4, max_running=8, learned_max_running=4,
                             pushed_since_probe=3))
    # the fixed credit (no KV figure) is bounded by a learned cap too
    assert not has_headroom(view(running=2, learned_max_running=2, pushed_since_probe=1), push_credit=4)


def test_settling_a_probe_learns_the_cap_only_where_the_engine_does_not_report_one():
    from lb.core.pushing import settle_completion, settle_probe

    vllm = view(kv_free_tokens=500_000, kv_usage=0.001, pending=36, running=4)
    sglang = view(kv_free_tokens=500_000, kv_usage=0.001, pending=36, running=4, max_running=48)
    for v in (vllm, sglang):
        settle_probe(v, 1.0, 0, 36, 4, 0.002)
        settle_completion(v)
        settle_probe(v, 1.1, 0, 35, 4, 0.002)
    assert vllm.learned_max_running == 4
    assert sglang.learned_max_running is None


def test_an_answer_that_ends_lets_one_waiting_request_in_before_the_next_probe():
    """The engine admits a waiting request into the room an answer frees: SP-P counts one fewer
    pending at once instead of holding back until a probe says so (on a real vLLM under its
    batch cap a probe took 17 ms under load, and a slot stayed empty that long)."""
    from lb.core.pushing import settle_completion

    v = view(kv_free_tokens=500_000, running=4, learned_max_running=4, pending=1, outstanding=5)
    assert not has_headroom(v)
    settle_completion(v)
    assert v.pending == 0 and has_headroom(v)
    settle_completion(v)
    assert v.pending == 0  # never below zero


def test_early_probes_keep_probing_under_a_share_of_the_replicas_time():
    from lb.core.pushing import early_probe_delay

    # a cheap probe (the emulator, SGLang's /v1/loads): the early re-probe delay is all
    assert early_probe_delay(0.002, probe_s=0.0005, since_probe_s=0.0, max_share=0.25) == 0.002
    # vLLM's /metrics under load (17 ms): at most a quarter of its time goes to probes
    assert abs(early_probe_delay(0.002, probe_s=0.017, since_probe_s=0.0, max_share=0.25) - 0.051) < 1e-9
    # time already passed since that probe counts toward the gap
    assert abs(early_probe_delay(0.002, probe_s=0.017, since_probe_s=0.040, max_share=0.25) - 0.011) < 1e-9
    assert early_probe_delay(0.002, probe_s=0.017, since_probe_s=1.0, max_share=0.25) == 0.002


def test_answers_the_engine_finished_before_the_lb_heard_their_end_are_not_on_the_wire():
    """A probe counts what the engine holds; the LB's in-flight requests it does not count are
    on their way there, unless their first token already came back: those the engine has, or
    has finished while their tail is still relayed (seen live: one probe in eight counted up
    to 24 finished answers, 0.1-2.7 s old, as pushes on the wire)."""
    from lb.core.pushing import record_push, settle_probe

    v = view(kv_free_tokens=10**6)
    for i in range(10):
        record_push(v, 300, 1.0 + i * 0.1)  # ten pushes, long before the probe
    # the engine finished eight whose ends the LB has not relayed yet; two still run
    settle_probe(v, 3.0, 10, load_pending=0, load_running=2, early_reprobe_s=0.002, answering_at_start=10)
    assert v.pushed_since_probe == 0 and v.pushed_tokens_since_probe == 0
    # one of them had no first token back yet: it may still be on its way
    settle_probe(v, 3.1, 10, load_pending=0, load_running=2, early_reprobe_s=0.002, answering_at_start=9)
    assert v.pushed_since_probe == 1 and v.pushed_tokens_since_probe == 300
    # a caller that cannot tell (no first tokens known): every push the engine does not hold
    settle_probe(v, 3.2, 10, load_pending=0, load_running=2, early_reprobe_s=0.002)
    assert v.pushed_since_probe == 8


def test_an_engine_seen_to_preempt_takes_a_floor_of_unseen_pushes_whatever_its_free_kv():
    """vLLM admits by prompt blocks and preempts when decode runs out, so under a full KV the
    probed free KV undersells what it takes: once its preemption counter grows, the unseen
    pushes may reach OVERCOMMIT_UNSEEN; the waiting count still closes the gate."""
    from lb.core.pushing import OVERCOMMIT_UNSEEN, note_preemptions

    v = view(kv_free_tokens=300, kv_total_tokens=4096)

    def pushes() -> int:
        n = 0
        while has_headroom(v) and n < 100:
            v.pushed_since_probe += 1
            v.pushed_tokens_since_probe += 488
            n += 1
        v.pushed_since_probe = v.pushed_tokens_since_probe = 0
        return n

    assert pushes() == 1  # the first after a probe, then the free KV is spent
    note_preemptions(v, 12.0, 1.0)  # the first reading: nothing to compare with yet
    assert not v.overcommits and pushes() == 1
    note_preemptions(v, None, 2.0)  # an engine that does not say changes nothing
    note_preemptions(v, 12.0, 3.0)
    assert not v.overcommits and v.preempted_at is None
    note_preemptions(v, 15.0, 4.0)
    assert v.preempted_at == 4.0  # when the probe that saw it grow was sent
    assert v.overcommits and v.requeues and pushes() == OVERCOMMIT_UNSEEN
    v.kv_free_tokens, v.max_running = 100_000, 256  # room beyond the floor still counts
    assert pushes() > OVERCOMMIT_UNSEEN
    v.kv_free_tokens, v.pending = 300, 1
    assert pushes() == 0
    note_preemptions(v, 2.0, 5.0)  # a restarted engine: counted from its new start, still one that preempts
    assert v.preemptions_seen == 2.0 and v.overcommits and v.preempted_at == 4.0


def test_an_engine_that_says_it_preempted_lately_is_marked_at_each_probe_that_says_so():
    """SGLang keeps no total on /v1/loads: it says how many it retracted in its last stats
    window. Any is a preemption now; none leaves the last time as it was. SGLang reserves KV
    for the answers it admits, so a retraction opens its holder's queue and ends holds for it,
    but gives no floor of unseen pushes: its probed free KV does not undersell what it admits."""
    from lb.core.pushing import OVERCOMMIT_UNSEEN, note_preemptions

    v = view(kv_free_tokens=300, kv_total_tokens=4096)
    note_preemptions(v, None, 1.0, lately=0, reserves=True)
    assert not v.requeues and v.preempted_at is None
    note_preemptions(v, None, 2.0, lately=3)  # a window is SGLang's: it reserves
    assert v.requeues and not v.overcommits and v.preempted_at == 2.0
    note_preemptions(v, None, 2.1, lately=3, reserves=True)  # the same window seen again: still lately
    assert v.preempted_at == 2.1
    note_preemptions(v, None, 3.0, lately=0, reserves=True)
    assert v.requeues and v.preempted_at == 2.1
    n = 0
    while has_headroom(v) and n < 100:
        v.pushed_since_probe += 1
        v.pushed_tokens_since_probe += 488
        n += 1
    assert n == 1 < OVERCOMMIT_UNSEEN  # the first after a probe, then its free KV is spent
    note_preemptions(v, 5.0, 4.0, reserves=True)  # SGLang's /metrics counter: the same reading
    note_preemptions(v, 7.0, 5.0, reserves=True)
    assert v.preempted_at == 5.0 and not v.overcommits


def test_parallel_samples_reserve_an_answer_each_and_spend_a_push_each():
    """An engine runs each of a request's `n` samples as a request (SGLang's tokenizer manager and
    vLLM fan it out) beside the one prompt: its KV and its batch slots are n answers'."""
    from lb.core.pushing import record_push, settle_completion, settle_probe

    assert push_tokens(RequestFacts("x", "m", prompt_tokens=200, max_tokens=40, samples=4)) == 200 + 4 * 40
    v = view(kv_free_tokens=100_000, running=0, max_running=4)
    record_push(v, 360, now=1.0, samples=4)
    assert v.pushed_since_probe == 4 and v.outstanding == 1
    assert not has_headroom(v)  # the batch of four is full though one request was pushed
    # a probe that started before the push cannot include it: its four samples stay unseen
    settle_probe(v, started_at=0.9, outstanding_at_start=0, load_pending=0, load_running=0, early_reprobe_s=0.002)
    assert v.pushed_since_probe == 4 and v.pushed_tokens_since_probe == 360
    # one that started after holds them: none unseen
    settle_probe(v, started_at=1.1, outstanding_at_start=1, load_pending=0, load_running=4, early_reprobe_s=0.002)
    assert v.pushed_since_probe == 0
    v.pending = 6
    settle_completion(v, samples=4)  # its four slots freed: four waiting ones go in
    assert v.pending == 2


def test_a_probe_finds_a_push_of_samples_still_on_the_wire_by_the_engine_s_own_count():
    """The engine counts each parallel sample as a request: what we have in flight is compared
    with its counts sample for sample. Compared request for request, 3 in flight against 9
    running said nothing was on the wire, and the 4 samples still on their way spent no headroom."""
    from lb.core.pushing import record_push, settle_end, settle_probe

    v = view(kv_free_tokens=100_000, max_running=64)
    record_push(v, 900, now=1.0, samples=8)  # answering: the engine runs its 8 samples
    record_push(v, 120, now=1.0)  # answering too
    record_push(v, 480, now=1.5, samples=4)  # still on the wire when the probe starts
    assert v.outstanding == 3 and v.outstanding_samples == 13
    settle_probe(v, started_at=2.0, outstanding_at_start=v.outstanding_samples, load_pending=0, load_running=9,
                 early_reprobe_s=0.002, answering_at_start=9)
    assert v.pushed_since_probe == 4 and v.pushed_tokens_since_probe == 480
    settle_end(v, samples=8)
    assert v.outstanding == 2 and v.outstanding_samples == 5
