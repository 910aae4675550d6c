"""The engine model in virtual time: admission, KV growth, preemption, prefix cache, timing."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from bench.engine import DECODE_LOG_INTERVAL, Engine, EngineRequest, StepResult
from bench.profiles import PROFILES, get_profile
from bench.tokenizer import decode, encode, filler_text, render_chat

TINY = get_profile("tiny")


def prompt(n: int, key: int) -> list[int]:
    return encode(filler_text(n, key))


def run_until_idle(engine: Engine, now: float = 0.0, limit: int = 100_000) -> tuple[float, list[StepResult]]:
    steps = []
    for _ in range(limit):
        t = engine.next_event_time(now)
        if t is None:
            return now, steps
        r = engine.step(t)
        steps.append(r)
        now = r.end
    raise AssertionError("engine did not go idle")


def outputs(steps: list[StepResult]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in steps:
        for rid, tok in s.tokens.items():
            out.setdefault(rid, []).append(tok)
    return out


def test_idle_engine_has_no_next_event():
    e = Engine(TINY)
    assert e.next_event_time(5.0) is None
    e.submit(EngineRequest("a", prompt(10, 1), 3, ignore_eos=True), 5.0)
    assert e.next_event_time(5.0) == 5.0
    end, steps = run_until_idle(e, 5.0)
    assert e.next_event_time(end) is None
    assert [len(s.tokens) for s in steps] == [1, 1, 1]
    assert steps[-1].finished[0].output_tokens == 3 and steps[-1].finished[0].reason == "length"


def test_waiting_exactly_when_kv_cannot_take_the_prompt():
    p = replace(TINY, decode_reserve=0)  # admission = prompt tokens fit in free KV
    e = Engine(p)
    for i in range(4):  # 4 × 450 = 1800 of 2048 tokens; outputs stay within the rest
        e.submit(EngineRequest(f"r{i}", prompt(450, i), 20, ignore_eos=True), 0.0)
    e.step(0.0)
    load = e.load()
    assert (load.num_running, load.num_waiting) == (4, 0)
    assert load.kv_used_tokens == 1800 + load.counters.generation_tokens  # prompts + outputs
    e.submit(EngineRequest("small", prompt(40, 9), 2, ignore_eos=True), 0.0)
    e.step(1.0)
    assert e.load().num_waiting == 0  # 40 tokens still fit
    e.submit(EngineRequest("big", prompt(200, 10), 2, ignore_eos=True), 1.0)
    before = e.load()  # 5 running: each holds back its next token
    assert before.kv_total_tokens - before.kv_used_tokens - 5 < 200 + 1
    e.step(2.0)
    assert e.load().num_waiting == 1 and e.is_waiting("big")
    after = e.load()  # "small" finished in that step: now 200 + 1 fit beside 4 × 1
    assert after.kv_total_tokens - after.kv_used_tokens - 4 >= 200 + 1
    e.step(3.0)
    assert e.load().num_waiting == 0
    now, _ = run_until_idle(e, 3.0)
    assert e.load().counters.requests == 6 and e.load().counters.preemptions == 0


def test_decode_reservation_holds_back_admission():
    e = Engine(replace(TINY, decode_reserve=200))
    for i in range(4):  # each needs 400 + 200 reserved: only 3 fit in 2048
        e.submit(EngineRequest(f"r{i}", prompt(400, i), 300, ignore_eos=True), 0.0)
    e.step(0.0)
    assert (e.load().num_running, e.load().num_waiting) == (3, 1)


def test_max_running_caps_the_batch():
    e = Engine(replace(TINY, max_running=2))
    for i in range(3):
        e.submit(EngineRequest(f"r{i}", prompt(20, i), 5, ignore_eos=True), 0.0)
    e.step(0.0)
    assert (e.load().num_running, e.load().num_waiting) == (2, 1)


def test_admitting_within_the_step_budget_keeps_a_burst_of_long_prompts_waiting_while_running_grows():
    """vLLM's V1 scheduler admits waiting requests only while the step's token budget lasts:
    8 prompts of ~300 tokens against a 256-token budget go in one or two a step, with the
    batch far from full and the KV nearly empty; admitted at once they all run in step one."""
    def burst(within: bool) -> list[tuple[int, int]]:
        e = Engine(replace(TINY, prefill_budget=256, max_running=64, kv_tokens=100_000, admit_within_budget=within))
        for i in range(8):
            e.submit(EngineRequest(f"r{i}", prompt(300, i), 4, ignore_eos=True), 0.0)
        seen, now = [], 0.0
        for _ in range(4):
            now = e.step(now).end
            seen.append((e.load().num_running, e.load().num_waiting))
        return seen

    within = burst(True)
    assert within[0][1] > 0 and within[0][0] <= 2, within  # budget spent by the first prompt(s)
    assert [r for r, _ in within] == sorted(r for r, _ in within) and within[-1][0] > within[0][0], within
    assert burst(False)[0] == (8, 0)


def test_kv_exhaustion_preempts_the_newest_and_everything_still_finishes():
    e = Engine(replace(TINY, decode_reserve=0))
    for i in range(4):  # prompts fit (4 × 450), their outputs (4 × 300) do not
        e.submit(EngineRequest(f"r{i}", prompt(450, i), 300, ignore_eos=True), float(i) * 1e-3)
    _, steps = run_until_idle(e)
    preempted = [rid for s in steps for rid in s.preempted]
    assert preempted and preempted[0] == "r3"  # the newest goes first
    out = outputs(steps)
    assert all(len(out[f"r{i}"]) == 300 for i in range(4))  # recompute resumes, no loss
    assert e.load().counters.preemptions == len(preempted)
    assert e.load().kv_used_tokens == 0
    # the TTFT histogram counts each request's first token once, a recompute's again not at all,
    # each from its arrival to the end of the step that emitted it
    firsts = {}
    for st in steps:
        for rid in st.tokens:
            firsts.setdefault(rid, st.end)
    c = e.load().counters
    assert c.ttfts == 4 and c.ttft_total_s == pytest.approx(sum(firsts[f"r{i}"] - i * 1e-3 for i in range(4)))
    assert sum(c.ttft_buckets) == 4


def test_lowest_priority_is_preempted_first_and_admitted_first_when_high():
    e = Engine(replace(TINY, decode_reserve=0))
    e.submit(EngineRequest("low", prompt(600, 1), 500, ignore_eos=True, priority=0), 0.0)
    e.submit(EngineRequest("high", prompt(600, 2), 500, ignore_eos=True, priority=5), 0.0)
    first = e.step(0.0)
    e.submit(EngineRequest("w-low", prompt(900, 3), 5, ignore_eos=True, priority=0), 0.0)
    e.submit(EngineRequest("w-high", prompt(900, 4), 5, ignore_eos=True, priority=9), 0.0)
    _, steps = run_until_idle(e, first.end)
    steps.insert(0, first)
    preempted = [rid for s in steps for rid in s.preempted]
    assert "high" not in preempted and "low" in preempted
    first_token = {}
    for i, s in enumerate(steps):
        for rid in s.tokens:
            first_token.setdefault(rid, i)
    assert first_token["w-high"] < first_token["w-low"]
    assert all(len(v) == 500 for k, v in outputs(steps).items() if k in ("low", "high"))


def test_repeated_prefix_is_served_from_cache():
    e = Engine(TINY)
    shared = prompt(320, 7)
    e.submit(EngineRequest("a", shared + prompt(10, 1), 4, ignore_eos=True), 0.0)
    now, steps = run_until_idle(e)
    assert steps[-1].finished[0].cached_tokens == 0
    e.submit(EngineRequest("b", shared + prompt(30, 2), 4, ignore_eos=True), now)
    now, steps = run_until_idle(e, now)
    fin = steps[-1].finished[0]
    assert fin.cached_tokens == 320  # 20 full blocks of the shared prefix
    assert steps[0].prefill_tokens == fin.prompt_tokens - 320
    c = e.load().counters
    assert c.cached_tokens == 320 and c.prefix_hits == 320 and c.prefix_queries == 330 + 350
    # the whole conversation (prompt + output) is cached: a follow-up turn hits all of it
    turn2 = shared + prompt(30, 2) + outputs(steps)["b"] + prompt(20, 3)
    e.submit(EngineRequest("c", turn2, 2, ignore_eos=True), now)
    _, steps = run_until_idle(e, now)
    assert steps[-1].finished[0].cached_tokens == (len(shared) + 30 + 4) // 16 * 16


def test_siblings_scheduled_together_compute_their_shared_prefix_once():
    """vLLM v1 caches a chunk's full blocks as it schedules them, so requests sent at once
    with a shared prefix (a tree's branches) prefill it once, in the same step."""
    e = Engine(TINY)
    shared = prompt(320, 7)
    for i in range(4):
        e.submit(EngineRequest(f"s{i}", shared + prompt(20, i), 2, ignore_eos=True), 0.0)
    first = e.step(0.0)
    assert first.prefill_tokens == 320 + 4 * 20  # not 4 × 340
    assert set(first.tokens) == {"s0", "s1", "s2", "s3"}  # every one's first token in that step
    _, steps = run_until_idle(e, first.end)
    cached = {f.id: f.cached_tokens for s in steps for f in s.finished}
    assert cached == {"s0": 0, "s1": 320, "s2": 320, "s3": 320}
    c = e.load().counters
    assert c.cached_tokens == c.prefix_hits == 3 * 320
    assert e.load().kv_used_tokens == 0


def test_a_sibling_arriving_mid_prefill_shares_what_is_scheduled_before_it():
    """A long prompt prefilled in chunks publishes each chunk's blocks as it is scheduled; a
    sibling arriving meanwhile is scheduled after that chunk in the next step, finds every
    block by then, and computes only its own suffix."""
    e = Engine(TINY)  # prefill budget 1024 tokens per step
    shared = prompt(1200, 5)
    e.submit(EngineRequest("long", shared + prompt(8, 1), 1, ignore_eos=True), 0.0)
    first = e.step(0.0)
    assert first.prefill_tokens == 1024 and not first.tokens
    e.submit(EngineRequest("late", shared + prompt(8, 2), 1, ignore_eos=True), first.end)
    _, steps = run_until_idle(e, first.end)
    assert steps[0].prefill_tokens == (1208 - 1024) + 8 and set(steps[0].tokens) == {"long", "late"}
    cached = {f.id: f.cached_tokens for s in steps for f in s.finished}
    assert cached == {"long": 0, "late": 1200}  # 1,024 found at arrival, the rest scheduled before it
    assert e.load().kv_used_tokens == 0


def test_fully_cached_prompt_still_computes_its_last_token():
    e = Engine(TINY)
    p = prompt(64, 3)
    e.submit(EngineRequest("a", p, 1, ignore_eos=True), 0.0)
    now, _ = run_until_idle(e)
    e.submit(EngineRequest("b", p, 1, ignore_eos=True), now)
    _, steps = run_until_idle(e, now)
    assert steps[0].prefill_tokens == 16 and steps[-1].finished[0].cached_tokens == 48


def test_lru_evicts_the_least_recently_used_prefix():
    e = Engine(replace(TINY, decode_reserve=0))
    a, b = prompt(640, 1), prompt(640, 2)
    now = 0.0
    for rid, p in (("a", a), ("b", b), ("a2", a)):  # a is used again after b
        e.submit(EngineRequest(rid, p, 1, ignore_eos=True), now)
        now, _ = run_until_idle(e, now)
    assert e.load().cache_tokens == 1280 and e.load().kv_used_tokens == 0
    e.submit(EngineRequest("c", prompt(900, 3), 1, ignore_eos=True), now)  # forces eviction
    run_until_idle(e, now)
    cached = {name: len(e.cache.match(e.cache.block_keys(p, [], len(p) // 16)))
              for name, p in (("a", a), ("b", b))}
    assert cached["a"] == 40 and 0 <= cached["b"] < 40  # b's tail went first, a is whole


def test_abort_frees_kv_and_unblocks_waiting():
    e = Engine(replace(TINY, decode_reserve=0))
    e.submit(EngineRequest("hog", prompt(1500, 1), 400, ignore_eos=True), 0.0)
    e.submit(EngineRequest("next", prompt(900, 2), 5, ignore_eos=True), 0.0)
    e.step(0.0)
    assert e.is_waiting("next")
    assert e.abort("hog", 0.5) and not e.abort("hog", 0.5)
    load = e.load()  # the freed KV admits the waiting request at once
    assert load.kv_used_tokens == 900
    assert (load.num_running, load.num_waiting, load.counters.aborted) == (1, 0, 1)
    assert e.abort("next", 1.5) and e.load().num_running == 0
    assert e.flush_cache() and e.load().cache_tokens == 0


def test_flush_refused_while_busy():
    e = Engine(TINY)
    e.submit(EngineRequest("a", prompt(40, 1), 5), 0.0)
    assert not e.flush_cache()


def test_step_time_follows_the_profile():
    p = get_profile("l4-llama3-8b")
    e = Engine(p)
    e.submit(EngineRequest("a", prompt(512, 1), 2, ignore_eos=True), 0.0)
    first = e.step(0.0)
    assert first.prefill_tokens == 512 and 0.25 < first.duration < 0.35  # SkyWalker: ~300 ms
    second = e.step(first.end)
    assert second.decode_seqs == 1 and second.duration == pytest.approx(
        p.step_base_s + p.decode_seq_s + p.context_token_s * 513)  # reads 512 + 1, emits the 2nd
    big = Engine(p)
    big.submit(EngineRequest("b", prompt(5000, 2), 1, ignore_eos=True), 0.0)
    _, steps = run_until_idle(big)
    assert [s.prefill_tokens for s in steps] == [2048, 2048, 904]  # chunked prefill


def test_outputs_are_deterministic_and_bounded():
    def run(seed: int) -> dict[str, list[int]]:
        e = Engine(TINY, seed=seed)
        for i in range(6):
            e.submit(EngineRequest(f"r{i}", prompt(50, i), 60), 0.0)
        return outputs(run_until_idle(e)[1])

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    assert all(1 <= len(v) <= 60 for v in a.values())
    assert len({len(v) for v in a.values()}) > 1  # a distribution, not a constant
    assert all(decode(v) for v in a.values())


def test_duplicate_and_oversized_requests_are_rejected():
    e = Engine(TINY)
    e.submit(EngineRequest("a", prompt(10, 1), 5), 0.0)
    with pytest.raises(ValueError):
        e.submit(EngineRequest("a", prompt(10, 1), 5), 0.0)
    with pytest.raises(ValueError):
        e.submit(EngineRequest("b", prompt(2000, 1), 100), 0.0)


def test_every_profile_states_its_source():
    for p in PROFILES.values():
        assert p.source and p.kv_tokens > 0 and p.step_base_s > 0


# ---- tokenizer ------------------------------------------------------------------------------

words = st.text(alphabet=st.sampled_from(list("abcdefghij XYZ0123.,!?_\n")), max_size=80)


@settings(max_examples=200, deadline=None)
@given(words, words)
def test_tokens_of_a_prefix_are_a_prefix(a: str, b: str):
    whole = encode(a + b)
    head = encode(a)
    assert whole[:max(0, len(head) - 1)] == head[:-1]
    # at a piece boundary (a space before a word) the prefix is exact
    assert encode(a + " word" + b)[:len(encode(a + " word")) - 1] == encode(a + " word")[:-1]


def test_chat_turns_are_exact_token_prefixes_and_outputs_round_trip():
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    reply = decode(prompt(12, 5))
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    t1, t2 = encode(render_chat(turn1)), encode(render_chat(turn2))
    assert t2[:len(t1)] == t1
    assert encode(reply) == prompt(12, 5)
    assert t2[len(t1):len(t1) + 12] == prompt(12, 5)  # the reply follows the generation prompt
    assert encode(render_chat(turn1)) == t1  # deterministic
    assert len(encode(filler_text(777, 3))) == 777
    text = "The quick brown fox jumps over the lazy dog. " * 20
    assert 4.0 < len(text) / len(encode(text)) < 6.0  # realistic characters per token


def test_calibration_matches_the_l4_sources():
    """`lb-bench calibrate` numbers for the SkyWalker testbed profile, in virtual time."""
    from bench.calibrate import calibrate, chat_mix

    numbers = calibrate(get_profile("l4-llama3-8b"), chat_mix(600)[0])
    assert 270 <= numbers["prefill_512_ms"] <= 330  # SkyWalker: ~300 ms
    assert 20 <= numbers["max_chat_concurrency"] <= 50  # SkyWalker: ~20-50 chat requests
    assert numbers["decode_tps_b1"] < numbers["decode_tps_b16"] < numbers["decode_tps_b64"]
    assert numbers["prefill_512_ms"] < numbers["prefill_2048_ms"]


ops = st.lists(st.tuples(st.sampled_from(["submit", "submit", "step", "abort"]),
                         st.integers(1, 900), st.integers(1, 300), st.integers(0, 3)),
               min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_traffic_keeps_kv_bounded_and_finishes_everything(program):
    e = Engine(replace(TINY, decode_reserve=8))
    now, live, wanted, got = 0.0, [], {}, {}
    for i, (op, size, out, key) in enumerate(program):
        if op == "submit":
            rid = f"r{i}"
            shared = prompt(64 * key, key)  # some requests share prefixes
            e.submit(EngineRequest(rid, shared + prompt(size, i), out, ignore_eos=True,
                                   priority=key % 2), now)
            live.append(rid)
            wanted[rid] = out
        elif op == "abort" and live:
            rid = live.pop(size % len(live))
            e.abort(rid, now)
            wanted.pop(rid)
        elif (t := e.next_event_time(now)) is not None:
            r = e.step(t)
            now = r.end
            for rid in r.tokens:
                got[rid] = got.get(rid, 0) + 1
        load = e.load()
        assert 0 <= load.kv_used_tokens <= load.kv_total_tokens
        assert load.cache_tokens <= load.kv_total_tokens
        assert not load.num_waiting or load.num_running  # never stuck with nothing running
    _, steps = run_until_idle(e, now)
    for s in steps:
        for rid in s.tokens:
            got[rid] = got.get(rid, 0) + 1
    assert all(got.get(rid) == n for rid, n in wanted.items())
    load = e.load()
    assert (load.kv_used_tokens, load.num_running, load.num_waiting) == (0, 0, 0)


def _timeline(token_ids: bool) -> list[tuple]:
    """Random traffic (shared prefixes, repeated prompts, KV pressure, EOS draws) through an
    engine; every step's timing, tokens emitted, finishes and preemptions."""
    import random

    rng = random.Random(3)
    e = Engine(replace(TINY, decode_reserve=4), seed=5, token_ids=token_ids)
    shared = prompt(64, 99)
    pending = []
    for i in range(120):
        body = shared + prompt(rng.randint(5, 300), i % 40) if i % 2 else prompt(rng.randint(5, 300), i % 30)
        pending.append((i * 0.004, EngineRequest(f"r{i}", body[:1500], rng.randint(1, 200),
                                                 ignore_eos=bool(i % 3))))
    out, now = [], 0.0
    while True:
        nxt = e.next_event_time(now)
        if pending and (nxt is None or pending[0][0] <= nxt):
            now, req = pending.pop(0)
            e.submit(req, now)
            continue
        if nxt is None:
            return out
        r = e.step(nxt)
        now = r.end
        out.append((r.start, r.duration, sorted(r.tokens), r.preempted,
                    [(f.id, f.reason, f.cached_tokens, f.output_tokens) for f in r.finished]))


def test_skipping_token_id_draws_changes_nothing_but_the_ids():
    with_ids, without = _timeline(True), _timeline(False)
    assert with_ids == without
    assert any(f[2] for step in with_ids for f in step[4])  # the prefix cache was on the path
    assert any(step[3] for step in with_ids)  # and preemption


# ---- SGLang's scheduler (Profile.as_sglang) -------------------------------------------------

def first_tokens(engine: Engine, now: float = 0.0) -> list[str]:
    """Request ids in the order their first token came out."""
    seen: list[str] = []
    _, steps = run_until_idle(engine, now)
    for r in steps:
        seen += [rid for rid in r.tokens if rid not in seen]
    return seen


def test_lpm_admits_the_longest_cached_prefix_first_and_falls_back_to_fcfs_past_128():
    shared = prompt(300, 7)
    for profile, waiting, expect_y_first in ((TINY.as_sglang(), 0, True), (TINY, 0, False),
                                             (TINY.as_sglang(), 128, False)):
        e = Engine(replace(profile, max_running=1))
        e.submit(EngineRequest("warm", shared, 1, ignore_eos=True), 0.0)
        now, _ = run_until_idle(e)
        e.submit(EngineRequest("busy", prompt(20, 1), 30, ignore_eos=True), now)
        e.submit(EngineRequest("x", prompt(40, 2), 5, ignore_eos=True), now)  # first, nothing cached
        for i in range(waiting):
            e.submit(EngineRequest(f"w{i}", prompt(8, 100 + i), 1, ignore_eos=True), now)
        e.submit(EngineRequest("y", shared + prompt(20, 3), 5, ignore_eos=True), now)
        order = first_tokens(e, now)
        assert (order.index("y") < order.index("x")) == expect_y_first, (profile.name, waiting)


def test_new_token_ratio_decays_admits_more_then_retracts_and_rises():
    e = Engine(TINY.as_sglang())
    assert e.new_token_ratio == pytest.approx(0.7)
    e.submit(EngineRequest("long", prompt(10, 1), 1000, ignore_eos=True), 0.0)
    now = 0.0
    for _ in range(700):  # 600 decode steps take the ratio from 0.7 down to 0.7 × 0.14
        now = e.step(now).end
    assert e.new_token_ratio == pytest.approx(0.7 * 0.14)
    for i in range(12):  # each would need 100 + 400 tokens; admitted on a 0.098 estimate
        e.submit(EngineRequest(f"r{i}", prompt(100, 10 + i), 400, ignore_eos=True), now)
    admitted = e.load().num_running - 1
    assert admitted >= 4 and (admitted + 1) * 500 > TINY.kv_tokens  # more than can finish together
    retracted: list[str] = []
    while not retracted:
        r = e.step(now)
        now, retracted = r.end, r.preempted
    assert "long" not in retracted  # fewest output tokens go first, never the long decode
    assert e.new_token_ratio > 0.2  # raised to what the running requests really need
    assert e.counters.preemptions == len(retracted)
    # what /v1/loads says (`queues.retracted`): the retractions of the last whole window of
    # DECODE_LOG_INTERVAL decode batches, none until that window closes, none a window later
    assert e.load().counters.retracted_last_window == 0
    seen = []
    while len(seen) < 2 * DECODE_LOG_INTERVAL + 1:
        now = e.step(now).end
        seen.append(e.counters.retracted_last_window)
    assert len(retracted) <= max(seen) <= e.counters.preemptions and seen[-1] < max(seen)
    run_until_idle(e, now)
    assert e.counters.requests == 13


def test_a_retraction_window_spans_collapsed_decode_steps_as_single_ones():
    from bench.engine import Counters

    one, many = Counters(), Counters()
    for c in (one, many):
        c.count_decode_batches(DECODE_LOG_INTERVAL - 3)
        c.preempted_since_log = 2
    for _ in range(5):
        one.count_decode_batches(1)
    many.count_decode_batches(5)
    assert one == many and many.retracted_last_window == 2 and many.preempted_since_log == 0
    many.preempted_since_log = 4
    many.count_decode_batches(2 * DECODE_LOG_INTERVAL)  # two boundaries: the last window had none
    assert many.retracted_last_window == 0 and many.preempted_since_log == 0


def test_a_waiting_request_does_not_pin_its_cached_prefix():
    shared = prompt(300, 7)
    e = Engine(replace(TINY, max_running=1))
    e.submit(EngineRequest("warm", shared, 1, ignore_eos=True), 0.0)
    now, _ = run_until_idle(e)
    e.submit(EngineRequest("busy", prompt(20, 1), 10, ignore_eos=True), now)
    e.submit(EngineRequest("big", prompt(1900, 2), 10, ignore_eos=True), now)  # evicts `shared`
    e.submit(EngineRequest("y", shared + prompt(20, 3), 5, ignore_eos=True), now)  # found it cached
    _, steps = run_until_idle(e, now)
    y = next(f for r in steps for f in r.finished if f.id == "y")
    lost = e.counters.lost_while_waiting
    assert 0 < lost <= e.counters.evicted_tokens  # the tail of `shared` went (LRU leaves first)
    assert y.cached_tokens == 288 - lost  # 18 blocks of 16 were cached when y arrived


@pytest.mark.parametrize("profile", ["tiny", "tiny-sglang"])
def test_unique_prompts_keyed_per_request_run_exactly_as_hashed_ones(profile):
    """`unique_prompt`: a prompt nothing shares is keyed per request, its ids unread (the
    simulator's trace prompts, given as ranges). Overloaded (waiting, preemption and
    re-admission from the request's own cached blocks, eviction), every step and counter is
    as with the same prompts as token lists; prompts that do share a prefix still hit."""
    import random

    def run(unique: bool) -> tuple[list, dict]:
        engine = Engine(get_profile(profile), seed=3, token_ids=False)
        rng, now, steps = random.Random(5), 0.0, []
        for i in range(240):
            now += rng.expovariate(40.0)
            while (t := engine.next_event_time(now)) is not None and t < now:
                r = engine.step(t)
                steps.append((r.start, r.duration, sorted(r.tokens), [vars(f) for f in r.finished], r.preempted))
            n, out = rng.randint(50, 400), rng.randint(5, 300)
            shared = i % 4 == 0  # these share a 64-token prefix: hashed either way
            ids = (list(range(7, 71)) + list(range(i << 20, (i << 20) + n - 64))) if shared else range(i << 20, (i << 20) + n)
            engine.submit(EngineRequest(f"r{i}", ids if unique or shared else list(ids), out, ignore_eos=True,
                                        unique_prompt=unique and not shared), now)
        _, rest = run_until_idle(engine, now)
        steps += [(r.start, r.duration, sorted(r.tokens), [vars(f) for f in r.finished], r.preempted) for r in rest]
        return steps, vars(engine.counters)

    hashed, keyed = run(False), run(True)
    assert keyed == hashed
    counters = keyed[1]
    assert counters["preemptions"] > 0 and counters["evicted_tokens"] > 0 and counters["cached_tokens"] > 0


@pytest.mark.parametrize("engine_class", ["Engine", "FastEngine"])
def test_sampled_answers_are_each_requests_own_and_cached_with_their_prompt(engine_class):
    """The simulator's engines (no per-token draws) give a keyed request the window of
    `ANSWERS` its key points at: two requests with one prompt and different keys answer
    differently, a follow-up carrying one answer finds that answer cached (as a tree's child
    or a conversation's next turn does), and one carrying an answer never given finds only
    the prompt. Without a key every answer is the one fixed token (greedy and the old model)."""
    from bench.engine import FIXED_TOKEN, answer_ids
    from bench.sim.fastengine import FastEngine

    e = Engine(TINY, token_ids=False) if engine_class == "Engine" else FastEngine(TINY)
    p = prompt(64, 7)
    for rid, key in (("a", 11), ("b", 12), ("greedy", None)):
        e.submit(EngineRequest(rid, p, 40, ignore_eos=True, sample_key=key), 0.0)
    if engine_class == "Engine":
        now, steps = run_until_idle(e)
        out = outputs(steps)
        assert out["a"] == answer_ids(11, 0, 40) and out["b"] == answer_ids(12, 0, 40)
        assert out["greedy"] == [FIXED_TOKEN] * 40
    else:  # as the simulator drives it: pure-decode runs applied in closed form
        now, collapsed = 0.0, 0
        while (t := e.next_event_time(now)) is not None:
            run = e.plan_decode_run(t)
            if run is None:
                now = e.step(t).end
            else:
                e.apply_decode_steps(run, run.k)
                now, collapsed = run.end, collapsed + run.k
        assert collapsed > 20  # the answers were written by decode runs, not token by token
    assert answer_ids(11, 0, 40) != answer_ids(12, 0, 40)
    assert answer_ids(11, 0, 40) == answer_ids(11, 0, 25) + answer_ids(11, 25, 15)
    b = TINY.block_size

    def cached(rid: str, tokens: list[int]) -> int:
        e.submit(EngineRequest(rid, tokens, 1, ignore_eos=True), now)
        _, steps = run_until_idle(e, now)
        return next(f.cached_tokens for s in steps for f in s.finished if f.id == rid)

    follow = p + answer_ids(11, 0, 40) + prompt(8, 99)
    assert cached("child-of-a", follow) == (len(p) + 40) // b * b
    never = p + answer_ids(13, 0, 40) + prompt(8, 99)
    assert cached("child-of-nobody", never) == len(p) // b * b


def test_simulated_clients_read_back_the_answer_the_engine_gave():
    from bench.engine import answer_ids, answer_key
    from bench.sim.clients import output_text

    assert encode(output_text("tot-c1-t0-root", 64)) == answer_ids(answer_key("tot-c1-t0-root"), 0, 64)
    assert output_text("tot-c1-t0-root", 64) != output_text("tot-c2-t0-root", 64)


def test_a_batch_runs_at_most_max_loras_adapters_and_skips_one_more_without_blocking_the_queue():
    e = Engine(replace(TINY, max_loras=2))
    for i, adapter in enumerate(("p", "q", "s", "p", None)):
        e.submit(EngineRequest(f"r{i}", prompt(20, i), 5, ignore_eos=True, adapter=adapter), 0.0)
    e.step(0.0)
    load = e.load()
    # s would be a third adapter: skipped; p's second request and the base model's run beside
    assert e.is_waiting("r2") and not any(e.is_waiting(f"r{i}") for i in (0, 1, 3, 4))
    assert (load.running_adapters, load.waiting_adapters, load.max_loras) == (("p", "q"), ("s",), 2)
    end, steps = run_until_idle(e)
    assert set(outputs(steps)) >= {"r2"}  # once p's or q's requests ended, s ran


def test_an_adapters_kv_is_its_own_in_the_prefix_cache():
    e = Engine(TINY)
    shared = prompt(64, 7)
    e.submit(EngineRequest("a", shared, 1, ignore_eos=True, adapter="p"), 0.0)
    run_until_idle(e)
    cached = {}
    for rid, adapter in (("same", "p"), ("other", "q"), ("base", None)):
        e.submit(EngineRequest(rid, shared, 1, ignore_eos=True, adapter=adapter), 1.0)
        cached[rid] = e._by_id[rid].cached_tokens  # admitted at once: what it found cached
    assert cached["same"] > 0 and cached["other"] == 0 and cached["base"] == 0
