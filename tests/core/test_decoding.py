"""The KV the answers under way hold (lb.core.decoding), and the prefix trie bounded by what it
leaves for the cache (lb.core.scheduler). Time is passed in."""
from __future__ import annotations

from lb.core.decoding import MIN_CACHE_SHARE, Decoding
from lb.core.policies import make_policy
from lb.core.prefix import CHARS_PER_TOKEN, DEFAULT_BLOCK_CHARS
from lb.core.queueing import make_queue
from lb.core.scheduler import Kind, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, RequestFacts
from tests.core.test_policies import prompt
from tests.core.test_scheduler import rep

STEP = 0.01  # the replica's inter-token time in these tests


def test_answers_decode_one_token_a_step_from_their_first_token_up_to_their_length():
    d = Decoding()
    d.placed("a", "r0", 100)
    d.placed("b", "r0", 1000)
    assert d.tokens("r0", 10.0, STEP) == 0  # no first token yet: nothing decoded
    d.first_token("a", 10.0)
    d.first_token("b", 10.5)
    assert d.tokens("r0", 11.0, STEP) == 100 + 50
    assert d.tokens("r0", 30.0, STEP) == 1100  # at most their lengths
    assert d.tokens("r1", 30.0, STEP) == 0 and d.tokens("r0", 30.0, None) == 0
    d.ended("a")
    assert d.tokens("r0", 11.0, STEP) == 50
    d.ended("b")
    assert d.tokens("r0", 11.0, STEP) == 0 and len(d) == 0


def test_an_answer_that_comes_back_whole_decodes_from_its_given_start_and_a_retry_replaces_it():
    d = Decoding()
    d.placed("w", "r0", 500, starts_at=2.0)
    assert d.tokens("r0", 3.0, STEP) == 100
    d.first_token("w", 2.5)  # a start already given stands
    assert d.tokens("r0", 3.0, STEP) == 100
    d.placed("w", "r1", 500)  # retried elsewhere, not started there yet
    assert d.tokens("r0", 3.0, STEP) == 0 and d.tokens("r1", 3.0, STEP) == 0 and len(d) == 1
    d.forget("r1")
    assert len(d) == 0


def test_the_cache_room_is_the_kv_less_the_answers_under_way_but_never_below_its_floor():
    d = Decoding()
    for i in range(10):
        d.placed(f"q{i}", "r0", 10_000)
        d.first_token(f"q{i}", 0.0)
    assert d.cache_room("r0", 32_768, 1.0, STEP) == 32_768 - 10 * 100
    assert d.cache_room("r0", 32_768, 60.0, STEP) == int(32_768 * MIN_CACHE_SHARE)


def test_tracking_is_bounded_and_the_oldest_answer_goes_first():
    d = Decoding(max_tracked=3)
    for i in range(5):
        d.placed(f"q{i}", "r0", 10)
        d.first_token(f"q{i}", 0.0)
    assert len(d) == 3 and d.tokens("r0", 1.0, STEP) == 30


def _scheduler_with_a_learned_step() -> Scheduler:
    policy = make_policy("predicted-ttft", seed=1)
    s = Scheduler(SchedulerConfig(pushing="blind"), policy, make_queue("fcfs"))
    warm = RequestFacts("warm", "m", prompt=prompt(("warm", 1)), prompt_tokens=32)
    policy.observe(warm, "r0", now=0.0)
    s.served(warm, "r0", 0.05, 0.05 + 99 * STEP, 100, now=0.0)
    return s


def _push(s: Scheduler, target, rid: str, text: str, now: float) -> None:
    facts = RequestFacts(rid, "m", prompt=text, prompt_tokens=len(text) // CHARS_PER_TOKEN, max_tokens=1000,
                         stream=True)
    assert s.admit(QueueEntry(facts, enqueued_at=now, seq=0), now) is None
    [p] = s.schedule(now, [target])
    assert p.kind is Kind.REPLICA and p.target_id == target.view.id


def _held_after_answers(end_them: bool) -> int:
    """Blocks of the first prompt the trie still believes r0 holds after 20 more requests whose
    answers have run 1.5 s (150 tokens each at STEP) and one more push: `end_them`, they ended."""
    s = _scheduler_with_a_learned_step()
    kv = 4096  # tokens: the trie keeps 128 blocks of 128 bytes at 4 bytes a token
    r0 = rep("r0", kv_total_tokens=kv)
    first = prompt(("first", 4))
    _push(s, r0, "first", first, 0.0)
    for i in range(20):
        _push(s, r0, f"q{i}", prompt((f"q{i}", 4)), 0.0)
        s.first_token(f"q{i}", 0.0)
    if end_them:
        for i in range(20):
            s.ended(f"q{i}")
    _push(s, r0, "late", prompt(("late", 4)), 1.5)
    depth, _, _ = s.affinity.memory.affinity(RequestFacts("again", "m", prompt=first), {"r0"})
    return depth


def test_the_trie_forgets_prompts_the_answers_under_way_left_no_room_for_and_keeps_them_once_those_end():
    """84 blocks of prompts fit the 128 a 4,096-token KV makes; 3,000 tokens of answers under
    way leave room for 34, and the oldest prompt is what the engine evicts first."""
    assert DEFAULT_BLOCK_CHARS == 128 and CHARS_PER_TOKEN == 4
    assert _held_after_answers(end_them=True) == 4
    assert _held_after_answers(end_them=False) == 0


def test_parallel_samples_decode_side_by_side_each_up_to_its_length():
    d = Decoding()
    d.placed("n4", "r0", 4 * 100, samples=4)  # four answers of 100 tokens
    d.placed("one", "r0", 100)
    d.first_token("n4", 0.0)
    d.first_token("one", 0.0)
    assert d.tokens("r0", 0.5, STEP) == 5 * 50  # five answers, a token each a step
    assert d.tokens("r0", 5.0, STEP) == 500
    d.ended("n4")
    assert d.tokens("r0", 0.5, STEP) == 50 and len(d) == 1


def test_a_scheduler_charges_each_sample_an_answer_and_learns_one_answer_s_length():
    s = _scheduler_with_a_learned_step()
    r0 = rep("r0", kv_total_tokens=32_768)
    facts = RequestFacts("n4", "m", prompt=prompt(("tides", 4)), prompt_tokens=128, stream=True, samples=4)
    each = s.affinity.lengths.expected(facts)
    assert s.admit(QueueEntry(facts, enqueued_at=0.0, seq=0), 0.0) is None
    [p] = s.schedule(0.0, [r0])
    assert p.kind is Kind.REPLICA
    s.first_token("n4", 0.0)
    assert s.decoding.tokens("r0", 0.5, STEP) == 4 * 50  # four answers decode side by side
    assert s.decoding.tokens("r0", 60.0, STEP) == 4 * each  # each up to the length expected
    s.ended("n4")
    s.served(facts, "r0", 0.05, 0.05 + 59 * STEP, 4 * 60, now=1.0)  # the engine counts all four answers
    one = _scheduler_with_a_learned_step()
    single = RequestFacts("n1", "m", prompt=prompt(("tides", 4)), prompt_tokens=128, stream=True)
    one.served(single, "r0", 0.05, 0.05 + 239 * STEP, 4 * 60, now=1.0)
    # four answers of 60 tokens teach what one of 60 would, not one of 240 (after the warm-up's 100)
    assert s.affinity.lengths.sketches[("all",)].mean() == (100 + 60) / 2
    assert one.affinity.lengths.sketches[("all",)].mean() == (100 + 240) / 2
