"""The capacity loop: the LB tells the fleet what capacity comes next.

Every `[scaling] interval_s`, off the request path, each (region, model) pool is described
as `lb.core.scaling.ScalingSignals` from what the LB already knows — replicas and their
probed KV usage (a replica with a queue of its own counts as full), requests waiting in the
LB queue, tokens in flight (queued prefill + predicted remaining decode, from the load
anticipator), queue-latency p95, observed tokens/s, and the token forecast learned from
completions — and the configured strategy decides. Without a strategy only the stateless
`desired_replicas` is computed, for HPA/KEDA to scale on from `/metrics`.

Decisions go through SageServe's unified-pool rule (`keep_for_deferred`: replicas are not
donated while deferred NIW work waits for them) and then to `ScalingHooks`, which
rate-limits, logs and hands them to the actuators in their own tasks: a slow or failing
actuator never touches routing. Replicas the `local` actuator starts are registered here and
deregistered (drained) before their process stops.

The request path feeds this through three hooks on the dispatcher: `on_dispatch` (queue wait,
anticipator), `on_progress` (tokens streamed so far) and `on_complete` (usage: forecast,
observed tokens/s, length model).
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import time
from typing import Callable
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lb.core.anticipator import LoadAwarePolicy
from lb.core.deferred import DeferredQueue
from lb.core.forecast import ServiceForecaster
from lb.core.planner import planned_instances
from lb.core.scaling import (ScalingDecision, ScalingSignals, desired_replicas, keep_for_deferred, make_strategy,
                             pool_signals)
from lb.core.types import QueueEntry, RequestFacts
from lb.daemon.config import ReplicaConfig
from lb.daemon.registry import Registry, Replica
from lb.daemon.scaling_hooks import LocalActuator, ScalingConfig, ScalingHooks, make_actuator

log = logging.getLogger("lb.capacity")

Pool = tuple[str, str]  # (region, model)
STATELESS_KEYS = ("min_replicas", "max_replicas", "target_kv")


class Capacity:
    def __init__(self, cfg: ScalingConfig, registry: Registry, dispatcher, metrics_registry,
                 deferred: Callable[[], DeferredQueue | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.cfg = cfg
        self.registry = registry
        self.dispatcher = dispatcher
        self.deferred = deferred  # the admission gate's deferred queue (NIW entries held back), if any
        self.clock, self.wall = clock, wall
        self.strategy = make_strategy(cfg.strategy, **cfg.params) if cfg.strategy else None
        self.hooks = ScalingHooks([make_actuator(t, self._replicas_changed) for t in cfg.actuators],
                                  min_interval_s=cfg.min_interval_s)
        for actuator in self.hooks.actuators:
            if isinstance(actuator, LocalActuator):
                actuator.unmanaged = self._unmanaged
        # The load-aware routing policy already anticipates load; otherwise keep a tracker of our own.
        shared = dispatcher.policy.load_tracker
        self.own_tracker = shared is None
        self.tracker: LoadAwarePolicy = LoadAwarePolicy(cfg.kv_capacity_tokens) if shared is None else shared
        self.forecaster = ServiceForecaster(method="seasonal-naive", window_s=cfg.forecast_window_s)
        self._forecasts: dict[Pool, tuple[int, float | None, float | None]] = {}
        self.waits: collections.deque = collections.deque(maxlen=100_000)  # (t, model, queue wait s)
        self.served: collections.deque = collections.deque(maxlen=100_000)  # (t, pool, tokens)
        self.pools: set[Pool] = set()
        self.signals: dict[Pool, ScalingSignals] = {}
        self.decisions: dict[Pool, ScalingDecision] = {}
        self.kept_for_niw: dict[Pool, int] = {}
        self.sent: collections.Counter = collections.Counter()  # (region, model, direction) → to actuators
        self.managed: set[str] = set()  # replica ids the local actuator runs
        self._gone: dict[str, asyncio.Event] = {}
        self._started_at = clock()
        self._task: asyncio.Task | None = None
        self.plan: dict | None = None  # the last good `lb plan` document read from [scaling] plan_file
        self.plan_written_at = 0.0  # its file's mtime: when it has no `starts_at`, its first window starts then
        self._plan_stamp: object = None  # (mtime_ns, size) of what was read; "missing" once warned
        dispatcher.on_dispatch.append(self.dispatched)
        dispatcher.on_progress.append(self.tracker.on_progress)
        dispatcher.on_complete.append(self.completed)
        registry.on_gone(self._replica_gone)
        metrics_registry.register(_CapacityCollector(self))

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.hooks.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="capacity")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.hooks.stop()  # the local actuator stops its processes

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                self.tick(self.clock())
            except Exception:  # a bug here must not stop the next round, nor routing
                log.exception("capacity round failed")

    # -- hooks from the request path (cheap: appends and dict updates) -------------------------
    def dispatched(self, facts: RequestFacts, rep: Replica, waited: float, now: float) -> None:
        self.waits.append((now, facts.model, waited))
        if self.own_tracker:
            self.tracker.observe(facts, rep.id, now)

    def completed(self, facts: RequestFacts, rep: Replica, outcome, now: float) -> None:
        """After each attempt; `outcome` is the proxy's (usage, status reason, SSE events)."""
        if outcome.usage:
            prompt, output = outcome.usage["prompt_tokens"], outcome.usage["completion_tokens"]
        elif outcome.reason == "ok" and outcome.events:  # a stream without a usage chunk
            prompt, output = facts.prompt_tokens, max(0, outcome.events - 1)  # less `data: [DONE]`
        else:  # failed or cancelled: no length to learn from
            self.tracker.on_abort(facts.request_id, now)
            return
        region = getattr(getattr(rep, "view", None), "region", "local")
        self.served.append((now, (region, facts.model), prompt + output))
        self.forecaster.observe(region, facts.model, prompt, output, self.wall())
        self.tracker.on_complete(facts.request_id, output, now)

    # -- one round ---------------------------------------------------------------------------
    def tick(self, now: float) -> list[ScalingDecision]:
        self.read_plan()
        horizon = now - self.cfg.signal_window_s
        for q in (self.waits, self.served):
            while q and q[0][0] < horizon:
                q.popleft()
        queued: dict[str, list[QueueEntry]] = collections.defaultdict(list)
        for entry in self.dispatcher.queue:
            queued[entry.facts.model].append(entry)
        held = self.deferred()
        niw = held.by_model() if held is not None else {}
        out = []
        for pool, reps in sorted(self._members().items()):
            s = self.signals_for(pool, reps, queued.get(pool[1], []), now)
            self.signals[pool] = s
            if self.strategy is not None:
                d = self.strategy.decide(s, now)
            else:
                bounds = {k: self.cfg.params[k] for k in STATELESS_KEYS if k in self.cfg.params}
                d = ScalingDecision(*pool, s.replicas, desired_replicas(s, **bounds), "stateless kv target",
                                    "stateless", now)
            kept = keep_for_deferred(d, niw.get(pool[1], 0), self.cfg.niw_per_replica)
            self.kept_for_niw[pool] = kept.desired - d.desired
            self.decisions[pool] = kept
            if self.strategy is not None and kept.delta and self.hooks.submit(kept):
                self.sent[(*pool, "out" if kept.delta > 0 else "in")] += 1
            out.append(kept)
        return out

    def _members(self) -> dict[Pool, list[Replica]]:
        """Active replicas per pool; a pool once seen stays (it may be scaled back from zero)."""
        pools: dict[Pool, list[Replica]] = {p: [] for p in self.pools}
        for rep in self.registry.active():
            for model in rep.view.models:
                pools.setdefault((rep.view.region, model), []).append(rep)
        self.pools.update(pools)
        return pools

    def signals_for(self, pool: Pool, reps: list[Replica], queued: list[QueueEntry], now: float) -> ScalingSignals:
        region, model = pool
        span = max(1e-9, min(self.cfg.signal_window_s, now - self._started_at))
        prompt_tps, output_tps = self.forecast(pool)
        planned = None if self.plan is None else planned_instances(
            self.plan, region, model, self.wall(), written_at=self.plan_written_at, source=self.cfg.plan_source)
        return pool_signals(
            region, model, replicas=len(reps), ready=[r.view for r in reps if r.view.healthy],
            starting=sum(1 for r in reps if not r.view.healthy and not r.view.last_probe_at),
            queued=queued, available=self.dispatcher.available,
            recent_waits=[w for t, m, w in self.waits if m == model], tracker=self.tracker,
            observed_tps=sum(tok for _, p, tok in self.served if p == pool) / span,
            forecast_tps=None if prompt_tps is None else prompt_tps + output_tps, planned=planned, now=now)

    def forecast(self, pool: Pool) -> tuple[float | None, float | None]:
        """Next window's (prompt, output) tokens/s; None before a window has ended. Refitted
        once per window (seasonal-naive: no statsmodels, no fit on the event loop)."""
        wall, window_s = self.wall(), self.cfg.forecast_window_s
        window = int(wall // window_s)
        cached = self._forecasts.get(pool)
        if cached is None or cached[0] != window:
            series = self.forecaster.series.get(pool)
            if series is None or not series.complete(wall)[0]:
                cached = (window, None, None)
            else:
                prompt, output = self.forecaster.forecast(*pool, wall)
                cached = (window, prompt.values[0] / window_s, output.values[0] / window_s)
            self._forecasts[pool] = cached
        return cached[1], cached[2]

    def read_plan(self) -> None:
        """(Re-)read `[scaling] plan_file` when it changed (mtime or size). A file that does not
        parse as a plan keeps the plan we had; a file that is gone drops it (reactive again)."""
        path = self.cfg.plan_file
        if not path:
            return
        try:
            st = os.stat(path)
        except OSError as e:
            if self._plan_stamp != "missing":
                log.warning("plan_file %s: %s; scaling without a plan", path, e.strerror or e)
                self._plan_stamp, self.plan = "missing", None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._plan_stamp:
            return
        self._plan_stamp = stamp
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
            planned_instances(doc, "", "", 0.0, written_at=0.0)  # checks it is a plan at all
        except (OSError, ValueError) as e:
            log.warning("plan_file %s is not a usable `lb plan` document (%s); keeping the previous plan", path, e)
            return
        self.plan, self.plan_written_at = doc, st.st_mtime
        log.info("plan_file %s loaded: %d pools, %gs windows", path, len(doc["pools"]), float(doc.get("window_s", 600)))

    # -- the local actuator's replicas -----------------------------------------------------------
    def _unmanaged(self, region: str, model: str) -> int:
        return sum(1 for r in self.registry.active() if r.id not in self.managed
                   and r.view.region == region and model in r.view.models)

    async def _replicas_changed(self, region: str, model: str, added: list[str], removed: list[str]) -> None:
        for url in added:
            rc = ReplicaConfig(url=url, engine=self.cfg.local_engine, models=(model,))
            self.managed.add(rc.key)
            self.registry.add(rc)
        draining = []
        for url in removed:
            rep = self.registry.get(urlsplit(url).netloc)
            if rep is None:
                continue
            gone = self._gone.setdefault(rep.id, asyncio.Event())
            self.registry.remove(rep.id)  # no new requests; forgotten once in-flight ones finish
            if self.registry.get(rep.id) is rep:
                draining.append(gone.wait())
        if draining:
            try:
                await asyncio.wait_for(asyncio.gather(*draining), self.cfg.drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("scale-in: replicas still busy after %gs drain; stopping them anyway",
                            self.cfg.drain_timeout_s)

    def _replica_gone(self, rep: Replica) -> None:
        self.managed.discard(rep.id)
        gone = self._gone.pop(rep.id, None)
        if gone is not None:
            gone.set()
        if self.own_tracker:
            self.tracker.forget(rep.id)


class _CapacityCollector:
    """`/metrics` families for HPA/KEDA, read from the last round at scrape time."""

    def __init__(self, capacity: Capacity):
        self.c = capacity

    def describe(self):
        return []

    def collect(self):
        labels = ["region", "model"]
        g = {
            "desired": GaugeMetricFamily("lb_desired_replicas", "Replicas the capacity loop wants per pool", labels=labels),
            "replicas": GaugeMetricFamily("lb_pool_replicas", "Active replicas per pool (ready or starting)", labels=labels),
            "kv": GaugeMetricFamily("lb_pool_effective_kv_usage", "KV in use on ready replicas (one with its own queue counts full) plus LB-queued prompts, over ready and starting replicas", labels=labels),
            "p95": GaugeMetricFamily("lb_queue_latency_p95_seconds", "p95 of LB-queue waits over the signal window, waiting requests included", labels=labels),
            "flight": GaugeMetricFamily("lb_tokens_in_flight", "Queued prefill + predicted remaining decode tokens", labels=labels),
            "observed": GaugeMetricFamily("lb_observed_tokens_per_s", "Prompt + output tokens/s completed over the signal window", labels=labels),
            "forecast": GaugeMetricFamily("lb_forecast_tokens_per_s", "Forecast tokens/s for the next window", labels=[*labels, "kind"]),
            "kept": GaugeMetricFamily("lb_replicas_kept_for_niw", "Replicas kept from scale-in while NIW work waits (unified pool)", labels=labels),
            "planned": GaugeMetricFamily("lb_planned_replicas", "This window's count from [scaling] plan_file", labels=labels),
        }
        sent = CounterMetricFamily("lb_scaling_decisions", "Decisions handed to the actuators", labels=[*labels, "direction"])
        for pool, s in self.c.signals.items():
            d = self.c.decisions.get(pool)
            if d is not None:
                g["desired"].add_metric(list(pool), d.desired)
            g["replicas"].add_metric(list(pool), s.replicas)
            g["kv"].add_metric(list(pool), s.kv_usage)
            g["p95"].add_metric(list(pool), s.queue_p95_s)
            g["flight"].add_metric(list(pool), s.tokens_in_flight)
            g["observed"].add_metric(list(pool), s.observed_tps or 0.0)
            g["kept"].add_metric(list(pool), self.c.kept_for_niw.get(pool, 0))
            if s.planned is not None:
                g["planned"].add_metric(list(pool), s.planned)
            prompt, output = self.c._forecasts.get(pool, (0, None, None))[1:]
            if prompt is not None:
                g["forecast"].add_metric([*pool, "prompt"], prompt)
                g["forecast"].add_metric([*pool, "output"], output)
        for (region, model, direction), n in self.c.sent.items():
            sent.add_metric([region, model, direction], n)
        return [*g.values(), sent]
