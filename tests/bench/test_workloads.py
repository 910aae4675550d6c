"""Workloads: deterministic per seed, with the structure each paper's workload has."""
from __future__ import annotations

import itertools
from collections import Counter
import os

import pytest

from bench import traces
from bench.workloads import WORKLOADS, make_workload
from bench.workloads.base import H_FINAL, H_TIER, H_USER, pseudo_text
from bench.workloads.tot import tree_size



def run_program(program, output=lambda spec: f"answer to {spec.request_id}"):
    """Drive a closed-loop program to its end, completing requests in order of issue."""
    sent, queue = [], list(program.start())
    while queue:
        spec = queue.pop(0)
        sent.append(spec)
        queue.extend(program.on_done(spec, output(spec)))
    return sent


def prompt_of(spec) -> str:
    return "".join(f"{m['role']}:{m['content']}|" for m in spec.messages)


def test_tot_tree_has_15_requests_and_children_extend_parent_prompt_and_output():
    workload = make_workload("tot", seed=3)
    sent = run_program(workload.program(client=0, index=0))
    assert len(sent) == tree_size(2, 4) == 15
    by_path = {s.meta["path"]: s for s in sent}
    for path, spec in by_path.items():
        assert spec.interaction_id == sent[0].interaction_id
        assert spec.stage == len(path) and spec.final == (len(path) == 3)
        if path:
            parent = by_path[path[:-1]]
            assert spec.messages[: len(parent.messages)] == parent.messages
            assert spec.messages[len(parent.messages)] == {"role": "assistant",
                                                          "content": f"answer to {parent.request_id}"}
    assert sent[0].messages[1]["content"].split("\n")[0][len("Question: "):] in traces.gsm8k_questions()


def test_tot_staged_forks_the_question_into_30_requests_with_16_distinct_leaves():
    """SGLang's deep ToT shape: plan / calculate / check / final, the question itself forks."""
    workload = make_workload("tot", seed=3, instructions="staged", output_tokens=256)
    sent = run_program(workload.program(client=0, index=0))
    assert len(sent) == 2 + 4 + 8 + 16
    assert all(s.max_tokens == 256 for s in sent)
    leaves = [s for s in sent if s.final]
    assert len(leaves) == 16 and all(len(s.meta["path"]) == 4 and s.stage == 3 for s in leaves)
    assert len({prompt_of(s) for s in sent}) == len(sent)  # siblings are different thoughts
    by_path = {s.meta["path"]: s for s in sent}
    for path, spec in by_path.items():
        if len(path) > 1:  # a child extends its parent's prompt and output
            parent = by_path[path[:-1]]
            assert spec.messages[: len(parent.messages)] == parent.messages
    with pytest.raises(ValueError, match="instructions"):
        make_workload("tot", instructions="long")


def test_tot_failed_node_prunes_its_subtree():
    program = make_workload("tot").program(0, 0)
    sent = run_program(program, output=lambda spec: None if spec.meta["path"] == (0,) else "ok")
    assert len(sent) == 15 - 6  # node (0,) ran, its 2 + 4 descendants did not


def test_mixed_tree_gives_every_fourth_client_85_request_trees():
    workload = make_workload("mixed-tree", seed=1)
    sizes = [len(run_program(workload.program(client=c, index=0))) for c in range(8)]
    assert sizes == [15, 15, 15, 85, 15, 15, 15, 85]


def test_multiturn_turns_extend_history_with_real_outputs():
    workload = make_workload("multiturn", seed=2, turns=4)
    sent = run_program(workload.program(client=1, index=0))
    assert len(sent) == 4 and [s.stage for s in sent] == [0, 1, 2, 3]
    assert sent[-1].final and not sent[0].final
    for prev, nxt in zip(sent, sent[1:]):
        assert nxt.messages[: len(prev.messages)] == prev.messages
        assert nxt.messages[len(prev.messages)]["content"] == f"answer to {prev.request_id}"
    assert sent[0].messages[0]["content"] in {t[0] for t in traces.mtbench_conversations()}


@pytest.mark.parametrize("name", ["tot", "mixed-tree", "multiturn"])
def test_closed_loop_is_deterministic_per_seed(name):
    def prompts(seed):
        w = make_workload(name, seed=seed)
        return [prompt_of(s) for c in range(4) for s in run_program(w.program(c, 1))]
    assert prompts(7) == prompts(7)
    assert prompts(7) != prompts(8)


@pytest.mark.parametrize("name", ["azure-conv", "mooncake", "servegen"])
def test_open_loop_is_deterministic_sorted_and_identified(name):
    def first(seed):
        return list(itertools.islice(make_workload(name, seed=seed).arrivals(), 200))
    a, b = first(5), first(5)
    assert [(s.at, prompt_of(s), s.max_tokens, s.user, s.tier) for s in a] == \
           [(s.at, prompt_of(s), s.max_tokens, s.user, s.tier) for s in b]
    assert all(x.at <= y.at for x, y in zip(a, a[1:]))
    assert len({s.request_id for s in a}) == len(a)
    assert all(s.ignore_eos and s.max_tokens >= 1 and s.headers()[H_USER] for s in a)


def test_azure_conv_takes_arrivals_and_sizes_from_the_trace():
    rows = traces.azure_conv()
    specs = list(itertools.islice(make_workload("azure-conv", tiers={"iw-f": 1, "iw-n": 1}).arrivals(), 50))
    assert [s.at for s in specs] == [r.t for r in rows[:50]]
    assert [s.max_tokens for s in specs] == [r.generated_tokens for r in rows[:50]]
    assert [len(s.messages[0]["content"].split()) for s in specs] == [r.context_tokens for r in rows[:50]]
    assert {s.headers()[H_TIER] for s in specs} == {"iw-f", "iw-n"}


def test_mooncake_equal_hash_ids_give_equal_text_prefixes():
    rows = traces.mooncake_conversation()
    specs = list(itertools.islice(make_workload("mooncake", size_scale=0.125).arrivals(), 300))
    block = round(512 * 0.125)
    pairs = 0
    for i, j in itertools.combinations(range(60), 2):
        a, b = rows[i].hash_ids, rows[j].hash_ids
        shared = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ta, tb = specs[i].messages[0]["content"], specs[j].messages[0]["content"]
        words = os.path.commonprefix([ta, tb]).count(" ")
        if shared:
            pairs += 1
            full = min(shared, len(a) - 1, len(b) - 1)  # last blocks may be cut
            assert words >= full * block
        if shared < min(len(a), len(b)) - 1:
            assert words < (shared + 1) * block  # the first different block differs
    assert pairs > 0
    assert specs[0].max_tokens == round(rows[0].output_length * 0.125)


def test_servegen_tenants_are_clients_with_their_rate_shares():
    workload = make_workload("servegen", tenants=4, total_rps=8.0, seed=1)
    chosen = workload.chosen()
    specs = list(itertools.takewhile(lambda s: s.at < 300, workload.arrivals()))
    counts = {c: sum(s.meta["client"] == c for s in specs) for c in chosen}
    assert set(counts) == {s.meta["client"] for s in specs} and len(counts) == 4
    assert 8.0 * 300 * 0.6 < len(specs) < 8.0 * 300 * 1.4
    busiest = max(chosen, key=lambda c: next(w.rate for w in chosen[c] if w.start == workload.start))
    assert counts[busiest] == max(counts.values())
    assert {s.user for s in specs} == {f"sg-{c}" for c in chosen}


def test_identity_travels_in_headers_and_user_field():
    spec = run_program(make_workload("tot").program(2, 0))[-1]
    headers = spec.headers()
    assert headers[H_USER] == "client-2" and headers[H_FINAL] == "1"
    assert headers["X-Request-Id"] == spec.request_id
    body = spec.body("m")
    assert body["user"] == "client-2" and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == spec.max_tokens


def test_pseudo_text_is_prefix_stable():
    for n in range(0, 30):
        assert pseudo_text("k", n + 7).startswith(pseudo_text("k", n))
    assert len(pseudo_text("k", 100).split()) == 100
    assert pseudo_text("a", 50) != pseudo_text("b", 50)


def test_unknown_workload_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="tot"):
        make_workload("nope")
    assert set(WORKLOADS) == {"tot", "mixed-tree", "multiturn", "azure-conv", "mooncake", "servegen", "shared-prefix", "agent",
                              "reasoning", "long-short", "random", "best-of-n", "multi-lora"}


@pytest.mark.parametrize("name", ["azure-conv", "mooncake"])
def test_max_input_tokens_clips_long_contexts(name):
    specs = list(itertools.islice(make_workload(name, max_input_tokens=300).arrivals(), 100))
    lengths = [len(s.messages[0]["content"].split()) for s in specs]
    assert max(lengths) == 300 and min(lengths) >= 1


def test_shared_prefix_is_sglangs_benchmark_shape_and_poisson_at_its_rate():
    specs = list(itertools.islice(make_workload("shared-prefix", seed=3, total_rps=4.0).arrivals(), 2000))
    systems = {s.meta["group"]: s.messages[0]["content"] for s in specs}
    assert len(systems) == 64 and all(len(t.split()) == 2048 for t in systems.values())
    assert all(s.messages[0]["content"] == systems[s.meta["group"]] for s in specs)  # one text per group
    questions = [s.messages[1]["content"] for s in specs]
    assert len(set(questions)) == len(specs) and all(len(q.split()) == 128 for q in questions)
    assert all(s.max_tokens == 256 for s in specs)
    assert 3.6 < len(specs) / specs[-1].at < 4.4  # arrivals at the asked rate
    again = list(itertools.islice(make_workload("shared-prefix", seed=3, total_rps=4.0).arrivals(), 5))
    assert [s.messages for s in again] == [s.messages for s in specs[:5]]  # a seed replays the same requests


@pytest.mark.parametrize("param", ["total_rps", "groups", "system_tokens", "question_tokens", "output_tokens"])
def test_shared_prefix_refuses_a_non_positive_parameter_by_name(param):
    with pytest.raises(ValueError, match=f"shared-prefix: {param} must be > 0"):
        make_workload("shared-prefix", **{param: 0})


def test_lb_bench_run_names_a_bad_param_in_one_line_before_anything_starts(capsys):
    from bench.cli import main

    assert main(["run", "--target", "http://127.0.0.1:9", "--workload", "shared-prefix",
                 "--param", "total_rps=-1", "--duration", "1"]) == 2
    assert "shared-prefix: total_rps must be > 0" in capsys.readouterr().err


def test_agent_sessions_grow_by_answer_and_observation_wait_for_the_tool_and_stop_at_the_context_cap():
    from bench.sim.clients import encode_chat, output_text
    from bench.workloads.agent import Agent

    workload = make_workload("agent", seed=4)
    sessions = [workload.program(client=c, index=i) for c in range(3) for i in range(20)]
    systems = {s.system for s in sessions}
    assert len(systems) == 1 and len(systems.pop().split()) == 1500  # one agent, one system prompt
    lengths = []
    for session in sessions:
        sent = run_program(session)
        assert [s.stage for s in sent] == list(range(len(session.steps))) and sent[-1].final
        assert sent[0].delay_s == 0
        for k, (prev, nxt) in enumerate(zip(sent, sent[1:])):
            assert nxt.messages[: len(prev.messages)] == prev.messages  # the context only grows
            assert nxt.messages[len(prev.messages)]["content"] == f"answer to {prev.request_id}"
            assert len(nxt.messages[-1]["content"].split()) == session.steps[k].observation_tokens
            assert nxt.delay_s == session.steps[k].think_s <= 5.0
            assert nxt.max_tokens == session.steps[k + 1].output_tokens
        lengths.append(len(sent))
        # with answers of their real length, every prompt (rendered and tokenized as the
        # emulator and the simulator do) plus its answer fits the cap
        whole = run_program(session, output=lambda spec: output_text(spec.request_id, spec.max_tokens))
        assert max(len(encode_chat(s.messages)) + s.max_tokens for s in whole) <= 7000
    assert 4 <= min(lengths) and max(lengths) <= 16 and len(set(lengths)) > 3
    assert Agent(seed=4).mean_steps(200) == pytest.approx(sum(len(Agent(seed=4).draw(0, i)[1]) for i in range(200)) / 200)
    assert run_program(make_workload("agent", seed=4).program(1, 2))[-1].messages == run_program(
        workload.program(1, 2))[-1].messages  # a seed replays the same sessions


@pytest.mark.parametrize("param,value", [("steps", [0, 3]), ("output_tokens", [9, 3]), ("steps", 5),
                                         ("think_mean_s", -1), ("max_context", 100)])
def test_agent_refuses_a_bad_range_or_a_cap_its_first_step_cannot_fit(param, value):
    with pytest.raises(ValueError, match=f"agent: {param}"):
        make_workload("agent", **{param: value})


def test_reasoning_sends_what_the_simulator_sends_and_keeps_each_request_inside_the_context():
    from bench.sim.workloads_sim import reasoning_calls

    live = make_workload("reasoning", seed=2)
    specs = list(itertools.islice(live.arrivals(), 500))
    calls = [t.call for t in itertools.islice(reasoning_calls(2), 500)]
    systems = live.system_lengths()
    for spec, call in zip(specs, calls):
        system, question = (len(m["content"].split()) for m in spec.messages)
        assert system == systems[spec.meta["system"]]  # one text per system prompt
        assert system + question == len(call.tokens) and spec.max_tokens == call.output_tokens
        assert system + question + spec.max_tokens <= live.context
    assert len({s.meta["system"] for s in specs}) == 8 and specs[-1].at > 300  # Poisson at 1 req/s
    assert sorted(s.max_tokens for s in specs)[250] in range(500, 900)  # median answer ~700 tokens


def test_best_of_n_sends_what_the_simulator_sends_and_asks_for_parallel_samples():
    from bench.sim.workloads_sim import best_of_n_calls

    live = make_workload("best-of-n", seed=3)
    specs = list(itertools.islice(live.arrivals(), 1000))
    calls = [t.call for t in itertools.islice(best_of_n_calls(3), 1000)]
    systems = live.system_lengths()
    for spec, call in zip(specs, calls):
        system, question = (len(m["content"].split()) for m in spec.messages)
        assert system == systems[spec.meta["system"]]  # one text per app's system prompt
        assert system + question == len(call.tokens) and spec.max_tokens == call.output_tokens
        assert spec.n == call.samples == spec.meta["samples"] and spec.body("m").get("n", 1) == spec.n
    shares = {n: sum(s.n == n for s in specs) / len(specs) for n in (1, 4, 8)}
    assert abs(shares[1] - 0.5) < 0.05 and abs(shares[4] - 0.3) < 0.05 and abs(shares[8] - 0.2) < 0.05
    assert abs(live.mean_samples() - 3.3) < 1e-9 and specs[-1].at > 800  # Poisson at 1 req/s
    for bad in ((0, 0, 0), (1, 2), 5, ("a", 1, 1)):
        with pytest.raises(ValueError, match="best-of-n: n_weights"):
            make_workload("best-of-n", n_weights=bad)


def test_multi_lora_sends_what_the_simulator_sends_each_request_naming_its_adapter():
    from bench.sim.workloads_sim import multi_lora_calls

    live = make_workload("multi-lora", seed=2)
    specs = list(itertools.islice(live.arrivals(), 1000))
    calls = [t.call for t in itertools.islice(multi_lora_calls(2), 1000)]
    systems = live.system_lengths()
    for spec, call in zip(specs, calls):
        system, question = (len(m["content"].split()) for m in spec.messages)
        assert system == systems[spec.meta["adapter"]]  # one system prompt per adapter
        assert system + question == len(call.tokens) and spec.max_tokens == call.output_tokens
        assert spec.adapter == call.adapter == f"lora-{spec.meta['adapter']}" == spec.body("base")["model"]
    counts = Counter(s.adapter for s in specs)
    assert len(counts) > 24 and counts["lora-0"] > 3 * counts["lora-3"] > 0  # 32 adapters, Zipf-popular
    assert specs[-1].at > 800  # Poisson at 1 req/s
    with pytest.raises(ValueError, match="multi-lora: system_max_tokens"):
        make_workload("multi-lora", system_min_tokens=500, system_max_tokens=400)


def test_long_short_sends_what_the_simulator_sends():
    from bench.sim.workloads_sim import long_short_calls

    specs = list(itertools.islice(make_workload("long-short", seed=1, total_rps=2.0).arrivals(), 1000))
    timed = list(itertools.islice(long_short_calls(1), 1000))
    systems = {}
    for spec, t in zip(specs, timed):
        words = sum(len(m["content"].split()) for m in spec.messages)
        assert words == len(t.call.tokens) and spec.max_tokens == t.call.output_tokens and spec.user == t.call.user
        assert spec.at == pytest.approx(t.at / 2.0)  # the same arrivals at the asked rate
        if spec.meta["kind"] == "chat":
            systems.setdefault(spec.meta["system"], set()).add(spec.messages[0]["content"])
    assert sorted(systems) == [0, 1, 2, 3] and all(len(texts) == 1 for texts in systems.values())  # one text each
    docs = [s for s in specs if s.meta["kind"] == "doc"]
    assert 60 < len(docs) < 140 and len({d.messages[0]["content"] for d in docs}) == len(docs)  # a tenth, each unique
    with pytest.raises(ValueError, match="long-short: total_rps must be > 0"):
        make_workload("long-short", total_rps=0)


def test_random_is_the_serving_benchmarks_random_dataset_and_sends_what_the_simulator_sends():
    """`sglang.bench_serving --dataset-name random` at its defaults: lengths uniform in [1, 1024],
    every prompt its own, the answer's length declared, no `user`."""
    from bench.sim.workloads_sim import random_calls

    specs = list(itertools.islice(make_workload("random", seed=3, total_rps=4.0).arrivals(), 2000))
    timed = list(itertools.islice(random_calls(3), 2000))
    for spec, t in zip(specs, timed):
        assert len(spec.messages[0]["content"].split()) == len(t.call.tokens) and spec.max_tokens == t.call.output_tokens
        assert spec.at == pytest.approx(t.at / 4.0) and spec.user is None and t.call.user is None
    inputs, outputs = [len(t.call.tokens) for t in timed], [t.call.output_tokens for t in timed]
    assert min(inputs) >= 1 and max(inputs) == 1024 and min(outputs) >= 1 and max(outputs) == 1024
    assert 450 < sorted(inputs)[1000] < 575 and 450 < sorted(outputs)[1000] < 575  # uniform: median ~512
    starts = [t.call.tokens[0] for t in timed]
    assert len(set(starts)) == len(starts)  # no prompt shares its first token (so no block) with another
    assert len({s.messages[0]["content"][:200] for s in specs}) == len(specs)
    assert 440 < specs[-1].at < 560  # Poisson at the asked 4 req/s
    narrow = list(itertools.islice(make_workload("random", input_len=100, output_len=10, range_ratio=0.5).arrivals(), 300))
    assert {len(s.messages[0]["content"].split()) for s in narrow} <= set(range(50, 101))
    assert {s.max_tokens for s in narrow} == set(range(5, 11))
    with pytest.raises(ValueError, match="random: range_ratio must be in"):
        make_workload("random", range_ratio=1.5)
    with pytest.raises(ValueError, match="random: input_len must be a whole number"):
        make_workload("random", input_len=100.5)
    with pytest.raises(ValueError, match="random: output_len must be > 0"):
        make_workload("random", output_len=0)


@pytest.mark.parametrize("params, message", [({"total_rps": 0}, "total_rps must be > 0"),
                                             ({"system_prompts": 2.5}, "system_prompts must be a whole number"),
                                             ({"system_max_tokens": 100}, "system_max_tokens must be >= system_min_tokens"),
                                             ({"context": 1000}, "context must hold the longest prompt")])
def test_reasoning_refuses_a_bad_parameter_by_name(params, message):
    with pytest.raises(ValueError, match=f"reasoning: {message}"):
        make_workload("reasoning", **params)
