"""Identity from headers, body and the API-key map; bad values are 400s, never defaults."""
from __future__ import annotations

import pytest

from lb.core.identity import Identity, IdentityConfig, IdentityError, parse_identity
from lb.core.types import RequestFacts, Tier

KEYS = IdentityConfig(api_keys={"sk-alice": "alice", "sk-bob": "bob"})


def parse(headers=None, body=None, cfg=IdentityConfig()):
    return parse_identity(headers or {}, body or {}, cfg)


def test_all_fields_from_headers_case_insensitive():
    ident = parse({"X-LB-User": "u1", "x-lb-app": "coder", "X-LB-Interaction-Id": "ix-9",
                   "x-lb-interaction-stage": "2", "x-lb-final-call": "true", "x-lb-tier": "IW-F"})
    assert ident == Identity("u1", "coder", "ix-9", 2, True, Tier.IW_F)


def test_defaults_when_nothing_is_required():
    assert parse() == Identity(None, None, None, None, False, Tier.IW_N)
    assert parse(cfg=IdentityConfig(default_tier=Tier.IW_F)).tier is Tier.IW_F


def test_tenant_precedence_api_key_then_header_then_body_user():
    assert parse({"Authorization": "Bearer sk-bob", "x-lb-user": "alice"}, {"user": "carol"}, KEYS).tenant == "bob"
    assert parse({"x-lb-user": "dave"}, {"user": "carol"}, KEYS).tenant == "dave"
    assert parse({}, {"user": "carol"}, KEYS).tenant == "carol"


def test_unknown_api_key_is_401_when_keys_are_required():
    cfg = IdentityConfig(api_keys={"sk-a": "a"}, require_api_key=True)
    with pytest.raises(IdentityError) as e:
        parse({"Authorization": "Bearer sk-nope", "x-lb-user": "a"}, cfg=cfg)
    assert e.value.unauthenticated and e.value.code == "invalid_api_key"
    with pytest.raises(IdentityError, match="Missing API key"):
        parse({}, cfg=cfg)
    assert parse({"authorization": "bearer sk-a"}, cfg=cfg).tenant == "a"


@pytest.mark.parametrize("headers,body,param", [
    ({"x-lb-user": "has space"}, {}, "x-lb-user"),
    ({"x-lb-user": "x" * 129}, {}, "x-lb-user"),
    ({}, {"user": 42}, "user"),
    ({}, {"user": "bad\nname"}, "user"),
    ({"x-lb-app": "a;b"}, {}, "x-lb-app"),
    ({"x-lb-interaction-id": "i", "x-lb-interaction-stage": "-1"}, {}, "x-lb-interaction-stage"),
    ({"x-lb-interaction-id": "i", "x-lb-interaction-stage": "two"}, {}, "x-lb-interaction-stage"),
    ({"x-lb-interaction-id": "i", "x-lb-final-call": "maybe"}, {}, "x-lb-final-call"),
    ({"x-lb-interaction-stage": "1"}, {}, "x-lb-interaction-id"),
    ({"x-lb-tier": "gold"}, {}, "x-lb-tier"),
])
def test_malformed_values_are_400_with_the_param(headers, body, param):
    with pytest.raises(IdentityError) as e:
        parse(headers, body)
    assert not e.value.unauthenticated and e.value.param == param and e.value.message


@pytest.mark.parametrize("flag,param", [("require_user", "x-lb-user"), ("require_app", "x-lb-app"),
                                        ("require_interaction", "x-lb-interaction-id"), ("require_tier", "x-lb-tier")])
def test_required_fields_missing_are_400(flag, param):
    cfg = IdentityConfig(**{flag: True})
    with pytest.raises(IdentityError) as e:
        parse({}, {}, cfg)
    assert e.value.param == param and "missing required" in e.value.message


def test_tier_spellings():
    for spelling, tier in (("iw-f", Tier.IW_F), ("IW_N", Tier.IW_N), ("iwf", Tier.IW_F), (" NIW ", Tier.NIW)):
        assert parse({"x-lb-tier": spelling}).tier is tier


def test_apply_fills_the_request_facts():
    facts = RequestFacts(request_id="r", model="m", user="spoofed")
    out = parse({"Authorization": "Bearer sk-alice", "x-lb-tier": "niw", "x-lb-interaction-id": "i",
                 "x-lb-interaction-stage": "1"}, {}, KEYS).apply(facts)
    assert (out.user, out.tier, out.interaction_id, out.interaction_stage) == ("alice", Tier.NIW, "i", 1)


def test_config_from_dict_validates():
    cfg = IdentityConfig.from_dict({"api_keys": {"k": "t"}, "require_user": True})
    assert cfg.api_keys == {"k": "t"} and cfg.require_user
    with pytest.raises(ValueError, match="identity.require_app"):
        IdentityConfig.from_dict({"require_app": "yes"})
    with pytest.raises(ValueError, match="unknown keys"):
        IdentityConfig.from_dict({"requier_user": True})
    with pytest.raises(ValueError, match="identity.api_keys"):
        IdentityConfig.from_dict({"api_keys": {"k": "bad tenant"}})
