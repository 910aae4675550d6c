"""Regions, load balancers and replicas in virtual time.

`SimReplica` drives one `FastEngine` (the emulator's engine model) from the event loop and
bills its lifetime. `SimLB` is one region's load balancer: it owns the daemon's scheduler
(`lb.core.scheduler.Scheduler`, the very object `lb.daemon.dispatch` calls: eligibility,
queue order and tenant charging, cache-affine ordering and holds, the routing policy,
SkyWalker's local-then-peer dispatch) and calls it in virtual time, on views that are only
as fresh as the daemon's:

- every replica is probed on the LB's 100 ms grid; the view shows the engine's waiting and
  running counts and KV usage *as of the last grid tick* (a replica snapshots its state
  before the first change after each tick, so a read later sees the tick's state), plus
  the LB's own pushes the probe cannot have seen (`lb.core.pushing.settle_probe`, the
  daemon's estimate) and outstanding counts. The probes are computed lazily, for the same
  views: only when a pass reads them (the waiting models' replicas), and only for replicas
  that changed since their last probe (`SimLB.refresh`; tests/bench/test_sim.py compares
  every view a pass reads with probing the whole fleet at every tick);
- after a push the replica is re-probed `early_reprobe_s` later, as the daemon does;
- a probe costs nothing unless the engine's profile says it does (`Profile.probe_s`, e.g. vLLM's
  /metrics page); then, as in the daemon, an early re-probe waits until probing takes at most
  `max_probe_share` of the replica's time, is asked for after a push or an answer only when a
  decision waits on it (`Scheduler.wants_probe`), reads the engine as it starts and lands
  `probe_s` later. The grid probes stay instant (their 100 ms staleness dwarfs a probe's few ms);
- a dispatch pass runs on arrival, completion, early re-probe, and on each grid tick while
  requests wait (the daemon's "probe result" wake-up).

Cross-region (SkyWalker Algorithm 1, `lb.core.peering.local_or_peer` with the configured peer
policy, the daemon's `prefix-trie` by default): a request nothing local can take goes to a peer LB that has an available replica
for its model and a queue no longer than `tau`, seen through a status as fresh as now; it
arrives there one-way latency later marked `hops=1`, is placed on that region's replicas
only, and its tokens travel back the same latency.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from bench.engine import EngineRequest, answer_key, sample_ids
from bench.profiles import Profile
from bench.sim.core import EventLoop
from bench.sim.fastengine import DecodeRun, FastEngine
from bench.sim.metrics import Metrics
from lb.core.backlog import forward_cost
from lb.core.peering import PeerConfig, PeerRouter, PeerStatus
from lb.core.policies import make_policy
from lb.core.affinity import AffinityConfig
from lb.core.loadparse import CACHE_AWARE_POLICIES
from lb.core.pushing import early_probe_delay, note_preemptions, record_push, settle_completion, settle_end, settle_probe
from lb.core.fairness import WeightedService, WscConfig
from lb.core.queueing import make_queue
from lb.core.tiers import TierConfig
from lb.core.scheduler import Kind, PeerSet, PeerTarget, Scheduler, SchedulerConfig
from lb.core.types import QueueEntry, ReplicaView, RequestFacts
from lb.daemon.config import Config


@dataclass(slots=True)
class SimRequest:
    id: str
    region: str  # where the client is
    model: str
    tenant: str
    arrival: float
    prompt: Sequence[int]
    output_tokens: int  # of each answer
    unique_prompt: bool = False  # no other request shares a block of it (EngineRequest.unique_prompt)
    facts: RequestFacts | None = None
    samples: int = 1  # parallel sampling (the API's `n`): answers decoded side by side, each its own engine request
    adapter: str | None = None  # the LoRA adapter it runs with (EngineRequest.adapter)
    outputs: int = 0  # tokens of its answers ended so far
    left: int = 0  # its answers still running on its replica
    cached: int = 0  # of its prompt, found cached: the least any of its samples found (the one that computed it)
    extra_latency: float = 0.0  # round trip added by forwarding
    first_token: float | None = None
    pushed_at: float | None = None  # when a replica took it (TTFT there counts from here)
    finished_at: float | None = None
    served_by: str | None = None
    served_region: str | None = None


# The daemon's defaults (`lb.daemon.config.Config()`): the one source of the simulated LB's
# defaults, so a scenario without `[lb]` overrides runs the config the daemon ships.
_DAEMON = Config()


@dataclass
class LBConfig:
    """One simulated LB's settings. Every default is the daemon's own (`_DAEMON`: the same
    dataclass defaults `lb check-config` fills in). A scenario's `[lb] config = "lb.toml"` reads
    them from a daemon config file (`from_daemon_config`: the same parser, checks and error
    messages as `lb check-config`); other `[lb]` keys then override it. A scenario that wants
    another setting states it in its TOML with the reason."""

    policy: str = _DAEMON.routing.policy
    pushing: str = _DAEMON.pushing.mode
    queue: str = _DAEMON.queue.order
    probe_interval_s: float = _DAEMON.probes.interval_s
    early_reprobe_s: float = _DAEMON.probes.early_reprobe_s
    max_probe_share: float = _DAEMON.probes.max_probe_share  # early re-probes of a costly endpoint (profile.probe_s)
    max_outstanding: int = _DAEMON.pushing.max_outstanding
    push_credit: int = _DAEMON.pushing.push_credit
    max_unseen: int = _DAEMON.pushing.max_unseen
    lease_s: float = _DAEMON.pushing.lease_s  # lb.core.leases
    forward: bool = True  # cross-region forwarding to peers (the daemon forwards when it has peers)
    peer_queue_tau: int = _DAEMON.peering.tau  # a peer is available only with its queue at most this long
    peer_policy: str = _DAEMON.peering.policy  # which available peer takes a forward (lb.core.peering.PeerRouter)
    peer_forward: str = _DAEMON.peering.forward  # predicted | overflow ([peering] forward)
    peer_forward_margin_s: float = _DAEMON.peering.forward_margin_s
    peer_lighter_share: float = _DAEMON.peering.lighter_share  # lb.core.peering.lighter_peer
    policy_options: dict = field(default_factory=lambda: dict(_DAEMON.routing.options))  # make_policy(policy, **policy_options)
    affinity: AffinityConfig = _DAEMON.affinity
    wsc: WscConfig | None = None  # WSC's settings (None: the order's defaults, the daemon's [fairness.wsc] defaults)
    tiers: TierConfig | None = None  # tier targets for EDF/DPA (None: the defaults, the daemon's [tiers] defaults)

    @classmethod
    def from_daemon_config(cls, path: str, **overrides) -> "LBConfig":
        """The scheduler-facing settings of a daemon config file: [routing], [pushing],
        [queue] order, [fairness.wsc], [probes] interval and early re-probe, [affinity], [peering]
        τ and policy."""
        from lb.daemon.config import load
        return cls.of(load(path), **overrides)

    @classmethod
    def of(cls, cfg: Config, **overrides) -> "LBConfig":
        """The scheduler-facing settings of a loaded daemon config."""
        return cls(**{**dict(
            policy=cfg.routing.policy, policy_options=dict(cfg.routing.options), pushing=cfg.pushing.mode,
            queue=cfg.queue.order, probe_interval_s=cfg.probes.interval_s, early_reprobe_s=cfg.probes.early_reprobe_s,
            max_probe_share=cfg.probes.max_probe_share, max_outstanding=cfg.pushing.max_outstanding, push_credit=cfg.pushing.push_credit,
            max_unseen=cfg.pushing.max_unseen, lease_s=cfg.pushing.lease_s, peer_queue_tau=cfg.peering.tau, peer_policy=cfg.peering.policy,
            peer_forward=cfg.peering.forward, peer_forward_margin_s=cfg.peering.forward_margin_s,
            peer_lighter_share=cfg.peering.lighter_share, affinity=cfg.affinity,
            wsc=cfg.fairness.wsc if cfg.queue.order == "wsc" else None), **overrides})

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(pushing=self.pushing, max_outstanding=self.max_outstanding,
                               push_credit=self.push_credit, max_unseen=self.max_unseen, lease_s=self.lease_s,
                               affinity=self.affinity)


class SimReplica:
    """One instance: billed from `requested_at`, serving from `ready_at`, until `stopped_at`."""

    def __init__(self, id: str, region: str, model: str, profile: Profile, loop: EventLoop,
                 lb: "SimLB", *, seed: int, ready_at: float, requested_at: float):
        self.id, self.region, self.model = id, region, model
        self.loop, self.lb = loop, lb
        self.engine = FastEngine(profile, seed=seed)
        self.requested_at, self.ready_at = requested_at, ready_at
        self.stopped_at: float | None = None
        self.view = ReplicaView(id=id, url=f"sim://{id}", engine="sglang", models=frozenset([model]),
                                region=region, healthy=ready_at <= loop.now,
                                max_running=profile.max_running, kv_total_tokens=profile.kv_tokens,
                                orders_by_prefix=profile.waiting_order in CACHE_AWARE_POLICIES,
                                max_loras=profile.max_loras)
        self.draining = False
        self.breaker = None  # the simulated engines do not fail requests
        self.snap_tick = -math.inf
        self.snap: tuple = (0, 0, 0.0, profile.kv_tokens, None, None, None, frozenset())
        self.snap_outstanding = 0  # the LB's outstanding samples at the snapshot
        self.requests: dict[str, SimRequest] = {}
        self._token = 0  # generation of the pending wake-up
        self._run: DecodeRun | None = None
        self._early_probe_due = False
        self.probe_s = profile.probe_s
        self._probe_end = -math.inf  # when the last costly early probe landed (or will)
        self.busy_s = 0.0
        # The view is *fresh* when a grid probe now would write exactly what it holds (the
        # engine and the LB's counts are unchanged since a live probe and no push is newer
        # than it); a change puts the replica in its LB's `stale` set, the only replicas a
        # refresh probes (lazily, as most of a large fleet is unchanged between two ticks).
        self.fresh = False
        self.stale_set: dict[str, "SimReplica"] | None = None  # set by SimLB.add_replica

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.stopped_at is None and self.loop.now >= self.ready_at

    def became_ready(self) -> None:
        self.view.healthy = True
        self.probe_now()  # the daemon turns a replica healthy at its first good probe
        self.lb.replica_ready(self)

    def drain(self) -> None:
        self.draining = self.view.draining = True
        self._maybe_stop()

    def _maybe_stop(self) -> None:
        if self.draining and self.stopped_at is None and not self.requests:
            self.stopped_at = self.loop.now
            self._token += 1
            self.lb.replica_stopped(self)

    # -- what a probe sees -------------------------------------------------------------
    def mark_stale(self) -> None:
        """The engine or the LB's counts changed: the next grid probe must look."""
        self.fresh = False
        if self.stale_set is not None:
            self.stale_set[self.id] = self

    def _before_change(self, now: float) -> None:
        """Keep the state as of the last probe tick before changing it."""
        self.mark_stale()
        tick = self.lb.tick_at(now)
        if tick > self.snap_tick:
            self.snap_tick = tick
            self.snap = self.engine.probe(tick)
            # pushes the scheduler counted since the tick have not reached the engine yet (in the
            # engine's count: each parallel sample one, as `settle_probe` reads it)
            unapplied = 0
            for t, _, samples in reversed(self.view.push_log):
                if t < tick:
                    break
                unapplied += samples
            self.snap_outstanding = self.view.outstanding_samples - unapplied

    def probe_at_tick(self, tick: float) -> None:
        """The grid probe at `tick`: the state kept at the tick if it changed since (then the
        view stays stale: a later probe sees the change), else the live state."""
        if self.snap_tick == tick:
            self.probe_into_view(tick, self.snap, self.snap_outstanding)
        else:
            self.probe_into_view(tick, self.engine.probe(tick), self.view.outstanding_samples)
            log = self.view.push_log
            self.fresh = not log or log[-1][0] <= tick

    def probe_into_view(self, at: float, state: tuple, outstanding_at: int) -> None:
        """What the daemon's probe loop writes (`lb.daemon.probes`): the engine's counts, its
        KV room (SGLang /v1/loads), its preemptions and first tokens (vLLM /metrics) or retractions
        lately (SGLang /v1/loads), and the LB's pushes the probe cannot have seen yet."""
        v = self.view
        v.pending, v.running, v.kv_usage, v.kv_free_tokens, preempted, lately, first_tokens, v.running_adapters = state
        # vLLM's /metrics says it at every probe; SGLang's /v1/loads does not, so the daemon reads
        # its /metrics too while pushes answered whole wait there, else keeps the last count
        # (lb.core.engines.FIRST_TOKENS_PAGE)
        if lately is None or self.lb.wants_first_tokens(v.id):
            v.engine_first_tokens = first_tokens
        note_preemptions(v, preempted, at, lately=lately)
        v.last_probe_at = at
        v.probe_s = self.probe_s
        # No `answering_at_start`: the simulated LB hears an answer end the instant the engine
        # finishes it, so no request it counts in flight is one the engine has already finished.
        settle_probe(v, at, outstanding_at, v.pending, v.running, self.lb.cfg.early_reprobe_s)

    def probe_now(self) -> None:
        self.probe_into_view(self.loop.now, self.engine.probe(self.loop.now), self.view.outstanding_samples)
        self.fresh = True  # no push can be newer than now

    def early_probe(self) -> None:
        self._early_probe_due = False
        if self.stopped_at is None:
            self.probe_now()
            self.lb.dispatch()

    def ask_probe(self) -> None:
        """A push or an answer wants the next probe soon (the daemon's `reprobe` event)."""
        if self._early_probe_due:
            return
        self._early_probe_due = True
        if not self.probe_s:
            self.loop.after(self.lb.cfg.early_reprobe_s, self.early_probe)
            return
        now, cfg = self.loop.now, self.lb.cfg
        # the last probe's end: an early one's, or the grid tick's probe (in flight if after now)
        ended = max(self._probe_end, self.lb.tick_at(now) + self.probe_s)
        start = max(now, ended) + early_probe_delay(cfg.early_reprobe_s, self.probe_s, max(0.0, now - ended),
                                                    cfg.max_probe_share)
        self.loop.at(start, self._costly_probe)

    def _costly_probe(self) -> None:
        """An early probe of an endpoint that takes `probe_s`: what the engine reports as it
        starts, written into the view when it lands (pushes meanwhile are unseen by it)."""
        self._early_probe_due = False  # as the daemon clears `reprobe` when a probe starts
        if self.stopped_at is not None:
            return
        now = self.loop.now
        self._probe_end = now + self.probe_s
        self.loop.at(self._probe_end, self._probe_landed, now, self.engine.probe(now), self.view.outstanding_samples)

    def _probe_landed(self, started: float, state: tuple, outstanding_at: int) -> None:
        if self.stopped_at is None and self.view.last_probe_at < started:
            self.probe_into_view(started, state, outstanding_at)
            self.mark_stale()  # it shows the engine as of `started`: the next grid probe looks again
            self.lb.dispatch()

    # -- requests ----------------------------------------------------------------------
    def push(self, req: SimRequest) -> None:
        """The scheduler placed `req` here (and counted the push on the view): run it."""
        now = self.loop.now
        if self.lb.wants_probe(self.view):
            self.ask_probe()
        req.pushed_at = now
        req.served_by = self.id
        req.served_region = self.region
        self._before_change(now)
        self._catch_up(now)
        # What the client declared is what the engine gets, as live: an answer's exact length
        # (ignore_eos), or else a cap (the context's room when none) and the length as
        # min_tokens: engines reserve decode room by the cap (bench.workloads.base.EXACT)
        declared = req.facts.max_tokens if req.facts is not None else req.output_tokens
        exact = declared == req.output_tokens
        req.left, req.outputs = req.samples, 0
        # n answers are n engine requests with the one prompt, as SGLang's tokenizer manager and
        # vLLM's parallel sampling hand them to their schedulers; the engine prefills their
        # shared prompt once (`Engine._shareable`), each sample draws its own answer
        for rid in sample_ids(req.id, req.samples):
            self.requests[rid] = req
            self.engine.submit(EngineRequest(rid, req.prompt,
                                             req.output_tokens if exact else
                                             declared or self.engine.max_request_tokens() - len(req.prompt),
                                             ignore_eos=exact, arrival=now, unique_prompt=req.unique_prompt,
                                             # a unique prompt's answer is never sent back: no draw to make
                                             sample_key=None if req.unique_prompt else answer_key(rid),
                                             min_new_tokens=0 if exact else req.output_tokens,
                                             adapter=req.adapter), now)
        self._schedule(now)

    def push_unscheduled(self, req: SimRequest) -> None:
        """Run `req` here on a front that does not run the scheduler (the peers' routers in
        bench/sim/arena.py): count the push on the view as the scheduler would, then run it."""
        record_push(self.view, 0, self.loop.now, req.samples)
        self.push(req)

    def _catch_up(self, now: float) -> None:
        """Apply the steps of a collapsed decode run that started before `now`."""
        run = self._run
        if run is not None:
            self._run = None
            self.engine.apply_decode_steps(run, run.started_before(now))

    def _schedule(self, now: float) -> None:
        self._token += 1
        t = self.engine.next_event_time(now)
        if t is not None:
            self.loop.at(t, self._wake, self._token)

    def _wake(self, token: int) -> None:
        if token != self._token:
            return
        now = self.loop.now
        self._before_change(now)
        run = self._run
        if run is not None:  # the run's steps are all done: apply them, then step normally
            self._run = None
            self.engine.apply_decode_steps(run, run.k)
            self.busy_s += run.end - run.start
        res = self.engine.step(now)
        self.busy_s += res.duration
        end = res.end
        reqs = self.requests
        for rid in res.tokens:
            req = reqs.get(rid)
            if req is not None and req.first_token is None:
                req.first_token = end
                self.loop.at(end, self.lb.first_token, req)  # the LB sees it come back then
        if res.finished:
            self.loop.at(end, self._finished, res.finished)
        self._token += 1
        run = self.engine.plan_decode_run(end)
        if run is not None:
            self._run = run
            self.loop.at(run.end, self._wake, self._token)
        elif self.engine.next_event_time(end) is not None:
            self.loop.at(end, self._wake, self._token)

    def _finished(self, finished) -> None:
        now = self.loop.now
        for f in finished:
            req = self.requests.pop(f.id)
            req.outputs += f.output_tokens
            req.cached = f.cached_tokens if req.left == req.samples else min(req.cached, f.cached_tokens)
            req.left -= 1
            if req.left:  # its other samples still decode: the client has not its whole answer
                continue
            req.finished_at = now
            settle_end(self.view, req.samples)
            settle_completion(self.view, req.samples)
            self.mark_stale()
            if req.first_token is not None:  # timed from the push, as the daemon's proxy times it
                self.lb.served(req, self.id, req.first_token - req.pushed_at if req.facts.stream else None,
                               now - req.pushed_at, req.outputs, now)
            self.lb.completed(req, now, f.prompt_tokens, req.cached, req.outputs)
        # the daemon's rule; a probe that costs nothing (view.probe_s 0) always holds here and
        # is taken at once (it never reads a view the lazy probing left behind)
        if self.lb.wants_probe(self.view):
            if self.probe_s:
                self.ask_probe()
            else:
                self.probe_now()
        self._maybe_stop()
        self.lb.dispatch()


class SimLB:
    """One region's LB: the daemon's scheduler, called in virtual time."""

    def __init__(self, region: str, loop: EventLoop, cfg: LBConfig, metrics: Metrics, *,
                 seed: int, phase: float = 0.0, on_done: Callable[[SimRequest], None] | None = None):
        self.region, self.loop, self.cfg, self.metrics = region, loop, cfg, metrics
        self.policy = make_policy(cfg.policy, seed=seed, **cfg.policy_options)
        service = WeightedService(cfg.wsc) if cfg.wsc is not None else None
        self.scheduler = Scheduler(cfg.scheduler_config(), self.policy, make_queue(cfg.queue, service=service, tiers=cfg.tiers))
        self.peer_router = PeerRouter(cfg.peer_policy, seed=seed)
        self.phase = phase
        self.replicas: dict[str, SimReplica] = {}
        self.by_model: dict[str, dict[str, SimReplica]] = {}  # model → its replicas here
        self._stale_by_model: dict[str, dict[str, SimReplica]] = {}  # model → its replicas a probe must look at
        self._refreshed: dict[str, float] = {}  # model → the grid tick its views were last brought to
        self.models_served = 1  # how many models the world has (set by the Simulation)
        self._peers: list[tuple[float, SimLB]] = []
        self._seq = 0
        self._tick_scheduled = False
        self.in_flight = 0  # forwarded to us by peers, not arrived yet
        self.arriving: dict[str, tuple[float, str, float]] = {}  # those: id → (sent at, model, prompt tokens)
        self.on_done = on_done

    @property
    def peers(self) -> list[tuple[float, "SimLB"]]:
        """(one-way latency, peer LB), nearest first."""
        return self._peers

    @peers.setter
    def peers(self, peers: list[tuple[float, "SimLB"]]) -> None:
        self._peers = peers
        for _, peer in peers:  # as lb.daemon.peer_links registers each configured peer's region
            self.peer_router.register(peer.region)

    @property
    def queue(self):
        return self.scheduler.queue

    # -- probes ------------------------------------------------------------------------
    def tick_at(self, t: float) -> float:
        """The last probe-grid instant at or before `t`."""
        i = self.cfg.probe_interval_s
        return self.phase + math.floor((t - self.phase) / i) * i

    def refresh(self, now: float, models) -> None:
        """Bring the views of `models`' replicas up to the last grid probe, lazily: only when
        the scheduler looks at them, and only the replicas that changed since their last
        probe (a probe of an unchanged one writes the same view). Which grid probe a view
        last took is all that matters, not when it was computed: a probe overwrites every
        field a probe sets, and a replica's state at a tick is kept until it is read."""
        tick = self.tick_at(now)
        refreshed = self._refreshed
        for m in models:
            if refreshed.get(m) == tick:
                continue
            refreshed[m] = tick
            stale = self._stale_by_model.get(m)
            if not stale:
                continue
            for rep in list(stale.values()):
                if not rep.fresh and rep.view.last_probe_at < tick and rep.ready:
                    rep.probe_at_tick(tick)
                if rep.fresh:
                    del stale[rep.id]

    def pass_targets(self, models: list[str]) -> list[SimReplica]:
        """The waiting models' replicas, each model's in fleet order: a pass reads no others
        (every filter and the policy look only at targets serving the entry's model)."""
        by_model = self.by_model
        return [rep for m in models for rep in by_model[m].values()]

    def waiting_models(self) -> list[str]:
        """The models served here that have a request queued: the only views a pass reads."""
        waiting = self.scheduler.waiting
        return [m for m in self.by_model if waiting(m)]

    def _probe_tick(self) -> None:
        self._tick_scheduled = False
        self.dispatch()

    def _await_tick(self) -> None:
        if not self._tick_scheduled:
            self._tick_scheduled = True
            now, step = self.loop.now, self.cfg.probe_interval_s
            nxt = self.tick_at(now) + step
            if nxt <= now:  # float rounding put the grid point at or before now
                nxt = now + step
            self.loop.at(nxt, self._probe_tick)

    # -- fleet -------------------------------------------------------------------------
    def add_replica(self, rep: SimReplica) -> None:
        self.replicas[rep.id] = rep
        self.by_model.setdefault(rep.model, {})[rep.id] = rep
        rep.stale_set = self._stale_by_model.setdefault(rep.model, {})
        rep.mark_stale()
        self.scheduler.register(rep.id)
        if rep.ready_at > self.loop.now:
            rep.view.healthy = False
            self.loop.at(rep.ready_at, rep.became_ready)
        else:  # serving from the start: probed before any request (the daemon probes before healthy)
            rep.probe_now()

    def replica_ready(self, rep: SimReplica) -> None:
        self.dispatch()

    def replica_stopped(self, rep: SimReplica) -> None:
        self.replicas.pop(rep.id, None)
        self.by_model.get(rep.model, {}).pop(rep.id, None)
        self._stale_by_model.get(rep.model, {}).pop(rep.id, None)
        rep.stale_set = None
        self.scheduler.forget(rep.id)

    # -- requests ----------------------------------------------------------------------
    def available(self, view: ReplicaView) -> bool:
        return self.scheduler.available(view)

    def wants_probe(self, view: ReplicaView) -> bool:
        return self.scheduler.wants_probe(view)

    def wants_first_tokens(self, replica_id: str) -> bool:
        return self.scheduler.wants_first_tokens(replica_id)

    def arrive(self, req: SimRequest) -> None:
        self._seq += 1
        self.scheduler.admit(QueueEntry(facts=req.facts, enqueued_at=self.loop.now, seq=self._seq, payload=req),
                             self.loop.now)  # unbounded here: never rejected
        self.dispatch()

    def dispatch(self) -> None:
        """A scheduler pass; then push what it placed, forward what it sent to a peer."""
        if not len(self.scheduler):
            return
        now = self.loop.now
        models = self.waiting_models()
        self.refresh(now, models)
        for p in self.scheduler.schedule(now, self.pass_targets(models), self._peer_set(now)):
            if p.kind is Kind.REPLICA:
                p.target.push(p.entry.payload)
            elif p.kind is Kind.PEER:
                self._forward(p.entry.payload, *p.target)
        if len(self.scheduler):
            self._await_tick()

    def _peer_set(self, now: float) -> PeerSet | None:
        return _SimPeers(self, now) if self.cfg.forward and self.peers else None

    def _forward(self, req: SimRequest, latency: float, peer: "SimLB") -> None:
        req.extra_latency += 2 * latency
        req.facts = replace(req.facts, hops=1)
        peer.in_flight += 1
        peer.arriving[req.id] = (self.loop.now, req.model, max(1, len(req.prompt)))
        self.loop.after(latency, peer.arrive_forwarded, req)

    def arrive_forwarded(self, req: SimRequest) -> None:
        self.in_flight -= 1
        self.arriving.pop(req.id, None)
        self.arrive(req)

    def first_token(self, req: SimRequest) -> None:
        """A request placed here produced its first token now (the daemon's first streamed event;
        a non-streamed answer shows none)."""
        if req.facts.stream:
            self.scheduler.first_token(req.facts.request_id, self.loop.now)

    def has_room(self) -> bool:
        """A peer's queue is short enough to take forwarded work (requests already forwarded
        here and still on the wire count as queued)."""
        return len(self.scheduler) + self.in_flight <= self.cfg.peer_queue_tau

    def served(self, req: SimRequest, replica_id: str, ttft_s: float | None, e2e_s: float, output: int, now: float) -> None:
        """A replica answered: the policy learns that replica's rates (`Scheduler.served`)."""
        self.scheduler.served(req.facts, replica_id, ttft_s, e2e_s, output, now)

    def completed(self, req: SimRequest, now: float, prompt: int, cached: int, output: int) -> None:
        self.scheduler.completed(req.facts, prompt, output)
        self.scheduler.ended(req.facts.request_id)
        if req.served_region != req.region:  # forwarded: the client's LB charged its tenant too
            for _, peer in self.peers:
                if peer.region == req.region:
                    peer.scheduler.completed(req.facts, prompt, output)
        ttft = req.first_token - req.arrival + req.extra_latency
        e2e = now - req.arrival + req.extra_latency
        self.metrics.completion(now + req.extra_latency / 2, ttft, e2e, prompt, cached, output,
                                forwarded=req.extra_latency > 0, region=req.region)
        if self.on_done:
            self.on_done(req)


class _SimPeers(PeerSet):
    """The other regions' LBs as the daemon's peer probes would show them, fresh as of now.
    Their statuses are built only when an entry has no local candidate, or a local prediction
    longer than the shortest round trip (`targets`)."""

    def __init__(self, lb: SimLB, now: float):
        super().__init__((), lb.peer_router, tau=lb.cfg.peer_queue_tau, stale_s=math.inf, forward=lb.cfg.peer_forward,
                         margin_s=lb.cfg.peer_forward_margin_s, lighter_share=lb.cfg.peer_lighter_share)
        self.lb, self.now, self._targets = lb, now, None

    def open(self, now: float) -> bool:
        if self._targets is not None:
            return super().open(now)
        return any(peer.has_room() for _, peer in self.lb.peers)

    def least_rtt_s(self) -> float | None:
        return min((2 * latency for latency, _ in self.lb.peers), default=None)  # without building statuses

    def fastest_possible_s(self, model: str, tokens: float, local_error: float) -> float | None:
        """Each peer's best case from its fit alone (`Backlog.best_case`: nothing ahead there),
        so a request this rules out would not have been forwarded: statuses are built only
        when some peer could win."""
        bounds = []
        for latency, peer in self.lb.peers:
            best = peer.scheduler.backlog.best_case(tokens)
            if best is not None:  # no fit there: no advert, no forward
                bounds.append(forward_cost(2 * latency, best[0], local_error, best[1]))
        return min(bounds, default=None)

    @property
    def targets(self) -> list[PeerTarget]:
        if self._targets is None:
            self._targets = [self._status(latency, peer) for latency, peer in self.lb.peers]
        return self._targets

    @targets.setter
    def targets(self, value) -> None:
        pass  # built on first read

    def _status(self, latency: float, peer: SimLB) -> PeerTarget:
        now, here = self.now, self.lb.scheduler
        models = [m for m in peer.by_model if here.waiting(m)]
        peer.refresh(now, models)
        free = {m: sum(1 for r in peer.by_model[m].values() if r.ready and peer.available(r.view)) for m in models}
        # forwards still on the wire are what the daemon counts as unseen by the status
        status = PeerStatus(peer.region, healthy=True, queue_len=len(peer.scheduler), free=free,
                            models=frozenset(peer.by_model), rtt_s=2 * latency, last_ok_at=now,
                            forwarded_since_status=peer.in_flight,
                            ttft=peer.scheduler.advertise([r for m in models for r in peer.by_model[m].values()], now))
        status.unseen.extend(peer.arriving.values())
        view = ReplicaView(id=f"peer:{peer.region}", url="", engine="peer", region=peer.region, models=status.models)
        return PeerTarget(PeerConfig(peer.region, "sim://" + peer.region), status, view, (latency, peer))
