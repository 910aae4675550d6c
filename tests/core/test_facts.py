"""Request facts: what routing reads from a body and the identity headers, once."""
from __future__ import annotations

import pytest

from lb.core.facts import BadRequest, build_facts, is_internal_header, prompt_text
from lb.core.identity import IdentityConfig, parse_identity
from lb.core.types import Tier


def test_chat_facts_from_body_and_headers():
    body = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 16, "stream": True, "user": "body-user"}
    h = {"x-lb-session": "s1", "x-lb-app": "a", "x-lb-interaction-id": "i", "x-lb-interaction-stage": "2",
         "x-lb-final-call": "true", "x-lb-tier": "IW-F", "x-lb-residency": "eu", "x-lb-hop": "1"}
    f = build_facts("chat", body, h, "rid", 5.0)
    assert (f.model, f.max_tokens, f.stream, f.session, f.residency) == ("m", 16, True, "s1", "eu")
    assert f.hops == 0  # a client cannot claim to be a forwarded request
    assert f.prompt == "system: be brief\nuser: hi\n" and f.arrival == 5.0
    # identity is lb.core.identity's: parsed there, applied onto these facts
    ident = parse_identity(h, body, IdentityConfig()).apply(f)
    assert (ident.user, ident.app, ident.interaction_id, ident.interaction_stage, ident.final_call, ident.tier) == \
        ("body-user", "a", "i", 2, True, Tier.IW_F)


def test_prompts_are_prefix_stable():
    short = {"messages": [{"role": "user", "content": "a"}]}
    long = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert prompt_text("chat", long).startswith(prompt_text("chat", short))
    assert prompt_text("completions", {"prompt": ["x", "y"]}) == "xy"
    assert prompt_text("generate", {"text": "t"}) == "t"


@pytest.mark.parametrize("route,body,headers,param", [
    ("chat", {"messages": []}, {}, "model"),
    ("chat", {"model": 3, "messages": []}, {}, "model"),
    ("chat", {"model": "m"}, {}, "messages"),
    ("completions", {"model": "m"}, {}, "prompt"),
    ("chat", {"model": "m", "messages": [], "max_tokens": -1}, {}, "max_tokens"),
])
def test_bad_fields_name_the_param(route, body, headers, param):
    with pytest.raises(BadRequest) as e:
        build_facts(route, body, headers, "r", 0)
    assert e.value.param == param


def test_internal_headers():
    assert is_internal_header("X-LB-Hop") and is_internal_header("x-lb-peer-region")
    assert not is_internal_header("X-LB-User") and not is_internal_header("Authorization")


@pytest.mark.parametrize("route,body,samples", [
    ("chat", {"model": "m", "messages": [], "n": 4}, 4),
    ("chat", {"model": "m", "messages": [], "n": None}, 1),  # SDKs that send every field
    ("completions", {"model": "m", "prompt": "p"}, 1),
    ("generate", {"text": "t", "sampling_params": {"n": 3, "max_new_tokens": 8}}, 3),
])
def test_parallel_samples_are_read_from_n(route, body, samples):
    assert build_facts(route, body, {}, "r", 0).samples == samples


@pytest.mark.parametrize("n", [0, -2, "4", True, 1.5])
def test_a_bad_n_names_the_param(n):
    with pytest.raises(BadRequest) as e:
        build_facts("chat", {"model": "m", "messages": [], "n": n}, {}, "r", 0)
    assert e.value.param == "n"
