"""SageServe tiers: SLO targets, deadlines, and per-engine `priority` values.

IW-F (interactive fast) and IW-N (interactive normal) have TTFT/E2E targets in seconds; NIW
(batch) has a deadline in hours and is deferred (see `deferred.py`). Engines disagree on what
a priority number means: SGLang runs *higher* values first, vLLM *lower* first, so the config
holds one table per engine and validation checks each table points the right way.

vLLM without `--scheduling-policy priority` answers 400 to a non-zero `priority` (V0 engine,
and V1 before it scheduled by priority) or accepts and ignores it (current V1; docs/security.md
has the versions), so by default it gets no field at all; a `[tiers.priority.vllm]` table turns the
pass-through on for it (`VLLM_PRIORITY_EXAMPLE` is a sensible one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .types import RequestFacts, Tier

# Which way each engine reads `priority`: +1 = higher runs first, -1 = lower runs first.
ENGINE_PRIORITY_DIRECTION = {"sglang": +1, "vllm": -1}
# Tier urgency, most urgent first (used by PF/DPA and to check priority tables).
TIER_RANK = {Tier.IW_F: 0, Tier.IW_N: 1, Tier.NIW: 2}


@dataclass(frozen=True)
class TierTarget:
    ttft_s: float
    e2e_s: float


DEFAULT_TARGETS = {
    Tier.IW_F: TierTarget(ttft_s=1.0, e2e_s=30.0),
    Tier.IW_N: TierTarget(ttft_s=5.0, e2e_s=120.0),
    Tier.NIW: TierTarget(ttft_s=4 * 3600.0, e2e_s=4 * 3600.0),
}
DEFAULT_PRIORITY = {
    "sglang": {Tier.IW_F: 10, Tier.IW_N: 5, Tier.NIW: 0},
}
# For vLLM servers started with `--scheduling-policy priority` (lower runs first; 0 is what
# requests without the field get, so interactive-normal stays at the engine's default).
VLLM_PRIORITY_EXAMPLE = {Tier.IW_F: -10, Tier.IW_N: 0, Tier.NIW: 10}


def parse_tier(value: str) -> Tier:
    """'IW-F', 'iw_f', 'iwf' → Tier.IW_F; raises ValueError on anything else."""
    norm = value.strip().lower().replace("_", "-")
    if norm in ("iwf", "iwn"):
        norm = norm[:2] + "-" + norm[2]
    return Tier(norm)


@dataclass(frozen=True)
class TierConfig:
    targets: dict = field(default_factory=lambda: dict(DEFAULT_TARGETS))
    default_tier: Tier = Tier.IW_N
    # DPA: urgent when fewer than tau_n seconds remain to the TTFT deadline.
    tau_n_s: float = 0.5
    # DPA: severely expired (served first) when more than tau_p seconds past it; inf (the
    # default): never. Above capacity a backlog outlives any tau_p, and promoting expired
    # work then makes DPA FCFS over lost causes while live requests expire too
    # (docs/fairness.md, "Tiers in the simulator"). An expired request is served when no
    # live one waits; `[queue] timeout_s` bounds its wait.
    tau_p_s: float = math.inf
    # engine → tier → `priority` value sent upstream; engines not listed get no field.
    priority: dict = field(default_factory=lambda: {e: dict(m) for e, m in DEFAULT_PRIORITY.items()})
    priority_passthrough: bool = True

    def target(self, tier: Tier) -> TierTarget:
        return self.targets[tier]

    def ttft_deadline(self, facts: RequestFacts) -> float:
        return facts.arrival + self.targets[facts.tier].ttft_s

    def e2e_deadline(self, facts: RequestFacts) -> float:
        return facts.arrival + self.targets[facts.tier].e2e_s

    @classmethod
    def from_dict(cls, d: dict, path: str = "tiers") -> "TierConfig":
        d = dict(d)
        targets = dict(DEFAULT_TARGETS)
        for name, spec in (d.pop("targets", {}) or {}).items():
            tier = _tier_at(name, f"{path}.targets.{name}")
            base = targets[tier]
            ttft = _positive(spec.get("ttft_s", base.ttft_s), f"{path}.targets.{name}.ttft_s")
            e2e = _positive(spec.get("e2e_s", base.e2e_s), f"{path}.targets.{name}.e2e_s")
            if e2e < ttft:
                raise ValueError(f"{path}.targets.{name}: e2e_s ({e2e}) < ttft_s ({ttft})")
            targets[tier] = TierTarget(ttft, e2e)
        priority = {e: dict(m) for e, m in DEFAULT_PRIORITY.items()}
        for engine, table in (d.pop("priority", {}) or {}).items():
            priority[engine] = {_tier_at(t, f"{path}.priority.{engine}.{t}"): int(v) for t, v in table.items()}
            _check_direction(engine, priority[engine], f"{path}.priority.{engine}")
        cfg = cls(
            targets=targets,
            default_tier=_tier_at(d.pop("default_tier", Tier.IW_N.value), f"{path}.default_tier"),
            tau_n_s=_nonneg(d.pop("tau_n_s", 0.5), f"{path}.tau_n_s"),
            tau_p_s=_nonneg(d.pop("tau_p_s", TierConfig.tau_p_s), f"{path}.tau_p_s"),
            priority=priority,
            priority_passthrough=bool(d.pop("priority_passthrough", True)),
        )
        if d:
            raise ValueError(f"{path}: unknown keys {sorted(d)}")
        return cfg


def engine_priority(tier: Tier, engine: str, cfg: TierConfig) -> int | None:
    """The `priority` field to send to `engine` for `tier`, or None to send none."""
    if not cfg.priority_passthrough:
        return None
    table = cfg.priority.get(engine)
    return None if table is None else table.get(tier)


def _check_direction(engine: str, table: dict, path: str) -> None:
    direction = ENGINE_PRIORITY_DIRECTION.get(engine)
    if direction is None:
        return
    ranked = sorted(table.items(), key=lambda kv: TIER_RANK[kv[0]])
    for (t1, v1), (t2, v2) in zip(ranked, ranked[1:]):
        if direction * (v1 - v2) < 0:
            way = "higher" if direction > 0 else "lower"
            raise ValueError(f"{path}: {engine} runs {way} priority first, so {t1.value} ({v1}) "
                             f"must not rank behind {t2.value} ({v2})")


def _tier_at(value: str, path: str) -> Tier:
    try:
        return parse_tier(str(value))
    except ValueError:
        raise ValueError(f"{path}: unknown tier {value!r} (iw-f, iw-n, niw)") from None


def _positive(v, path: str) -> float:
    if not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{path}: must be a positive number, got {v!r}")
    return float(v)


def _nonneg(v, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        raise ValueError(f"{path}: must be a number ≥ 0, got {v!r}")
    return float(v)
