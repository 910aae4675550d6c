"""KV leases over HTTP: a real `lb` over the engine emulator leases, on the replica that answered,
the context of an interaction's call that is not its last (prompt and answer tokens as the engine
counted them), shows it on /metrics, and ends it when the interaction's next call comes."""
from __future__ import annotations

import pytest

from tests.daemon.conftest import http_json, needs_emulator, start_lb_with_emulator
from tests.procs import metric

pytestmark = [needs_emulator, pytest.mark.timeout(60)]


def call(lb, step: int, headers: dict) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": f"run the tests, step {step}"}],
            "max_tokens": 8, "ignore_eos": True}
    status, doc = http_json("POST", lb.url + "/v1/chat/completions", body, headers=headers, timeout=30)
    assert status == 200, doc
    return doc["usage"]


def leased(lb) -> float:
    return metric(lb.url, "lb_replica_leased_tokens")


@pytest.mark.parametrize("lease_s", [60.0, 0.0])
def test_an_interactions_context_is_leased_between_its_calls(procs, tmp_path, lease_s):
    lb, _ = start_lb_with_emulator(procs, tmp_path, f"[pushing]\nlease_s = {lease_s}\n", "--speed", "4")
    assert leased(lb) == 0

    usage = call(lb, 0, {"x-lb-interaction-id": "task-1"})
    expected = usage["prompt_tokens"] + usage["completion_tokens"] if lease_s else 0
    assert expected == 0 or expected > 8
    assert leased(lb) == expected

    call(lb, 1, {})  # a request of no interaction changes nothing
    assert leased(lb) == expected

    # the interaction's next call: the first lease ends on arrival, this one leases its own
    usage = call(lb, 1, {"x-lb-interaction-id": "task-1"})
    assert leased(lb) == (usage["prompt_tokens"] + usage["completion_tokens"] if lease_s else 0)

    call(lb, 2, {"x-lb-interaction-id": "task-1", "x-lb-final-call": "true"})  # its last call
    assert leased(lb) == 0


def test_an_agent_that_sends_no_headers_is_known_by_its_prompts(procs, tmp_path):
    """The `openai` SDK as a third-party agent uses it: no `x-lb-*` header, each step's messages
    the last step's, its answer and the tool's output. `lb` recognizes the steps as one
    interaction and leases its context once it has seen the agent's calls continued; a user
    asking single questions beside it leases nothing."""
    import openai

    lb, _ = start_lb_with_emulator(procs, tmp_path, "[pushing]\nlease_s = 60\n", "--speed", "4")
    client = openai.OpenAI(base_url=lb.url + "/v1", api_key="unused", max_retries=0)
    for i in range(6):
        client.chat.completions.create(model="m", user="qa", max_tokens=8, messages=[
            {"role": "system", "content": "You answer questions about this repository. " * 20},
            {"role": "user", "content": f"Question {i}: what does module {i} do? " * 8}])
    assert leased(lb) == 0

    messages = [{"role": "system", "content": "You are a coding agent. Tools: read, edit, run. " * 30},
                {"role": "user", "content": "Task: fix the failing test in parser.py. " * 8}]
    for step in range(6):
        answer = client.chat.completions.create(model="m", user="agent", max_tokens=8, messages=messages,
                                                extra_body={"ignore_eos": True})
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": f"tool output of step {step}: " + "ok " * 60}]
    context = answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert 0.5 * context < leased(lb) < context  # 5 of its 6 calls continued: that share of the context
    # /metrics says how much of the undeclared traffic lb knew by its prompts: the 6 questions
    # and the agent's first step continue nothing, its 5 next steps do
    assert metric(lb.url, "lb_undeclared_calls_total", continues="yes") == 5
    assert metric(lb.url, "lb_undeclared_calls_total", continues="no") == 7
