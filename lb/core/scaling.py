"""Scaling strategies behind one interface: `decide(signals, now) -> ScalingDecision`.

One strategy object serves every (region, model) pool; its memory (cooldowns, the window of
the last scale-in) is kept per pool. `now` is passed in, so the simulator runs days of
virtual time through the very objects the daemon uses.

- `reactive` — the baseline SageServe compares against: +1 above 70 % effective KV, −1 below
  30 %, 15 s cooldown after any change.
- `lt-i`, `lt-u`, `lt-ua` — SageServe's long-term strategies, driven by a plan (the ILP's or
  PreServe's target for this window, `signals.planned`):
  LT-I (immediate) jumps to the plan as soon as it changes; LT-U (utilisation-gated) moves
  toward the plan one instance at a time, only when utilisation crosses the reactive
  thresholds in the plan's direction, so a plan that over-forecasts never starts instances
  nobody needs; LT-UA (… adaptive) is LT-U against a plan corrected by the live forecast
  error (observed vs forecast tokens/s), and still scales out beyond it when KV is nearly full.
- `preserve` — PreServe's proactive scaler: the window's forecast sets the floor at each
  window start; within the window, +1 when the anticipated KV (load anticipator look-ahead)
  exceeds 95 % in more than 10 % of the next l iterations, −1 at most once per window when
  utilisation (now and anticipated) is below 30 %.

`desired_replicas` is the stateless form for `/metrics` (`lb_desired_replicas{region,model}`),
so HPA/KEDA can scale on it without any strategy running in the daemon.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Protocol, Sequence

WINDOW_S = 600.0

from lb.core.anticipator import LoadAwarePolicy
from lb.core.deferred import replica_kv_load
from lb.core.types import QueueEntry, ReplicaView


@dataclass(frozen=True)
class ScalingSignals:
    """What one (region, model) pool looks like now."""

    region: str
    model: str
    replicas: int  # instances serving or starting
    kv_usage: float = 0.0  # effective KV utilisation over ready + starting replicas (`pool_kv_usage`)
    starting: int = 0  # instances started but not ready yet
    planned: int | None = None  # this window's target from the ILP / PreServe N
    forecast_tps: float | None = None  # forecast tokens/s for this window
    observed_tps: float | None = None  # measured tokens/s over the recent past
    # per ready replica, anticipated KV fraction over the next l iterations (anticipator)
    anticipated_kv: tuple[tuple[float, ...], ...] = ()
    queue_p95_s: float = 0.0
    tokens_in_flight: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return (self.region, self.model)


def p95(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def kv_tokens_per_replica(ready: Sequence[ReplicaView]) -> float | None:
    """A replica's KV capacity in tokens, as its probes imply (free tokens / free share; SGLang's
    and vLLM's load endpoints give both); the largest seen, None when no probe says."""
    sizes = [v.kv_free_tokens / (1.0 - v.kv_usage) for v in ready
             if v.kv_free_tokens is not None and v.kv_free_tokens > 0 and 0.0 <= v.kv_usage < 0.99]
    return max(sizes) if sizes else None


def pool_kv_usage(ready: Sequence[ReplicaView], *, starting: int, queued_tokens: int,
                  available: Callable[[ReplicaView], bool] | None = None) -> float:
    """A pool's effective KV utilisation for scaling (SageServe's "effective memory"): the KV
    its ready replicas use (`replica_kv_load`: one with a queue of its own counts as full)
    plus the prompt tokens waiting in the LB queue, over the KV of its ready *and starting*
    replicas. Capacity on its way counts: divided by the ready ones only, the signal stays
    high through a whole cold start and a 15 s cooldown asks for one more instance every
    15 s (in the simulator a 4-replica pool at a fifth of its capacity grew to ~9 on
    average). Waiting work a pool's probes give no KV size for counts as one full replica
    when no ready replica can take it. May exceed 1: work beyond the pool's KV."""
    loads = [replica_kv_load(v, available) for v in ready if v.healthy and not v.draining]
    size = kv_tokens_per_replica(ready)
    if size:
        waiting = queued_tokens / size
    else:
        waiting = 1.0 if queued_tokens and all(load >= 1.0 for load in loads) else 0.0
    slots = len(loads) + starting
    if not slots:
        return 1.0 if queued_tokens else 0.0
    return (sum(loads) + waiting) / slots


def pool_signals(region: str, model: str, *, replicas: int, ready: Sequence[ReplicaView], starting: int,
                 queued: Sequence[QueueEntry], available: Callable[[ReplicaView], bool],
                 recent_waits: Sequence[float], tracker: LoadAwarePolicy, observed_tps: float,
                 forecast_tps: float | None, planned: int | None, now: float) -> ScalingSignals:
    """One (region, model) pool described from what the LB already knows: `pool_kv_usage`
    over its `ready` replicas' probes, the `starting` ones and the entries of this model
    waiting in the LB queue, the queue waits of recent dispatches plus the ages of those
    waiting, tokens in flight (the anticipator's queued prefill and predicted remaining
    decode, plus the queued prompts and their predicted outputs), and the measured and
    forecast tokens/s."""
    kv = pool_kv_usage(ready, starting=starting, queued_tokens=sum(e.facts.prompt_tokens for e in queued),
                       available=available)
    ages = [*recent_waits, *(now - e.enqueued_at for e in queued)]
    predict = tracker.length_model.predict
    in_flight = sum(tracker.load(v.id).queued_prefill() + tracker.load(v.id).remaining_decode() for v in ready)
    in_flight += sum(e.facts.prompt_tokens + predict(e.facts).expected for e in queued)
    return ScalingSignals(
        region=region, model=model, replicas=replicas, kv_usage=kv, starting=starting, planned=planned,
        forecast_tps=forecast_tps, observed_tps=observed_tps,
        anticipated_kv=tracker.anticipated_kv([v.id for v in ready]),
        queue_p95_s=p95(ages), tokens_in_flight=int(in_flight))


@dataclass(frozen=True)
class ScalingDecision:
    region: str
    model: str
    current: int
    desired: int
    reason: str
    strategy: str
    at: float

    @property
    def delta(self) -> int:
        return self.desired - self.current

    def to_json(self) -> dict:
        return {**asdict(self), "delta": self.delta}


class Strategy(Protocol):
    name: str

    def decide(self, signals: ScalingSignals, now: float) -> ScalingDecision: ...


@dataclass
class _Bounds:
    min_replicas: int = 1
    max_replicas: int = 64

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


def overflow_fraction(anticipated: Sequence[Sequence[float]], threshold: float = 0.95) -> float:
    """Share of (replica, future iteration) cells whose anticipated KV exceeds `threshold`."""
    cells = [v for row in anticipated for v in row]
    return sum(v > threshold for v in cells) / len(cells) if cells else 0.0


def desired_replicas(signals: ScalingSignals, target_kv: float = 0.7, min_replicas: int = 1,
                     max_replicas: int = 64) -> int:
    """Stateless desired count: enough replicas to bring KV utilisation to `target_kv`
    (HPA's ceil(current·metric/target); the metric already spreads the load over ready and
    starting replicas), never below the plan."""
    load = signals.replicas * signals.kv_usage
    need = math.ceil(load / target_kv - 1e-9) if load > 0 else 0
    if signals.replicas == signals.starting and signals.tokens_in_flight > 0:
        need = max(need, 1)
    return max(min_replicas, min(max_replicas, max(need, signals.planned or 0)))


@dataclass
class Reactive(_Bounds):
    high: float = 0.7
    low: float = 0.3
    cooldown_s: float = 15.0
    name: str = "reactive"
    _last_change: dict = field(default_factory=dict, repr=False)

    def _cooling(self, key, now: float) -> bool:
        last = self._last_change.get(key)
        return last is not None and now - last < self.cooldown_s

    def _decision(self, s: ScalingSignals, desired: int, reason: str, now: float) -> ScalingDecision:
        desired = self.clamp(desired)
        if desired != s.replicas:
            self._last_change[s.key] = now
        elif not reason.startswith("hold"):
            reason = f"hold ({reason}; at bound)"
        return ScalingDecision(s.region, s.model, s.replicas, desired, reason, self.name, now)

    def decide(self, s: ScalingSignals, now: float) -> ScalingDecision:
        if self._cooling(s.key, now):
            return self._decision(s, s.replicas, "hold: cooldown", now)
        if s.kv_usage > self.high:
            return self._decision(s, s.replicas + 1, f"kv {s.kv_usage:.2f} > {self.high}", now)
        if s.kv_usage < self.low:
            return self._decision(s, s.replicas - 1, f"kv {s.kv_usage:.2f} < {self.low}", now)
        return self._decision(s, s.replicas, "hold: within band", now)


@dataclass
class LongTermImmediate(Reactive):
    """LT-I: apply the plan as soon as it is known; no plan yet → reactive."""

    name: str = "lt-i"

    def decide(self, s: ScalingSignals, now: float) -> ScalingDecision:
        if s.planned is None:
            return super().decide(s, now)
        if s.planned == s.replicas:
            return self._decision(s, s.replicas, "hold: at plan", now)
        return self._decision(s, s.planned, f"plan {s.planned}", now)


@dataclass
class LongTermUtilization(Reactive):
    """LT-U: step toward the plan only when utilisation crosses a threshold in its direction."""

    name: str = "lt-u"

    def target(self, s: ScalingSignals) -> int | None:
        return s.planned

    def decide(self, s: ScalingSignals, now: float) -> ScalingDecision:
        target = self.target(s)
        if target is None:
            return super().decide(s, now)
        if self._cooling(s.key, now):
            return self._decision(s, s.replicas, "hold: cooldown", now)
        if s.kv_usage > self.high and s.replicas < target:
            return self._decision(s, s.replicas + 1, f"kv {s.kv_usage:.2f} > {self.high}, below plan {target}", now)
        if s.kv_usage < self.low and s.replicas > target:
            return self._decision(s, s.replicas - 1, f"kv {s.kv_usage:.2f} < {self.low}, above plan {target}", now)
        return self._decision(s, s.replicas, f"hold: plan {target}", now)


@dataclass
class LongTermUtilizationAdaptive(LongTermUtilization):
    """LT-UA: LT-U against a plan rescaled by the live forecast error; +1 past the plan
    when KV is nearly full all the same."""

    name: str = "lt-ua"
    tolerance: float = 0.1  # forecast error tolerated before the plan is corrected
    emergency: float = 0.9

    def target(self, s: ScalingSignals) -> int | None:
        if s.planned is None:
            return None
        if not s.forecast_tps or s.observed_tps is None:
            return s.planned
        ratio = s.observed_tps / s.forecast_tps
        if abs(ratio - 1) <= self.tolerance:
            return s.planned
        return max(self.min_replicas, math.ceil(s.planned * ratio - 1e-9))

    def decide(self, s: ScalingSignals, now: float) -> ScalingDecision:
        target = self.target(s)
        if (target is not None and s.kv_usage > self.emergency and s.replicas >= target
                and not self._cooling(s.key, now)):
            return self._decision(s, s.replicas + 1, f"kv {s.kv_usage:.2f} > {self.emergency} past plan", now)
        return super().decide(s, now)


@dataclass
class PreServeProactive(_Bounds):
    """PreServe: forecast floor per window; anticipator-driven +1; −1 at most once per window."""

    overflow_kv: float = 0.95
    overflow_share: float = 0.10
    low: float = 0.3
    window_s: float = WINDOW_S
    name: str = "preserve"
    _window_planned: dict = field(default_factory=dict, repr=False)
    _window_scaled_in: dict = field(default_factory=dict, repr=False)

    def _out(self, s: ScalingSignals, desired: int, reason: str, now: float) -> ScalingDecision:
        desired = self.clamp(desired)
        if desired == s.replicas and not reason.startswith("hold"):
            reason = f"hold ({reason}; at bound)"
        return ScalingDecision(s.region, s.model, s.replicas, desired, reason, self.name, now)

    def decide(self, s: ScalingSignals, now: float) -> ScalingDecision:
        window = int(now // self.window_s)
        if s.planned is not None and self._window_planned.get(s.key) != window:
            self._window_planned[s.key] = window
            if s.planned > s.replicas:
                return self._out(s, s.planned, f"forecast needs {s.planned}", now)
        share = overflow_fraction(s.anticipated_kv, self.overflow_kv)
        if share > self.overflow_share:
            if s.starting:
                return self._out(s, s.replicas, f"hold: {s.starting} starting", now)
            return self._out(s, s.replicas + 1,
                             f"anticipated kv > {self.overflow_kv} in {share:.0%} of look-ahead", now)
        peak = max((v for row in s.anticipated_kv for v in row), default=0.0)
        if s.kv_usage < self.low and peak < self.low and s.replicas > self.min_replicas:
            if self._window_scaled_in.get(s.key) == window:
                return self._out(s, s.replicas, "hold: scaled in this window", now)
            self._window_scaled_in[s.key] = window
            return self._out(s, s.replicas - 1, f"kv {s.kv_usage:.2f} and anticipated < {self.low}", now)
        return self._out(s, s.replicas, "hold", now)


def keep_for_deferred(decision: ScalingDecision, deferred_waiting: int,
                      per_replica: int = 8) -> ScalingDecision:
    """SageServe's unified pool: replicas the scaler would donate as idle stay while deferred
    NIW work waits for the pool — one per `per_replica` waiting requests. The deferred queue
    releases batch work exactly when utilisation is low, so the kept replicas drain the
    backlog on capacity already paid for, instead of being given away now and the batch
    work later competing with interactive traffic (or forcing a cold start)."""
    if decision.delta >= 0 or deferred_waiting <= 0:
        return decision
    keep = min(decision.current, decision.desired + math.ceil(deferred_waiting / max(1, per_replica)))
    if keep == decision.desired:
        return decision
    return replace(decision, desired=keep,
                   reason=f"unified pool: {deferred_waiting} NIW waiting keep {keep - decision.desired} "
                          f"({decision.reason})")


STRATEGIES = {
    "reactive": Reactive,
    "lt-i": LongTermImmediate,
    "lt-u": LongTermUtilization,
    "lt-ua": LongTermUtilizationAdaptive,
    "preserve": PreServeProactive,
}


def make_strategy(name: str, **params) -> Strategy:
    """A strategy by config name (`reactive`, `lt-i`, `lt-u`, `lt-ua`, `preserve`)."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown scaling strategy {name!r}; choose one of {sorted(STRATEGIES)}") from None
    return cls(**params)
