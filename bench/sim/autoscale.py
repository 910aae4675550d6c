"""The scaling loop in virtual time: the daemon's strategies (`lb.core.scaling`) decide,
the simulator actuates by starting instances (ready after a cold or warm start) and draining
them (billed until their last request ends).

Signals per region×model, every `interval_s`:
- kv_usage: the daemon's own `lb.core.scaling.pool_kv_usage` over the LB's probed views of
  the ready replicas (KV in use, a replica with its own queue or no push headroom counting
  full, plus the prompt tokens waiting in the LB queue, over the KV of the ready *and
  starting* replicas: capacity already on its way counts, or the signal stays high through
  a whole 5-minute cold start and the reactive rule's 15-s cooldown asks for 20 more
  instances per start — measured: a 4-replica pool at a fifth of its capacity grew to ~9
  on average);
- planned: PreServe's N = max(P/μp, D/μd, (P+D)/μt) (`lb.core.planner.preserve_instances`)
  for this window's forecast prompt/output tokens = forecast requests × the mean request
  shape. The forecast (`[scaling] forecast`) is the daemon's Holt-Winters
  (`lb.core.forecast.forecast`, day-ahead) fitted per region×model on the ServeGen rates of
  the trace days before the simulated one (with fewer than two earlier days it falls back to
  seasonal-naive, and says so in `summary["forecast"]`), or "perfect": the day's own window
  rates (the arrivals are still random draws around them). μ starts from `[scaling.params]`
  and is re-profiled from this pool's 10-minute windows served without SLO violations
  (`profile_throughput`);
- forecast_tps / observed_tps: forecast vs the last window's measured tokens/s (LT-UA);
- anticipated_kv: each ready replica's KV now plus its queued share, held flat over the
  look-ahead (the simulator does not run the request-level anticipator).
"""
from __future__ import annotations

import math
from collections import defaultdict

from bench.sim.arrivals import WINDOW_S, WINDOWS_PER_DAY
from bench.sim.model import SimReplica
from lb.core.forecast import ape_stats, forecast
from lb.core.planner import Throughput, WindowStats, preserve_instances, profile_throughput
from lb.core.scaling import ScalingSignals, make_strategy, pool_kv_usage

SIGNAL_PARAMS = ("mu_prefill", "mu_decode", "mu_total")


class Autoscaler:
    def __init__(self, sim):
        self.sim = sim
        spec = sim.cfg.scaling
        self.spec = spec
        params = dict(spec.params)
        mu = Throughput(params.pop("mu_prefill", 560.0), params.pop("mu_decode", 100.0),
                        params.pop("mu_total", 660.0))
        self.mu = {key: mu for key in self._keys()}
        self.strategy = make_strategy(spec.strategy, min_replicas=spec.min_replicas,
                                      max_replicas=spec.max_replicas, **params)
        self.windows: dict[tuple[str, str], list[WindowStats]] = defaultdict(list)
        self.window_tokens: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        self.warm_free = spec.warm_pool
        self.decisions = 0
        self.starts = {"warm": 0, "cold": 0}
        shapes = sim.shapes
        self.mean_prompt = sum(s.prompt_tokens for s in shapes) / len(shapes)
        self.mean_output = sum(s.output_tokens for s in shapes) / len(shapes)
        self.forecast_rates: dict[tuple[str, str], list[float]] = {}  # req/s per window of the day
        self.forecast_report: dict = {}
        for lb in sim.lbs.values():
            lb.on_done = self._done

    def _keys(self):
        return [(r, m) for r in self.sim.regions for m in self.sim.model_names]

    def start(self) -> None:
        self.fit_forecasts()
        self.sim.loop.after(self.spec.interval_s, self._tick)
        self.sim.loop.at(self.sim.cfg.start_s + WINDOW_S - self.sim.cfg.start_s % WINDOW_S, self._close_window)

    # -- measurements ------------------------------------------------------------------
    def _done(self, req) -> None:
        acc = self.window_tokens[(req.served_region, req.model)]
        acc[0] += len(req.prompt)
        acc[1] += req.output_tokens
        if not self.sim.cfg.slo.met(req.first_token - req.arrival + req.extra_latency,
                                    req.finished_at - req.arrival + req.extra_latency, len(req.prompt)):
            acc[2] += 1

    def _close_window(self) -> None:
        for key in self._keys():
            p, d, bad = self.window_tokens.pop(key, [0.0, 0.0, 0])
            ready = [r for r in self.sim.pool(*key) if r.ready]
            if ready and d > 0:
                self.windows[key].append(WindowStats(p, d, len(ready), WINDOW_S, bad))
                try:  # saturated clean windows only: an idle window says nothing of μ
                    busy = [w for w in self.windows[key] if w.prompt_tokens / w.instances / WINDOW_S
                            > 0.5 * self.mu[key].prefill]
                    self.mu[key] = profile_throughput(busy, quantile=0.9)
                except ValueError:
                    pass
        self.sim.loop.after(WINDOW_S, self._close_window)

    def fit_forecasts(self) -> None:
        """Day-ahead request-rate forecasts per region×model, from the trace's earlier days."""
        diurnal = getattr(self.sim, "diurnal", None)
        if diurnal is None or self.spec.forecast == "perfect":
            return
        if self.spec.forecast != "holt-winters":
            raise ValueError(f"[scaling] forecast {self.spec.forecast!r}: use holt-winters or perfect")
        methods, apes = set(), []
        for (region, model) in self._keys():
            r, m = self.sim.regions.index(region), self.sim.model_names.index(model)
            history = [diurnal.expected_rate(r, m, w, day) for day in range(diurnal.day)
                       for w in range(WINDOWS_PER_DAY)]
            fc = forecast(history, WINDOWS_PER_DAY)
            methods.add(fc.method)
            self.forecast_rates[(region, model)] = list(fc.values)
            actual = [diurnal.expected_rate(r, m, w) for w in range(WINDOWS_PER_DAY)]
            if any(actual):
                apes.append(ape_stats(actual, fc.values))
        self.forecast_report = {
            "method": "/".join(sorted(methods)), "trained_on_days": diurnal.day,
            "horizon": "day-ahead, 10-min windows",
            "mean_ape_pct": sum(a for a, _ in apes) / len(apes) if apes else None,
            "max_ape_pct": max(b for _, b in apes) if apes else None,
        }

    def planned(self, region: str, model: str, now: float) -> tuple[int | None, float | None]:
        diurnal = getattr(self.sim, "diurnal", None)
        if diurnal is None:
            return None, None
        w = int(now // WINDOW_S)
        fitted = self.forecast_rates.get((region, model))
        rate = (fitted[w % WINDOWS_PER_DAY] if fitted is not None else
                diurnal.expected_rate(self.sim.regions.index(region), self.sim.model_names.index(model), w))
        p, d = rate * self.mean_prompt * WINDOW_S, rate * self.mean_output * WINDOW_S
        return preserve_instances(p, d, self.mu[(region, model)], WINDOW_S, self.spec.min_replicas), (p + d) / WINDOW_S

    # -- the loop ----------------------------------------------------------------------
    def signals(self, region: str, model: str, now: float) -> ScalingSignals:
        pool = [r for r in self.sim.pool(region, model) if not r.draining]
        ready = [r for r in pool if r.ready]
        starting = len(pool) - len(ready)
        lb = self.sim.lbs[region]
        queued = lb.scheduler.waiting_tokens(model)
        lb.refresh(now, [model])  # the views as of the last probe, as the daemon's are
        kv = pool_kv_usage([r.view for r in ready], starting=starting, queued_tokens=queued, available=lb.available)
        cap = sum(r.engine.profile.kv_tokens for r in pool)
        used = sum(r.engine.probe()[2] * r.engine.profile.kv_tokens for r in ready)
        planned, forecast = self.planned(region, model, now)
        key = (region, model)
        last = self.windows[key][-1] if self.windows[key] else None
        observed = (last.prompt_tokens + last.output_tokens) / WINDOW_S if last else None
        share = queued / cap if cap else 0.0
        return ScalingSignals(region, model, len(pool), kv_usage=kv, starting=starting, planned=planned,
                              forecast_tps=forecast, observed_tps=observed,
                              anticipated_kv=tuple((r.engine.probe()[2] + share,) * 8 for r in ready),
                              tokens_in_flight=int(used + queued))

    def _tick(self) -> None:
        now = self.sim.loop.now
        for region, model in self._keys():
            decision = self.strategy.decide(self.signals(region, model, now), now)
            if decision.delta:
                self.decisions += 1
                self.actuate(region, model, decision.delta, now)
        if now + self.spec.interval_s < self.sim.cfg.start_s + self.sim.cfg.duration_s:
            self.sim.loop.after(self.spec.interval_s, self._tick)

    def actuate(self, region: str, model: str, delta: int, now: float) -> None:
        pool = [r for r in self.sim.pool(region, model) if not r.draining]
        if delta > 0:
            for _ in range(delta):
                warm = self.warm_free > 0
                start = self.spec.warm_start_s if warm else self.spec.cold_start_s
                if warm:  # the pool refills behind it: a replacement warms up in a cold start
                    self.warm_free -= 1
                    self.sim.loop.after(self.spec.cold_start_s, self._refill_warm)
                self.starts["warm" if warm else "cold"] += 1
                self.sim.add_replica(region, model, ready_at=now + start)
            return
        # scale in: starting instances first (cancel), then the least loaded ready ones
        victims = sorted(pool, key=lambda r: (r.ready, len(r.requests)))[:-delta]
        for rep in victims:
            if not rep.ready:
                rep.ready_at = math.inf  # never serves; billed until now
            rep.drain()
            self._refill_warm()  # a released instance goes back to the warm pool if it has room

    def _refill_warm(self) -> None:
        self.warm_free = min(self.spec.warm_pool, self.warm_free + 1)

    def report(self) -> dict:
        """What the scaler did; warm-pool instances are not billed to the service (they are
        the spot/NIW capacity SageServe reclaims), so what holding them would cost is given
        apart: `warm_pool_instance_hours`."""
        return {"strategy": self.spec.strategy, "decisions": self.decisions,
                "warm_starts": self.starts["warm"], "cold_starts": self.starts["cold"],
                "warm_pool": self.spec.warm_pool,
                "warm_pool_instance_hours": self.spec.warm_pool * self.sim.cfg.duration_s / 3600.0}
