"""FairServe: overload- and interaction-driven throttling (OIT), its RPM baseline, weighted
service counters (WSC, and VTC as its unweighted special case), tokens-wasted accounting.

Pure: rate-window counts come from the shared-state store (the daemon calls
`store.hit(...)` for each `RateLimit` and hands the results here); `now` is passed in.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Sequence

from .continuations import interaction_key, recognized_continuation
from .ewma import EwmaTable
from .types import RequestFacts

THROTTLE_MODES = ("none", "oit", "rpm")
# Interactions the ledger keeps at most (their ids come from clients; see InteractionLedger).
MAX_INTERACTIONS = 65_536


class HitResult(NamedTuple):
    """One sliding-window hit: whether it fit, requests now in the window, seconds until a slot frees."""

    allowed: bool
    count: int
    reset_s: float


@dataclass(frozen=True)
class RateLimit:
    scope: str  # "user" | "app"
    key: str  # store key, e.g. "rpm:user:alice"
    limit: int
    window_s: float


@dataclass(frozen=True)
class WscConfig:
    alpha: float = 1.0  # input tokens
    beta: float = 2.0  # system-prompt tokens
    gamma: float = 1.0  # output tokens
    weighted: bool = True  # False: VTC (every token costs the same, no priority factor)
    default_weight: float = 1000.0  # expected weighted tokens of a call of an unknown app/stage
    stage_weights: dict = field(default_factory=dict)  # app → {stage → expected weighted tokens}
    ewma_alpha: float = 0.1
    user_priority: dict = field(default_factory=dict)  # tenant → factor (<1 served more)
    default_output_tokens: int = 256  # charged at dispatch until lengths are learned
    # > 0: a tenant coming back is placed among the active ones by its service of the last few
    # half-lives (s), so it banks what it used less than they did recently, and no more;
    # 0: VTC's lift to the least active counter (the papers' rule). See `WeightedService.place`.
    half_life_s: float = 60.0
    # An interaction under way (a tree of calls, an agent's steps) ranks at the standing its
    # tenant had when its first call was dispatched, for up to this much service (in calls'
    # worth: a call costs about 1, tokens over its stage's mean); past it, by its tenant's
    # standing now like any call. 0: every call ranks by its tenant's standing now.
    # See `lb.core.queueing.WSCQueue`.
    interaction_credit: float = 128.0


# VTC as its paper defines it: plain token counts, cumulative counters, the lift.
VTC_CONFIG = WscConfig(alpha=1, beta=1, gamma=1, weighted=False, half_life_s=0.0, interaction_credit=0.0)


@dataclass(frozen=True)
class FairnessConfig:
    throttle: str = "oit"  # none | oit | rpm; OIT limits only with user_rpm/app_rpm set, only while overloaded
    window_s: float = 60.0
    user_rpm: int = 0  # 0: no per-user limit
    app_rpm: int = 0
    user_rpm_overrides: dict = field(default_factory=dict)
    app_rpm_overrides: dict = field(default_factory=dict)
    # Overloaded = LB queue longer than this (0: ignore the queue) ...
    overload_queue_len: int = 32
    # ... or no replica available for longer than this many seconds (0: ignore).
    overload_no_replica_s: float = 2.0
    interaction_ttl_s: float = 1800.0
    wsc: WscConfig = field(default_factory=WscConfig)
    # /metrics: this many tenants (by recent service) get their own label; the rest share `other`
    tenant_labels: int = 20
    # /metrics: "recent" service for that ranking decays by half over this many seconds
    tenant_half_life_s: float = 300.0

    @classmethod
    def from_dict(cls, d: dict, path: str = "fairness") -> "FairnessConfig":
        d = dict(d)
        w = dict(d.pop("wsc", {}) or {})
        stage_weights = {str(app): {int(s): _pos(v, f"{path}.wsc.stage_weights.{app}.{s}") for s, v in m.items()}
                         for app, m in (w.pop("stage_weights", {}) or {}).items()}
        prio = {str(u): _pos(v, f"{path}.wsc.user_priority.{u}") for u, v in (w.pop("user_priority", {}) or {}).items()}
        wsc = WscConfig(
            alpha=_nonneg(w.pop("alpha", 1.0), f"{path}.wsc.alpha"),
            beta=_nonneg(w.pop("beta", 2.0), f"{path}.wsc.beta"),
            gamma=_nonneg(w.pop("gamma", 1.0), f"{path}.wsc.gamma"),
            weighted=bool(w.pop("weighted", True)),
            default_weight=_pos(w.pop("default_weight", 1000.0), f"{path}.wsc.default_weight"),
            stage_weights=stage_weights,
            ewma_alpha=_pos(w.pop("ewma_alpha", 0.1), f"{path}.wsc.ewma_alpha"),
            user_priority=prio,
            default_output_tokens=int(_pos(w.pop("default_output_tokens", 256), f"{path}.wsc.default_output_tokens")),
            half_life_s=_nonneg(w.pop("half_life_s", 60.0), f"{path}.wsc.half_life_s"),
            interaction_credit=_nonneg(w.pop("interaction_credit", 128.0), f"{path}.wsc.interaction_credit"),
        )
        if w:
            raise ValueError(f"{path}.wsc: unknown keys {sorted(w)}")
        throttle = d.pop("throttle", "none")
        if throttle not in THROTTLE_MODES:
            raise ValueError(f"{path}.throttle: {throttle!r} is not one of {', '.join(THROTTLE_MODES)}")
        cfg = cls(
            throttle=throttle,
            window_s=_pos(d.pop("window_s", 60.0), f"{path}.window_s"),
            user_rpm=int(_nonneg(d.pop("user_rpm", 0), f"{path}.user_rpm")),
            app_rpm=int(_nonneg(d.pop("app_rpm", 0), f"{path}.app_rpm")),
            user_rpm_overrides={str(k): int(_nonneg(v, f"{path}.user_rpm_overrides.{k}"))
                                for k, v in (d.pop("user_rpm_overrides", {}) or {}).items()},
            app_rpm_overrides={str(k): int(_nonneg(v, f"{path}.app_rpm_overrides.{k}"))
                               for k, v in (d.pop("app_rpm_overrides", {}) or {}).items()},
            overload_queue_len=int(_nonneg(d.pop("overload_queue_len", 32), f"{path}.overload_queue_len")),
            overload_no_replica_s=_nonneg(d.pop("overload_no_replica_s", 2.0), f"{path}.overload_no_replica_s"),
            interaction_ttl_s=_pos(d.pop("interaction_ttl_s", 1800.0), f"{path}.interaction_ttl_s"),
            wsc=wsc,
            tenant_labels=int(_nonneg(d.pop("tenant_labels", 20), f"{path}.tenant_labels")),
            tenant_half_life_s=_pos(d.pop("tenant_half_life_s", 300.0), f"{path}.tenant_half_life_s"),
        )
        if d:
            raise ValueError(f"{path}: unknown keys {sorted(d)}")
        return cfg


# ---------------------------------------------------------------- OIT / RPM


def rate_limits(facts: RequestFacts, cfg: FairnessConfig) -> list[RateLimit]:
    """The windows this request counts against (user, then app); empty when unlimited."""
    out = []
    if facts.user is not None:
        limit = cfg.user_rpm_overrides.get(facts.user, cfg.user_rpm)
        if limit > 0:
            out.append(RateLimit("user", f"rpm:user:{facts.user}", limit, cfg.window_s))
    if facts.app is not None:
        limit = cfg.app_rpm_overrides.get(facts.app, cfg.app_rpm)
        if limit > 0:
            out.append(RateLimit("app", f"rpm:app:{facts.app}", limit, cfg.window_s))
    return out


@dataclass(frozen=True)
class Throttle:
    """Why and for how long a request is throttled (the daemon answers it 429 with these)."""

    scope: str
    limit: int
    remaining: int
    reset_s: float
    retry_after_s: int
    message: str


def throttle_decision(cfg: FairnessConfig, hits: Sequence[tuple[RateLimit, HitResult]], *,
                      overloaded: bool, mid_interaction: bool) -> Throttle | None:
    """OIT throttles an over-limit request only under overload and never mid-interaction (it
    stays queued: a stall, not an abort); the RPM baseline throttles whenever over limit."""
    if cfg.throttle == "none" or (cfg.throttle == "oit" and (not overloaded or mid_interaction)):
        return None
    for rule, hit in hits:
        if not hit.allowed:
            why = " while the region is overloaded" if cfg.throttle == "oit" else ""
            return Throttle(
                scope=rule.scope, limit=rule.limit, remaining=max(0, rule.limit - hit.count),
                reset_s=hit.reset_s, retry_after_s=max(1, math.ceil(hit.reset_s)),
                message=(f"Rate limit reached for {rule.scope} requests per {rule.window_s:g}s "
                         f"(limit {rule.limit}){why}. Retry after {max(1, math.ceil(hit.reset_s))}s."))
    return None


class OverloadDetector:
    """The region is overloaded when its LB queue is longer than `queue_len`, or when no
    replica has been available for longer than `no_replica_s` (either test can be off)."""

    def __init__(self, queue_len: int, no_replica_s: float):
        self.queue_len = queue_len
        self.no_replica_s = no_replica_s
        self._queued = 0
        self._unavailable_since: float | None = None

    @classmethod
    def from_config(cls, cfg: FairnessConfig) -> "OverloadDetector":
        return cls(cfg.overload_queue_len, cfg.overload_no_replica_s)

    def observe(self, now: float, queue_len: int, any_available: bool) -> None:
        self._queued = queue_len
        if any_available:
            self._unavailable_since = None
        elif self._unavailable_since is None:
            self._unavailable_since = now

    def reason(self, now: float) -> str | None:
        if self.queue_len > 0 and self._queued > self.queue_len:
            return f"queue {self._queued} > {self.queue_len}"
        if (self.no_replica_s > 0 and self._unavailable_since is not None
                and now - self._unavailable_since > self.no_replica_s):
            return f"no replica available for {now - self._unavailable_since:.1f}s"
        return None

    def overloaded(self, now: float) -> bool:
        return self.reason(now) is not None


class InteractionLedger:
    """Which interactions are in progress and how many tokens each has consumed so far.

    An interaction is in progress once one of its calls was dispatched, until its final call
    completes or it has been idle for `ttl_s`; a stage > 0 also marks it (another LB may have
    served the earlier stages). Throttling an in-progress interaction aborts it and wastes
    the tokens its earlier calls consumed — OIT never does that, the RPM baseline does.

    A call that names no interaction is known by its prompt (`lb.core.continuations`): the
    interaction the scheduler recognized it to continue, or start. Its tokens count from its
    first call (each answered undeclared call is kept, as the start of an interaction that a
    later call may continue); it is in progress once a call was recognized to continue it.
    At most `max_kept` interactions are kept (the least recently touched forgotten first):
    ids come from clients, and every undeclared call starts one.
    """

    def __init__(self, ttl_s: float = 1800.0, max_kept: int = MAX_INTERACTIONS):
        self.ttl_s = ttl_s
        self.max_kept = max_kept
        self._spent: OrderedDict[str, tuple[float, int]] = OrderedDict()  # id → (last touch, tokens)
        self.tokens_wasted = 0
        self.interactions_aborted = 0

    def in_progress(self, facts: RequestFacts, now: float) -> bool:
        if facts.interaction_id is None:  # an undeclared call: in progress if its prompt said so
            return recognized_continuation(facts)
        self._expire(now)
        return facts.interaction_id in self._spent or (facts.interaction_stage or 0) > 0

    def dispatched(self, facts: RequestFacts, now: float) -> None:
        key = interaction_key(facts)
        if key is not None and (facts.interaction_id is not None or recognized_continuation(facts)):
            self._touch(key, now, 0)

    def completed(self, facts: RequestFacts, now: float, tokens: int) -> None:
        key = interaction_key(facts)
        if key is None:
            return
        if facts.final_call and facts.interaction_id is not None:
            self._spent.pop(key, None)
        else:
            self._touch(key, now, tokens)

    def throttled(self, facts: RequestFacts, now: float) -> int:
        """Record a throttle; returns the tokens it wasted (0 unless mid-interaction)."""
        if not self.in_progress(facts, now):
            return 0
        _, spent = self._spent.pop(interaction_key(facts), (now, 0))
        self.tokens_wasted += spent
        self.interactions_aborted += 1
        return spent

    def _touch(self, iid: str, now: float, tokens: int) -> None:
        _, spent = self._spent.pop(iid, (now, 0))
        self._spent[iid] = (now, spent + tokens)  # re-insert: the dict stays in touch order
        while len(self._spent) > self.max_kept:
            self._spent.popitem(last=False)
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._spent:
            iid, (touched, _) = next(iter(self._spent.items()))
            if now - touched <= self.ttl_s:
                break
            del self._spent[iid]


# ---------------------------------------------------------------- WSC / VTC

# Idle tenants `WeightedService` remembers (as the in-process store keeps 100,000 counters):
# OpenAI's `user` names end users, so the tenants one LB sees have no bound of their own.
IDLE_KEPT = 100_000
# A sync round with a shared store reads back the totals of the tenants it touched, placed
# or runs calls for, and this many others in rotation: reading all of them each round held
# the event loop 177 ms per 0.5 s round with 100,000 tenants (17 ms with 20,000; measured).
SYNC_READ_BACK = 1_000
# Active tenants a placement reads, the most recently active first: the newest are the least
# served lately and were themselves placed near the least counter. Reading all of them cost
# 0.77 ms per placement with 1,000 active tenants and 10 ms with 10,000 (each one's decay).
PLACE_SCAN = 64


class WeightedService:
    """Per-user service counters (FairServe WSC; VTC when `weighted` is False).

    A call of user i in app a at stage j costs (α·input + β·system + γ·output) / w_aj times
    the user's priority factor, where w_aj is the EWMA of that stage's weighted tokens. It is
    charged at dispatch with an estimate and corrected at completion with actual tokens.

    Queue orders rank users by `standing`, the counter: while users are active they are served
    in virtual time (VTC), each backlogged user at the same weighted rate. What idle time is
    worth is decided once, when a user becomes active (`place`). VTC raises it to the least
    active counter, banking nothing: that let an abuser hurt bursty honest tenants, each of
    which came back to the abuser's counter and split the engine 50/50 with it for the whole
    burst, however little it had used before. With `half_life_s > 0` (the default) it is
    placed by its recent service (decayed with that half-life) against the least-served
    active user's: one that used less than the abuser recently goes first for that much
    service, and no more (docs/fairness.md has the simulator's evidence for both).
    """

    def __init__(self, cfg: WscConfig | None = None, *, idle_kept: int | None = IDLE_KEPT):
        self.cfg = cfg or WscConfig()
        # Tenants with nothing under way kept for their next placement; beyond this many the
        # longest unseen are forgotten (`place`). None, and always for VTC's rule (which needs
        # every counter): every tenant ever seen is kept.
        self.idle_kept = idle_kept if self.cfg.half_life_s > 0 else None
        seeds = {}
        for app, stages in self.cfg.stage_weights.items():
            for stage, w in stages.items():
                seeds[(app, stage)] = w
        self.weights = EwmaTable(self.cfg.ewma_alpha, self.cfg.default_weight, seeds)
        self.outputs = EwmaTable(self.cfg.ewma_alpha, float(self.cfg.default_output_tokens))
        self.counters: dict[str, float] = {}
        # user → (decayed, as of, counter then), the longest unseen first
        self._recent: OrderedDict[str, tuple[float, float, float]] = OrderedDict()
        self.inflight: dict[str, int] = {}
        self._charged: dict[str, tuple[str, float]] = {}  # request id → (user, amount)
        self._deltas: dict[str, float] = {}  # since the last drain, for a shared store
        self._claims: set[str] = set()  # placed before this LB knew their stored totals
        self._watchers: list[set[str]] = []  # per queue ranking users: who changed since it last looked
        self._holders: list[Callable[[str], bool]] = []  # per such queue: does it hold calls of a user
        self._rotation: list[str] = []  # idle tenants still to read back this rotation (`read_back`)

    @staticmethod
    def user_of(facts: RequestFacts) -> str:
        return facts.user or ""

    def get(self, user: str) -> float:
        return self.counters.get(user, 0.0)

    def standing(self, user: str, now: float) -> float:
        """What queue orders rank `user` by (least first): its counter, as `place` set it when
        it last became active. Ranking also brings its recent service up to `now`, so a user
        with work queued has it current when another comes back."""
        if self.cfg.half_life_s > 0:
            self.recent(user, now)
        return self.get(user)

    def recent(self, user: str, now: float) -> float:
        """`user`'s service decayed with the half-life to `now`, this LB's placements left out.
        It follows the counter's growth, including totals adopted from a shared store (several
        LBs; there another LB's placement of the user counts as service), so it needs no
        clock at charge time: growth since the last look is added, then decay runs."""
        counter = self.get(user)
        decayed, at, seen = self._recent.get(user, (0.0, now, 0.0))
        value = decayed * 0.5 ** (max(0.0, now - at) / self.cfg.half_life_s) + (counter - seen)
        self._recent[user] = (value, now, counter)
        self._recent.move_to_end(user)  # the longest unseen stay first (`_forget_idle`)
        return value

    def cost(self, facts: RequestFacts, input_tokens: int, system_tokens: int, output_tokens: float) -> float:
        c = self.cfg
        if not c.weighted:
            return float(input_tokens + system_tokens + output_tokens)
        tokens = c.alpha * input_tokens + c.beta * system_tokens + c.gamma * output_tokens
        w = self.weights.get((facts.app, facts.interaction_stage or 0), (facts.app, 0))
        return tokens / w * c.user_priority.get(self.user_of(facts), 1.0)

    def expected_output(self, facts: RequestFacts) -> float:
        est = self.expected_for(facts.app, facts.interaction_stage or 0)
        return est if facts.max_tokens is None else min(est, facts.max_tokens)

    def expected_for(self, app: str | None, stage: int) -> float:
        """The learned output of a call of `app` at `stage` (its app's first stage's if unseen)."""
        return self.outputs.get((app, stage), (app, 0))

    def charge(self, facts: RequestFacts) -> float:
        """At dispatch: charge the estimate; remembered by request id until `complete`."""
        system = int(facts.extra.get("system_tokens", 0))
        amount = self.cost(facts, max(0, facts.prompt_tokens - system), system, self.expected_output(facts))
        user = self.user_of(facts)
        self._add(user, amount)
        self.inflight[user] = self.inflight.get(user, 0) + 1
        self._charged[facts.request_id] = (user, amount)
        return amount

    def complete(self, facts: RequestFacts, input_tokens: int, output_tokens: int, system_tokens: int = 0) -> float:
        """At completion (or failure, with the tokens actually consumed): correct the charge
        and learn this stage's expected tokens. Returns the correction applied."""
        user, charged = self._charged.pop(facts.request_id, (self.user_of(facts), 0.0))
        if user in self.inflight:
            self.inflight[user] -= 1
            if self.inflight[user] <= 0:
                del self.inflight[user]
            self._touched(user)
        input_only = max(0, input_tokens - system_tokens)
        actual = self.cost(facts, input_only, system_tokens, output_tokens)
        self._add(user, actual - charged)
        key = (facts.app, facts.interaction_stage or 0)
        c = self.cfg
        self.weights.observe(key, c.alpha * input_only + c.beta * system_tokens + c.gamma * output_tokens, (facts.app, 0))
        self.outputs.observe(key, output_tokens, (facts.app, 0))
        return actual - charged

    def place(self, user: str, active: Iterable[str], now: float) -> None:
        """Place a user becoming active among the `active` ones (the most recently active
        first). With `half_life_s = 0`, VTC's rule: raise its counter to the least active
        counter, banking no idle time. Otherwise it goes that far above (or below) the least
        active counter as its recent service is above (or below) the least recent service
        among them (the first `PLACE_SCAN` of them): a tenant back from a pause banks what it
        used less than they did lately (the decay bounds it), a new one no more than the
        least-served active user has had lately.

        Why not rank by the decayed service itself (the rule before): every standing then
        decays to 0, so a newcomer ranks ahead of every user with work under way. Where new
        users keep coming (each tree or conversation its own user), under overload they start
        their interactions first and the heavy users' calls already under way wait minutes
        (Mixed Tree at 1.3x for 600 s, seed 0: TTFT p90 148 s, the 4-branch trees' calls
        213 s; placed by recent service instead 7 s and 60.4 req/s against 56.7,
        docs/fairness.md)."""
        vtc = self.cfg.half_life_s <= 0
        others = [u for u in (active if vtc else itertools.islice(active, PLACE_SCAN)) if u != user]
        if not others:
            return
        floor = min(self.get(u) for u in others)
        if vtc:
            if self.get(user) < floor:
                self._add(user, floor - self.get(user))
            return
        if user not in self.counters:
            self._claims.add(user)
        mine = self.recent(user, now)
        move = floor + mine - min(self.recent(u, now) for u in others) - self.get(user)
        self._add(user, move)
        decayed, at, seen = self._recent[user]
        self._recent[user] = (decayed, at, seen + move)  # a placement is not service
        if self.idle_kept is not None and len(self.counters) > self.idle_kept:
            self._forget_idle({user, *others})

    def _forget_idle(self, active: set[str], budget: int = 8) -> None:
        """Forget tenants with nothing under way, the longest unseen first (`recent` keeps
        that order), a few per placement so that no pass stalls the loop (a sort of 200,000
        tenants took 0.3 s). Placement reads only a tenant's recent service, so one forgotten
        comes back as one that used next to nothing lately, and its placement then overrides
        its stored total (`set_counters`)."""
        for _ in range(budget):
            if len(self.counters) <= self.idle_kept or not self._recent:
                return
            u = next(iter(self._recent))
            if u in active or u in self.inflight or any(holds(u) for holds in self._holders):
                self._recent.move_to_end(u)  # under way: to the back of the line
                continue
            del self._recent[u]
            self.counters.pop(u, None)
            self._claims.discard(u)

    def is_active(self, user: str) -> bool:
        return self.inflight.get(user, 0) > 0

    def drain_deltas(self) -> dict[str, float]:
        """Counter changes since the last drain: push them to a shared store with `add`."""
        out, self._deltas = self._deltas, {}
        return out

    def restore_deltas(self, deltas: dict[str, float]) -> None:
        """A push to the shared store failed: keep the drained changes for the next one."""
        for user, delta in deltas.items():
            self._deltas[user] = self._deltas.get(user, 0.0) + delta

    def read_back(self, changed: Iterable[str], waiting: Iterable[str] = (),
                  limit: int = SYNC_READ_BACK) -> list[str]:
        """The tenants whose stored totals a sync round reads back (`set_counters`): every
        one when there are at most `limit` more than those under way; else those this LB
        changed since the last round (`changed`, the drained deltas), placed without knowing
        their total (claims), runs calls for or holds calls of (`waiting`), and `limit` others
        in rotation, so that an idle tenant's total is adopted within len(counters) / limit
        rounds (a tenant coming back is placed by its recent service anyway)."""
        known = self.counters
        under_way = (u for u, n in self.inflight.items() if n > 0)
        out = {u: None for group in (changed, self._claims, under_way, waiting) for u in group if u in known}
        if len(known) <= len(out) + limit:
            return list(known)
        taken, refilled = 0, False
        while taken < limit:
            if not self._rotation:
                if refilled:
                    break
                self._rotation, refilled = list(self.counters), True
            u = self._rotation.pop()
            if u not in out and u in self.counters:
                out[u] = None
                taken += 1
        return list(out)

    def set_counters(self, totals: dict[str, float]) -> None:
        """Adopt totals read back from a shared store (changes since the drain are kept). A
        tenant this LB placed before it knew its stored total (first seen here, or forgotten)
        keeps its placement and the store is corrected to it: adopted, the total other LBs
        had given it, ever, would sit on top of the placement, and in virtual time nothing
        decays it (a tenant moving between LBs would wait behind everyone).
        (A claim stays until a total for it is read: one placed while the round was under way
        is not in it.)"""
        for user, total in totals.items():
            if user in self._claims:
                self._claims.discard(user)
                stored = total + self._deltas.get(user, 0.0)
                self._deltas[user] = self._deltas.get(user, 0.0) + self.counters.get(user, 0.0) - stored
            else:
                self.counters[user] = total + self._deltas.get(user, 0.0)
                self._touched(user)

    def _add(self, user: str, amount: float) -> None:
        self.counters[user] = self.get(user) + amount
        self._deltas[user] = self._deltas.get(user, 0.0) + amount
        self._touched(user)

    def watch(self, holds: Callable[[str], bool]) -> set[str]:
        """A set this service adds every user to whose counter or calls running change: a
        queue ranking users re-ranks those only (the caller empties it as it reads it).
        `holds(user)`: whether that queue holds calls of the user (never forgotten then)."""
        changed: set[str] = set()
        self._watchers.append(changed)
        self._holders.append(holds)
        return changed

    def _touched(self, user: str) -> None:
        for changed in self._watchers:
            changed.add(user)


def _pos(v, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{path}: must be a positive number, got {v!r}")
    return float(v)


def _nonneg(v, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"{path}: must be a number ≥ 0, got {v!r}")
    return float(v)
