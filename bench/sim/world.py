"""A scenario file → a world of regions, LBs, replicas and arrivals → results.

Scenario files are TOML or JSON with these tables (every key has a default; see
`bench/sim/scenarios/*.toml` for complete examples):

    name, duration_s, start_s (offset into the trace day), seed
    [[regions]]  name, phase_hours          (ServeGen day shifted per region: derived)
    [[models]]   name, profile, replicas    (replicas per region: int or {region = n})
    [latency]    one_way_ms                 (between any two regions)
    [lb]         config (a daemon config file, e.g. "config/single-region.toml": its [routing],
                 [pushing], [queue], [probes], [affinity] and [peering] tau), and overrides:
                 policy, pushing, queue, probe_interval_s, early_reprobe_s, max_outstanding,
                 push_credit, max_unseen, forward, peer_queue_tau
    [slo]        ttft_s, ttft_per_token_s (TTFT deadline = ttft_s + ttft_per_token_s × prompt), e2e_s
    [arrivals]   kind = "servegen" | "poisson" | "external" (only `Simulation.inject`); rate_scale (servegen) or rate (req/s per
                 region×model, poisson); shapes = "azure-conv" | "mooncake" | "fixed"
                 (prompt_tokens, output_tokens); size_scale; day; spikes = [{at_s,
                 duration_s, factor}] (servegen: Poisson arrivals on top, (factor − 1) × the
                 window's rate per region×model, so the load is factor × the base)
    [scaling]    strategy = "static" | reactive | lt-i | lt-u | lt-ua | preserve, …
"""
from __future__ import annotations

import json
import time
import tomllib
from array import array
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

import mmh3
import numpy as np

from bench.profiles import get_profile
from bench.sim import arrivals as arr
from bench.sim.core import EventLoop
from bench.sim.metrics import MINUTE, Metrics, Slo
from bench.sim.model import LBConfig, SimLB, SimReplica, SimRequest
from lb.core.affinity import AffinityConfig
from lb.core.prefix import chain_salt
from lb.core.types import RequestFacts

TOKEN_SPACE = 1 << 20  # distinct token ids per request: prompts never collide by accident
CHARS_PER_TOKEN = 4  # prefix blocks are cut in characters by the daemon: ~4 per token


def prefix_chain_params(policy) -> tuple[int, bool] | None:
    """(block_chars, isolate_tenants) of a policy that remembers prefixes (prefix-trie,
    cache-aware), None for one that does not: then no request needs a chain."""
    holder = getattr(policy, "prefix_memory", None) or policy
    block_chars = getattr(holder, "block_chars", None)
    return None if block_chars is None else (block_chars, bool(getattr(holder, "isolate_tenants", False)))


def token_chain(tokens: list[int], block_tokens: int, salt: str | None = None) -> tuple[bytes, ...]:
    """`lb.core.prefix.block_hashes` over token ids instead of text: hash i names the prompt
    up to block i (equal token prefixes give equal chains), salted per tenant the same way."""
    prev = mmh3.hash_bytes(b"lb-tenant:" + salt.encode()) if salt is not None else b""
    data = array("q", tokens).tobytes()
    step = 8 * block_tokens
    chain = []
    for start in range(0, len(data) - step + 1, step):
        prev = mmh3.hash_bytes(prev + data[start:start + step])
        chain.append(prev)
    return tuple(chain)


def token_prefix_hash(tokens: list[int], n: int) -> bytes:
    """`lb.core.prefix.prompt_prefix_hash` over token ids: the first `n` bytes of the 8 bytes a
    token that `token_chain` hashes."""
    return mmh3.hash_bytes(b"lb-prefix:" + array("q", tokens[: (n + 7) // 8]).tobytes()[:n])


@dataclass
class ModelSpec:
    name: str
    profile: str = "l4-llama3-8b"
    replicas: int | dict = 1
    # Radix-cache block size override. Day-long runs use 256: the same timing, 16x fewer cache
    # blocks to insert and evict (prefix matches then round down to 256 tokens, fine for
    # Mooncake's 512-token blocks and for Azure shapes, which share no prefix).
    block_size: int | None = None


@dataclass
class ArrivalSpec:
    kind: str = "poisson"
    rate: float = 1.0  # poisson: req/s per region×model
    rate_scale: float = 0.01  # servegen: fraction of Alibaba's volume
    shapes: str = "azure-conv"
    prompt_tokens: int = 512  # shapes = "fixed"
    output_tokens: int = 128
    size_scale: float = 1.0
    day: int = 0
    spikes: list = field(default_factory=list)  # [{at_s, duration_s, factor}]


@dataclass
class ScalingSpec:
    strategy: str = "static"
    interval_s: float = 15.0
    cold_start_s: float = 300.0  # VM + model load (SageServe: minutes)
    warm_start_s: float = 60.0  # from a warm pool / spot reclaim
    warm_pool: int = 0
    # what LT-*/PreServe plan from: "holt-winters" (lb.core.forecast, fitted on the trace's
    # earlier days, forecasting the simulated day) or "perfect" (the day's own window rates)
    forecast: str = "holt-winters"
    min_replicas: int = 1
    max_replicas: int = 64
    params: dict = field(default_factory=dict)


@dataclass
class SimConfig:
    name: str = "sim"
    duration_s: float = 600.0
    start_s: float = 0.0
    seed: int = 0
    regions: list[dict] = field(default_factory=lambda: [{"name": "local"}])
    models: list[ModelSpec] = field(default_factory=list)
    one_way_ms: float = 75.0
    lb: LBConfig = field(default_factory=LBConfig)
    slo: Slo = field(default_factory=Slo)
    arrivals: ArrivalSpec = field(default_factory=ArrivalSpec)
    scaling: ScalingSpec = field(default_factory=ScalingSpec)

    @property
    def region_names(self) -> list[str]:
        return [r["name"] for r in self.regions]

    def replicas_of(self, model: ModelSpec, region: str) -> int:
        return model.replicas.get(region, 0) if isinstance(model.replicas, dict) else int(model.replicas)


def _table(cls, data: dict | None, where: str):
    data = dict(data or {})
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"[{where}]: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    return cls(**data)


def lb_config(table: dict | None) -> LBConfig:
    """`[lb]`: `config = "FILE"` reads the daemon's config file (its format, checks and error
    messages); the table's other keys override it."""
    table = dict(table or {})
    path = table.pop("config", None)
    if isinstance(table.get("affinity"), dict):  # [lb.affinity]: checked as the daemon checks it
        table["affinity"] = AffinityConfig(**table["affinity"])
    if path is None:
        return _table(LBConfig, table, "lb")
    _table(LBConfig, table, "lb")  # unknown keys fail the same way with a file
    return LBConfig.from_daemon_config(path, **table)


def parse_config(data: dict) -> SimConfig:
    data = dict(data)
    models = [_table(ModelSpec, m, "models") for m in data.pop("models", [])]
    if not models:
        raise ValueError("[[models]]: at least one model is needed")
    for m in models:
        get_profile(m.profile)  # fails naming the known profiles
    cfg = SimConfig(
        models=models,
        lb=lb_config(data.pop("lb", None)),
        slo=_table(Slo, data.pop("slo", None), "slo"),
        arrivals=_table(ArrivalSpec, data.pop("arrivals", None), "arrivals"),
        scaling=_table(ScalingSpec, data.pop("scaling", None), "scaling"),
        one_way_ms=float(data.pop("latency", {}).get("one_way_ms", 75.0)),
        **{k: data.pop(k) for k in ("name", "duration_s", "start_s", "seed", "regions") if k in data},
    )
    if data:
        raise ValueError(f"unknown top-level key(s): {', '.join(sorted(data))}")
    return cfg


def load_config(path: str | Path) -> SimConfig:
    path = Path(path)
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    return parse_config(data)


class Simulation:
    def __init__(self, cfg: SimConfig, scaler_factory=None):
        self.cfg = cfg
        self.loop = EventLoop(cfg.start_s)
        self.metrics = Metrics(cfg.slo)
        self.rng = np.random.default_rng(cfg.seed)
        self.regions = cfg.region_names
        self.model_names = [m.name for m in cfg.models]
        self.profiles = {m.name: get_profile(m.profile).with_overrides(block_size=m.block_size) for m in cfg.models}
        self.limits = {m: min(p.max_model_len, p.kv_tokens) for m, p in self.profiles.items()}
        n_lb = len(self.regions)
        self.lbs = {r: SimLB(r, self.loop, cfg.lb, self.metrics, seed=cfg.seed + i,
                             phase=cfg.lb.probe_interval_s * i / max(1, n_lb))
                    for i, r in enumerate(self.regions)}
        latency = cfg.one_way_ms / 1000.0
        for lb in self.lbs.values():
            lb.models_served = len(self.model_names)
        for r, lb in self.lbs.items():
            lb.peers = [(latency, peer) for name, peer in self.lbs.items() if name != r]
        self.all_replicas: list[SimReplica] = []
        self._replica_no = 0
        self._req_no = 0
        for m in cfg.models:
            for r in self.regions:
                for _ in range(cfg.replicas_of(m, r)):
                    self.add_replica(r, m.name, ready_at=cfg.start_s)
        self.chain_params = prefix_chain_params(next(iter(self.lbs.values())).policy)
        # a prompt nothing shares may skip its chain only where an empty chain routes the same:
        # prefix-trie and predicted-ttft (no match either way: the whole prompt is uncached);
        # cache-aware's smallest-tree choice counts them
        self.unique_chains_matter = cfg.lb.policy not in ("prefix-trie", "predicted-ttft")
        self.shapes = self._shapes() if cfg.arrivals.kind != "external" else [arr.Shape(1, 1)]
        self.scaler = scaler_factory(self) if scaler_factory else None

    # -- fleet -------------------------------------------------------------------------
    def add_replica(self, region: str, model: str, ready_at: float) -> SimReplica:
        self._replica_no += 1
        rep = SimReplica(f"{region}/{model}/{self._replica_no}", region, model, self.profiles[model],
                         self.loop, self.lbs[region], seed=self.cfg.seed * 1000 + self._replica_no,
                         ready_at=ready_at, requested_at=self.loop.now)
        self.lbs[region].add_replica(rep)
        self.all_replicas.append(rep)
        return rep

    def pool(self, region: str, model: str) -> list[SimReplica]:
        return [r for r in self.lbs[region].replicas.values() if r.model == model]

    # -- arrivals ----------------------------------------------------------------------
    def _shapes(self) -> list[arr.Shape]:
        a = self.cfg.arrivals
        if a.shapes == "fixed":
            return [arr.Shape(a.prompt_tokens, a.output_tokens)]
        return arr.shape_pool(a.shapes, a.size_scale)

    def _prompt(self, shape: arr.Shape) -> Sequence[int]:
        self._req_no += 1
        base = self._req_no * TOKEN_SPACE
        if not shape.blocks:  # ids nothing else has: a range (its engine keys it per request)
            return range(base, base + shape.prompt_tokens)
        tokens: list[int] = []
        for b in shape.blocks:  # equal Mooncake block ids → equal 512-token blocks
            tokens.extend(range((b + 1) * 512 + (1 << 40), (b + 2) * 512 + (1 << 40)))
            if len(tokens) >= shape.prompt_tokens:
                break
        tokens = tokens[:shape.prompt_tokens]
        tokens.extend(range(base, base + shape.prompt_tokens - len(tokens)))
        return tokens

    def _deliver(self, t: float, region: str, model: str, tenant: str, shape: arr.Shape) -> None:
        # Trace requests longer than the model's context are cut to fit, as a client would.
        limit = self.limits[model]
        prompt = self._prompt(shape)[:limit - 16]
        self.inject(region, model, prompt, max(1, min(shape.output_tokens, limit - len(prompt))), tenant,
                    request_id=f"r{self._req_no}", shares_prefix=bool(shape.blocks))

    def inject(self, region: str, model: str, prompt: Sequence[int], output_tokens: int,
               tenant: str = "external", request_id: str | None = None, shares_prefix: bool = True) -> SimRequest:
        """One request arriving now at `region`'s LB (arrival generators and tests call this).
        `shares_prefix=False` promises no other request shares a block of this prompt (the
        trace shapes without Mooncake blocks: unique token ranges): under prefix-trie its
        chain is left empty, which routes exactly as a chain nothing ever matches, without
        hashing and storing it (a sixth of a busy day-3x3 hour went there, profiled), and its
        engine keys its cache blocks per request (`EngineRequest.unique_prompt`) instead of
        hashing token ids."""
        t = self.loop.now
        if request_id is None:
            self._req_no += 1
            request_id = f"r{self._req_no}"
        req = SimRequest(request_id, region, model, tenant, t, prompt, output_tokens, unique_prompt=not shares_prefix)
        req.facts = RequestFacts(request_id=request_id, model=model, prompt_tokens=len(prompt),
                                 max_tokens=output_tokens, arrival=t, user=tenant, stream=True)
        if self.chain_params is not None:  # what prefix-trie / cache-aware read (lb.core.prefix)
            block_chars, isolate = self.chain_params
            salt = chain_salt(req.facts, isolate)
            req.facts.extra[("lb.prefix.chain", block_chars, salt)] = token_chain(
                prompt, max(1, block_chars // CHARS_PER_TOKEN), salt) if shares_prefix or self.unique_chains_matter else ()
        self.metrics.arrival(t, f"{region}/{model}", region)
        self.lbs[region].arrive(req)
        return req

    def _schedule_poisson(self) -> None:
        a, end = self.cfg.arrivals, self.cfg.start_s + self.cfg.duration_s
        for region in self.regions:
            for model in self.model_names:
                n = int(a.rate * self.cfg.duration_s * 1.3 + 50)
                times = self.cfg.start_s + np.cumsum(self.rng.exponential(1.0 / a.rate, n))
                shapes = self.rng.integers(0, len(self.shapes), n)
                self._feed(iter(zip(times[times < end].tolist(), shapes.tolist())), region, model)

    def _feed(self, it, region: str, model: str, tenant: str = "poisson") -> None:
        """One heap entry per stream: schedule the next arrival when this one fires."""
        nxt = next(it, None)
        if nxt is None:
            return
        t, shape = nxt

        def fire() -> None:
            self._deliver(t, region, model, tenant, self.shapes[shape])
            self._feed(it, region, model, tenant)

        self.loop.at(t, fire)

    def _schedule_servegen(self) -> None:
        a = self.cfg.arrivals
        phases = [float(r.get("phase_hours", 0.0)) for r in self.cfg.regions]
        self.diurnal = arr.DiurnalArrivals(self.regions, self.model_names, phase_hours=phases,
                                           rate_scale=a.rate_scale, n_shapes=len(self.shapes),
                                           day=a.day, seed=self.cfg.seed)
        self._schedule_spikes()
        first = int(self.cfg.start_s // arr.WINDOW_S)
        last = int(np.ceil((self.cfg.start_s + self.cfg.duration_s) / arr.WINDOW_S))
        for w in range(first, last):
            self.loop.at(max(self.cfg.start_s, w * arr.WINDOW_S), self._open_window, w)

    def _schedule_spikes(self) -> None:
        """Unforecastable bursts: extra Poisson arrivals at (factor − 1) × the base rate."""
        for k, spike in enumerate(self.cfg.arrivals.spikes):
            at, dur, factor = float(spike["at_s"]), float(spike["duration_s"]), float(spike["factor"])
            rng = np.random.default_rng([self.cfg.seed, 7, k])
            for r, region in enumerate(self.regions):
                for m, model in enumerate(self.model_names):
                    rate = (factor - 1) * self.diurnal.expected_rate(r, m, int(at // arr.WINDOW_S))
                    if rate <= 0:
                        continue
                    n = rng.poisson(rate * dur)
                    times = np.sort(at + rng.random(n) * dur)
                    shapes = rng.integers(0, len(self.shapes), n)
                    self._feed(iter(zip(times.tolist(), shapes.tolist())), region, model, "burst")

    def _open_window(self, w: int) -> None:
        win = self.diurnal.window(w)
        lo, hi = self.cfg.start_s, self.cfg.start_s + self.cfg.duration_s
        keep = (win.t >= lo) & (win.t < hi)
        rows = zip(win.t[keep].tolist(), win.region[keep].tolist(), win.model[keep].tolist(),
                   win.tenant[keep].tolist(), win.shape[keep].tolist())
        self._feed_window(iter(rows))

    def _feed_window(self, rows) -> None:
        row = next(rows, None)
        if row is None:
            return
        t, r, m, tenant, shape = row

        def fire() -> None:
            self._deliver(t, self.regions[r], self.model_names[m], f"servegen-{tenant}", self.shapes[shape])
            self._feed_window(rows)

        self.loop.at(t, fire)

    # -- sampling ----------------------------------------------------------------------
    def _sample(self) -> None:
        now = self.loop.now
        m = self.metrics.minute(now)
        for region, lb in self.lbs.items():
            m.queue[region] = len(lb.queue)
            for model in self.model_names:
                key = f"{region}/{model}"
                pool = self.pool(region, model)
                ready = [r for r in pool if r.ready]
                m.instances[key] = len(pool)
                m.ready[key] = len(ready)
                m.utilization[key] = (sum(r.engine.probe()[2] for r in ready) / len(ready)) if ready else 0.0
        if now + MINUTE < self.cfg.start_s + self.cfg.duration_s:
            self.loop.after(MINUTE, self._sample)

    # -- run ---------------------------------------------------------------------------
    def run(self, drain_s: float = 120.0) -> dict:
        cfg = self.cfg
        wall = time.perf_counter()
        if cfg.arrivals.kind == "poisson":
            self._schedule_poisson()
        elif cfg.arrivals.kind == "servegen":
            self._schedule_servegen()
        elif cfg.arrivals.kind != "external":
            raise ValueError(f"[arrivals] kind {cfg.arrivals.kind!r}: use poisson, servegen or external")
        self.loop.at(cfg.start_s + MINUTE / 2, self._sample)
        if self.scaler:
            self.scaler.start()
        end = cfg.start_s + cfg.duration_s
        self.loop.run(end)
        self.loop.run(end + drain_s)  # let in-flight requests finish; the fleet is billed to `end`
        for rep in self.all_replicas:
            stop = min(rep.stopped_at if rep.stopped_at is not None else end, end)
            billed = max(0.0, stop - rep.requested_at)
            starting = max(0.0, min(rep.ready_at, stop) - rep.requested_at)
            self.metrics.billed(f"{rep.region}/{rep.model}", billed, starting)
        summary = self.metrics.summary(cfg.duration_s)
        if cfg.arrivals.spikes:
            summary["spikes"] = self.metrics.during([(float(s["at_s"]), float(s["at_s"]) + float(s["duration_s"]))
                                                     for s in cfg.arrivals.spikes])
        if getattr(self.scaler, "forecast_report", None):
            summary["forecast"] = self.scaler.forecast_report
        if self.scaler is not None:
            summary["scaling"] = self.scaler.report()
        summary["sim"] = {"events": self.loop.events_run, "wall_s": time.perf_counter() - wall,
                          "virtual_s": cfg.duration_s, "replicas_created": len(self.all_replicas)}
        if cfg.arrivals.kind == "servegen" and len(self.regions) > 1:
            summary["derived"] = ("multi-region traffic is one ServeGen day phase-shifted per region "
                                  "(" + ", ".join(f"{r['name']}: +{r.get('phase_hours', 0)} h" for r in cfg.regions) + ")")
        return {"summary": summary, "series": self.metrics.series()}
