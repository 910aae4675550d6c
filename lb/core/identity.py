"""Who is asking: tenant, application, interaction and tier, from headers and the body.

The tenant comes from the API key when a key → tenant map is configured (a client cannot
claim another tenant by header), else from the user header, else from OpenAI's `user` body
field. Everything else comes from the `x-lb-*` headers named in `facts.py`. Malformed values are always
an error; missing ones are an error only where the config says they are required — never a
silent default that would charge one tenant's traffic to another.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Mapping

from .facts import H_APP as APP_HEADER
from .facts import H_FINAL_CALL as FINAL_HEADER
from .facts import H_INTERACTION_ID as INTERACTION_HEADER
from .facts import H_INTERACTION_STAGE as STAGE_HEADER
from .facts import H_TIER as TIER_HEADER
from .facts import H_USER as USER_HEADER
from .tiers import parse_tier
from .types import RequestFacts, Tier

IDENTITY_HEADERS = (USER_HEADER, APP_HEADER, INTERACTION_HEADER, STAGE_HEADER, FINAL_HEADER, TIER_HEADER)

_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class IdentityError(Exception):
    """A request the LB refuses before queueing: what is wrong (`message`), in which header
    or field (`param`), and whether it is a missing or unknown API key (`unauthenticated`)
    rather than a malformed value. The daemon turns it into the HTTP answer (401 / 400)."""

    def __init__(self, message: str, param: str | None, *, unauthenticated: bool = False,
                 code: str = "invalid_identity"):
        super().__init__(message)
        self.message, self.param, self.unauthenticated, self.code = message, param, unauthenticated, code


@dataclass(frozen=True)
class IdentityConfig:
    api_keys: dict = field(default_factory=dict)  # API key → tenant
    # With a key map configured, a missing or unknown key is refused (401) when this is set.
    require_api_key: bool = False
    require_user: bool = False
    require_app: bool = False
    require_interaction: bool = False
    require_tier: bool = False
    default_tier: Tier = Tier.IW_N

    @classmethod
    def from_dict(cls, d: dict, path: str = "identity", default_tier: Tier = Tier.IW_N) -> "IdentityConfig":
        d = dict(d)
        keys = d.pop("api_keys", {}) or {}
        for k, tenant in keys.items():
            if not isinstance(tenant, str) or not _ID.match(tenant):
                raise ValueError(f"{path}.api_keys: tenant for key {k[:4]}… must match {_ID.pattern}")
        flags = {}
        for name in ("require_api_key", "require_user", "require_app", "require_interaction", "require_tier"):
            v = d.pop(name, False)
            if not isinstance(v, bool):
                raise ValueError(f"{path}.{name}: must be true or false, got {v!r}")
            flags[name] = v
        if d:
            raise ValueError(f"{path}: unknown keys {sorted(d)}")
        return cls(api_keys=dict(keys), default_tier=default_tier, **flags)


@dataclass(frozen=True)
class Identity:
    tenant: str | None
    app: str | None
    interaction_id: str | None
    stage: int | None
    final: bool
    tier: Tier

    def apply(self, facts: RequestFacts) -> RequestFacts:
        """The facts with this identity filled in (the daemon parses facts once, then this)."""
        if (facts.user, facts.app, facts.interaction_id, facts.interaction_stage, facts.final_call, facts.tier) == (
                self.tenant, self.app, self.interaction_id, self.stage, self.final, self.tier):
            return facts  # nothing to fill in (the common anonymous request): skip the copy
        return replace(facts, user=self.tenant, app=self.app, interaction_id=self.interaction_id,
                       interaction_stage=self.stage, final_call=self.final, tier=self.tier)


def parse_identity(headers: Mapping[str, str], body: Mapping, cfg: IdentityConfig) -> Identity:
    """Raises IdentityError (400, or 401 for a bad API key) with the offending param."""
    h = {k.lower(): v for k, v in headers.items()}
    tenant = _tenant(h, body, cfg)
    app = _id(h.get(APP_HEADER), APP_HEADER)
    interaction = _id(h.get(INTERACTION_HEADER), INTERACTION_HEADER)
    stage = _stage(h.get(STAGE_HEADER))
    final = _flag(h.get(FINAL_HEADER), FINAL_HEADER)
    if interaction is None and (stage is not None or final):
        raise IdentityError(f"{STAGE_HEADER} and {FINAL_HEADER} need {INTERACTION_HEADER}", INTERACTION_HEADER)
    tier = _tier(h.get(TIER_HEADER), cfg)
    for required, value, param in ((cfg.require_user, tenant, USER_HEADER), (cfg.require_app, app, APP_HEADER),
                                   (cfg.require_interaction, interaction, INTERACTION_HEADER)):
        if required and value is None:
            raise IdentityError(f"missing required {param} header", param)
    return Identity(tenant, app, interaction, stage, final, tier)


def _tenant(h: dict, body: Mapping, cfg: IdentityConfig) -> str | None:
    if cfg.api_keys:
        auth = h.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if key in cfg.api_keys:
            return cfg.api_keys[key]
        if cfg.require_api_key:
            msg = "Incorrect API key provided." if key else "Missing API key: send Authorization: Bearer KEY."
            raise IdentityError(msg, None, unauthenticated=True, code="invalid_api_key")
    header = _id(h.get(USER_HEADER), USER_HEADER)
    if header is not None:
        return header
    user = body.get("user")
    if user is None:
        return None
    if not isinstance(user, str):
        raise IdentityError("'user' must be a string", "user")
    return _id(user, "user")


def _id(value: str | None, param: str) -> str | None:
    if value is None or value == "":
        return None
    if not _ID.match(value):
        raise IdentityError(f"invalid {param} {value[:40]!r}: use 1-128 of A-Z a-z 0-9 . _ : @ / + = -", param)
    return value


def _stage(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    if not value.isdigit() or len(value) > 6:
        raise IdentityError(f"invalid {STAGE_HEADER} {value[:20]!r}: a non-negative integer", STAGE_HEADER)
    return int(value)


def _flag(value: str | None, param: str) -> bool:
    if value is None or value == "":
        return False
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise IdentityError(f"invalid {param} {value[:20]!r}: true or false", param)


def _tier(value: str | None, cfg: IdentityConfig) -> Tier:
    if value is None or value == "":
        if cfg.require_tier:
            raise IdentityError(f"missing required {TIER_HEADER} header (iw-f, iw-n, niw)", TIER_HEADER)
        return cfg.default_tier
    try:
        return parse_tier(value)
    except ValueError:
        raise IdentityError(f"invalid {TIER_HEADER} {value[:20]!r}: one of iw-f, iw-n, niw", TIER_HEADER) from None
