"""The predicted-TTFT policy: speeds learned from responses, the trie as the cache estimate."""
from __future__ import annotations

from lb.core.policies import make_policy
from lb.core.predicted import TtftModel
from tests.core.test_policies import prompt, req, views


def teach(policy, target: str, rid: str, ttft: float, e2e: float, out: int, text: str, tokens: int = 512) -> None:
    """Place one request on `target` and answer it after the given times."""
    r = req(text, rid=rid, prompt_tokens=tokens)
    policy.observe(r, target, now=0.0)
    policy.served(r, target, ttft, e2e, out, now=0.0)


def answers(m: TtftModel, target: str, n: int, *, ttft: float, step: float, out: int, work: float) -> None:
    """`n` answers of `out` tokens from `target`, each placed with `work` tokens of prefill."""
    for i in range(n):
        rid = f"{target}-{ttft}-{step}-{i}"
        m.placed(rid, target, work)
        m.served(rid, target, ttft, ttft + (out - 1) * step, out)


def test_slower_replica_is_predicted_slower_from_its_inter_token_times():
    m = TtftModel(alpha=0.5)
    vs = views(3)
    for _ in range(10):
        answers(m, "r0", 1, ttft=0.1, step=0.02, out=100, work=500.0)  # 20 ms a token
        answers(m, "r1", 1, ttft=0.2, step=0.04, out=100, work=500.0)  # 2x slower
    fast, slow, new = m.predict(vs, [500.0] * 3, [500.0] * 3)
    assert slow > 1.9 * fast  # same work, twice the step
    assert fast < new < slow  # a replica with no samples is assumed typical (the median)
    # prefill ratio pooled from both: (ttft - step) / step over the work, in steps per token
    assert abs(m.prefill_ratio() - 4.0 / 500) < 1e-3


def test_one_stalled_answer_does_not_hand_a_fast_replica_s_traffic_to_a_slower_one():
    """At low load the policy sends nothing to a replica it predicts slower, so nothing would
    correct one answer that stalled there: that answer raises its step at most MAX_STEP_RISE
    times over, and the fast one stays first. A slowdown that lasts still shows."""
    from lb.core.predicted import DEFAULT_ALPHA
    m = TtftModel(alpha=DEFAULT_ALPHA)
    vs = views(2)
    for _ in range(10):
        answers(m, "r0", 1, ttft=0.02, step=0.007, out=12, work=100.0)  # 7 ms a token
        answers(m, "r1", 1, ttft=0.06, step=0.028, out=12, work=100.0)  # 4x slower
    answers(m, "r0", 1, ttft=0.02, step=3.0 / 11, out=12, work=100.0)  # a 3 s pause inside one answer
    fast, slow = m.predict(vs, [100.0] * 2, [100.0] * 2)
    assert fast < slow, (fast, slow)  # unbounded, that answer alone put r0's step at 34 ms against r1's 28
    answers(m, "r0", 12, ttft=0.1, step=0.06, out=12, work=100.0)  # r0 really slowed down to 60 ms a token
    fast, slow = m.predict(vs, [100.0] * 2, [100.0] * 2)
    assert fast > slow, (fast, slow)


def test_holder_of_the_prefix_wins_until_unseen_pushes_outweigh_the_prefill_it_saves():
    policy = make_policy("predicted-ttft", seed=1)
    shared = prompt(("doc", 16))
    vs = views(2)
    for v in vs:  # equally fast replicas
        for i in range(5):
            teach(policy, v.id, f"{v.id}-{i}", 0.1, 0.1 + 99 * 0.02, 100, prompt(("warm", 2), (v.id, i + 1)))
    policy.observe(req(shared + prompt(("a", 1)), rid="seed", prompt_tokens=2048), "r1", now=1.0)
    follow = req(shared + prompt(("b", 1)), rid="f", prompt_tokens=2048)
    assert policy.choose(follow, vs, now=2.0) == "r1"  # r1 holds 16 of 17 blocks
    assert policy.last.reason == "predicted" and policy.last.matched_blocks == 16
    for i in range(8):  # a burst of fresh prompts onto r1 that the last probe has not seen yet
        burst = req(prompt((f"burst{i}", 16)), rid=f"burst{i}", prompt_tokens=2048)
        policy.choose(burst, vs[1:], now=2.0)
        policy.observe(burst, "r1", now=2.0)
    vs[1].pushed_since_probe = 8
    assert policy.choose(follow, vs, now=2.0) == "r0"
    # the explanation says what leaving the holder cost: r0 holds 0 of the 16 blocks r1 holds
    assert (policy.last.matched_blocks, policy.last.best_blocks, policy.last.total_blocks) == (0, 16, 17)
    vs[1].pushed_since_probe = 0  # a probe saw them all (none waiting): the holder wins again
    assert policy.choose(follow, vs, now=3.0) == "r1"


def test_waiting_requests_this_lb_pushed_count_at_their_uncached_size_and_only_the_rest_at_full_size():
    """The engine's waiting count says how many, not what they need. Those this LB pushed it
    knows exactly (`prefill_ahead`: siblings of a tree on their prefix's holder need only
    their own suffix); counted at the new request's full size, six cached siblings read as
    six full prompts and the seventh left the holder to recompute the prefix elsewhere."""
    policy = make_policy("predicted-ttft", seed=1)
    shared = prompt(("doc", 16))
    vs = views(2)
    for v in vs:
        for i in range(5):
            teach(policy, v.id, f"{v.id}-{i}", 0.1, 0.1 + 99 * 0.02, 100, prompt(("warm", 2), (v.id, i + 1)))
    policy.observe(req(shared + prompt(("a", 1)), rid="seed", prompt_tokens=2048), "r1", now=1.0)
    follow = req(shared + prompt(("b", 1)), rid="f", prompt_tokens=2048)
    holder = vs[1]
    holder.pending = 6  # the last probe saw six waiting there
    holder.prefill_ahead, holder.prefill_ahead_count = 6 * 128.0, 6  # all six ours: 128 tokens each
    assert policy.choose(follow, vs, now=2.0) == "r1"
    holder.prefill_ahead, holder.prefill_ahead_count = 0.0, 0  # none of them ours: other clients' work
    assert policy.choose(follow, vs, now=2.0) == "r0"


def test_an_unseen_push_already_answered_is_not_ahead_but_another_instances_unanswered_one_is():
    """A conversation's next turn comes right after its answer, before the next probe: the
    holder must not look busy with the turn it already answered."""
    policy = make_policy("predicted-ttft", seed=1)
    vs = views(2)
    for v in vs:
        for i in range(5):
            teach(policy, v.id, f"{v.id}-{i}", 0.1, 0.1 + 99 * 0.02, 100, prompt(("warm", 2), (v.id, i + 1)))
    history = prompt(("conversation", 16))
    turn = req(history, rid="turn1", prompt_tokens=2048)
    policy.observe(turn, "r1", now=1.0)  # its whole prompt is prefill work there
    vs[1].pushed_since_probe = 1  # no probe since the push
    follow = req(history + prompt(("next", 1)), rid="turn2", prompt_tokens=2176)
    unanswered = policy.choose(follow, vs, now=1.1)
    policy.served(turn, "r1", 0.3, 0.3 + 99 * 0.02, 100, now=1.5)  # answered, still before a probe
    assert policy.choose(follow, vs, now=1.6) == "r1" and unanswered == "r0"
    # the same push made by another LB instance (lb.core.instances) and not answered yet counts
    vs[1].remote_since_probe, vs[1].remote_prefill_since_probe = 1, 2048.0
    assert policy.choose(follow, vs, now=1.6) == "r0"


def test_answers_that_come_back_whole_teach_the_step_but_not_the_prefill_ratio():
    """Non-streamed answers give only their end-to-end time: step x (n + ratio x work). A
    replica twice as slow is seen from them; the prefill ratio is left to streamed answers."""
    m = TtftModel(alpha=0.5)
    ratio = m.prefill_ratio()
    for i in range(20):
        for target, step in (("r0", 0.02), ("r1", 0.04)):
            work = 500.0 + 50 * i
            m.placed(f"{target}-{i}", target, work)
            m.served(f"{target}-{i}", target, None, step * (64 + ratio * work), 64)
    assert abs(m.rates["r0"].step() - 0.02) < 1e-9 and abs(m.rates["r1"].step() - 0.04) < 1e-9
    assert m.prefill_ratio() == ratio and m.rates["r0"].step_s is None
    fast, slow = m.predict(views(2), [500.0, 500.0], [500.0, 500.0])
    assert abs(slow / fast - 2.0) < 1e-9
    m.placed("s", "r0", 500.0)
    m.served("s", "r0", 0.05, 0.05 + 63 * 0.03, 64)  # a streamed answer: its step wins
    assert abs(m.rates["r0"].step() - 0.03) < 1e-9


def test_running_batch_counts_the_delay_a_cache_miss_adds_to_it():
    policy = make_policy("predicted-ttft", seed=1)
    vs = views(2, running=0)
    vs[0].running = 30
    text = prompt(("fresh", 8))
    # nobody holds it: the miss costs the same prefill on both, but 30 running requests wait for it on r0
    assert policy.choose(req(text, prompt_tokens=1024), vs, now=0.0) == "r1"


def test_scheduler_feeds_answers_to_the_policy_and_forgets_gone_replicas():
    from lb.core.queueing import make_queue
    from lb.core.scheduler import Scheduler, SchedulerConfig
    policy = make_policy("predicted-ttft", seed=1)
    s = Scheduler(SchedulerConfig(pushing="blind"), policy, make_queue("fcfs"))
    r = req(prompt(("x", 2)), rid="x", prompt_tokens=256)
    policy.observe(r, "r0", now=0.0)
    s.served(r, "r0", 0.05, 0.05 + 9 * 0.03, 10, now=1.0)
    model = policy.scorers[0].model
    assert abs(model.rates["r0"].step_s - 0.03) < 1e-9
    s.forget("r0")
    assert "r0" not in model.rates


def test_prefill_the_engine_runs_but_has_not_finished_counts_as_ahead():
    """A long prompt being prefilled is one running request to a probe, but holds every later
    request up: the LB's own pushes without a first token (`prefill_ahead`) say so."""
    policy = make_policy("predicted-ttft", seed=1)
    vs = views(2, running=1)
    vs[1].pending = 1  # r1 has one request waiting, r0 none: r0 looks free
    text = prompt(("q", 4))
    assert policy.choose(req(text, prompt_tokens=256), vs, now=0.0) == "r0"
    vs[0].prefill_ahead = 8000.0  # but r0 is prefilling an 8k-token prompt the LB sent it
    assert policy.choose(req(text, prompt_tokens=256), vs, now=0.0) == "r1"


def test_a_burst_of_siblings_spills_once_the_holders_backlog_outweighs_the_prefix():
    """Siblings share the holder's prefix; once what is ahead of them there costs more than
    recomputing the prefix elsewhere, one goes to the other replica, which then holds it too,
    and the explanation names the chosen replica's own match."""
    policy = make_policy("predicted-ttft", seed=1)
    shared = prompt(("parent", 20))
    vs = views(2, running=4)
    policy.observe(req(shared, rid="parent", prompt_tokens=2560), "r0", now=0.0)
    chosen = []
    for i in range(40):
        leaf = req(shared + prompt((f"leaf{i}", 1)), rid=f"leaf{i}", prompt_tokens=2688)
        target = policy.choose(leaf, vs, now=1.0)
        depth = policy.last.matched_blocks
        chosen.append((target, depth))
        policy.observe(leaf, target, now=1.0)
        next(v for v in vs if v.id == target).prefill_ahead += 128 if depth else 2688
    first_spill = next(i for i, (t, _) in enumerate(chosen) if t == "r1")
    assert 1 < first_spill < 40 and chosen[first_spill][1] == 0  # it recomputes the prefix there
    after = [t for t, _ in chosen[first_spill + 1:]]
    assert "r0" in after and "r1" in after  # then both hold it and share the rest
    assert all(d == 20 for t, d in chosen[first_spill + 1:])


def test_a_bad_others_weight_is_refused_naming_the_option():
    import pytest

    for bad in (-0.1, float("nan"), float("inf"), "0.05", True):
        with pytest.raises(ValueError, match="others_weight must be a number >= 0"):
            make_policy("predicted-ttft", others_weight=bad)
    make_policy("predicted-ttft", others_weight=0)  # 0 is allowed: ignore the running batch


def test_fully_cached_requests_with_nothing_ahead_do_not_drive_the_prefill_ratio_to_infinity():
    m = TtftModel(alpha=0.1)
    for i in range(20):  # requests with prefill work: a finite ratio
        m.placed(f"w{i}", "r0", 200.0)
        m.served(f"w{i}", "r0", 0.04, 0.04 + 63 * 0.02, 64)  # one step, plus one more for 200 tokens
    learned = m.prefill_ratio()
    for i in range(5_000):  # then only fully cached prompts: no work counted, ~1.5 steps to the first token
        m.placed(f"z{i}", "r0", 0.0)
        m.served(f"z{i}", "r0", 0.03, 0.03 + 63 * 0.02, 64)
    assert m.prefill_ratio() == learned  # they say nothing about the cost per token
    vs = views(2)
    holder, other = m.predict(vs, [0.0, 300.0], [0.0, 300.0])
    assert 0.0 < holder < other < float("inf")
