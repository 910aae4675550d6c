"""One system in front of one simulated fleet: the world `sim-compare` runs each seed in.

A `Fleet` is regions of replicas (each a `SimReplica` on the emulator's engine model, some
possibly slower) with one-way WAN latencies between regions. A system is either `lb`
(one `SimLB` per region with SkyWalker peering, built by `build_lb_fronts`, the single seam
between this module and bench/sim/model.py) or a peer router (`PeerFront`: one central
router in the first region that pushes every request to a replica the moment it arrives,
as sglang-router, vllm-router and nginx do, reaching other regions' replicas across the
WAN as the live comparison's delay proxies do).

Clients (bench/sim/clients.py) call `Arena.send` from their region; the arena adds the WAN
hop to the region's front and `HTTP_S` each way, and calls back with a `Done` (client-observed TTFT and E2E,
tokens, cached tokens) when the last token is back at the client.
"""
from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

from bench.profiles import Profile, get_profile
from bench.sim.core import EventLoop
from bench.sim.metrics import Metrics, Slo
from bench.sim.model import LBConfig, SimLB, SimReplica, SimRequest
from bench.sim.peer_policies import PeerPolicy, PeerRequest
from bench.sim.world import CHARS_PER_TOKEN, prefix_chain_params, token_chain, token_prefix_hash
from bench.stats import RequestRecord
from bench.workloads.base import EXACT, check_max_tokens, declared_max_tokens
from lb.core.prefix import PREFIX_HASHER, chain_salt
from lb.core.types import RequestFacts, Tier


# One way through the HTTP stack between a client and the engine (client, LB, engine server on
# one network), in engine seconds. Not zero: a request sent when its parent's last token
# arrives reaches the engine after the next batch has formed, as it does live (without it
# every closed-loop child joined the very step its parent finished at, ~1 step early).
HTTP_S = 0.002
# A live hop is not the same every time (the event loops of client, LB and engine are busy or
# not), and a closed-loop tree workload is chaotic in it: which replica a burst's children land
# on turns on which of two predictions is smaller by a millisecond. `http_jitter` = j draws each
# hop uniformly from HTTP_S x [1 - j, 1 + j] (seeded), so one workload seed gives the spread of
# results a live run draws from; 0 (sim-compare's default) keeps every system on one timeline.


@dataclass(frozen=True)
class RegionSpec:
    name: str
    replicas: int
    slow_replicas: int = 0  # of which this many run `slow_factor`× slower
    weight: float = 1.0  # share of the clients (or program arrivals) that start here


@dataclass(frozen=True)
class FleetSpec:
    regions: tuple[RegionSpec, ...]
    profile: str = "l4-llama3-8b"
    slow_factor: float = 2.0
    latency_ms: dict = field(default_factory=dict)  # "a-b" -> one-way ms, either order
    # None: every replica serves from the start. Else each region's last replica joins at this
    # virtual second (a scale-out landing at a busy fleet: `sim-compare --join-at`), cold.
    join_at_s: float | None = None
    # None: every replica runs `profile`. Else every second replica of each region runs this
    # profile instead (another engine's scheduler on the same hardware: a fleet of vLLM and
    # SGLang replicas side by side, as during a migration); its slow replicas are slowed too.
    alt_profile: str | None = None
    # None: no LoRA adapters. Else every replica serves the base model and every adapter, and one
    # batch runs at most this many adapters (`Profile.max_loras`)
    max_loras: int | None = None

    def one_way(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        ms = self.latency_ms.get(f"{a}-{b}", self.latency_ms.get(f"{b}-{a}", 0.0))
        return ms / 1000.0

    @property
    def replicas(self) -> int:
        return sum(r.replicas for r in self.regions)


def adapter_token(adapter: str) -> int:
    """A token id standing for a LoRA adapter ahead of its prompt (outside every prompt's ids), so
    a peer router's prefix index, kept per model, never matches one adapter's prompt to another's."""
    return (1 << 40) + zlib.crc32(adapter.encode())


def slowed(profile: Profile, factor: float) -> Profile:
    """The same engine with every step `factor`× longer (an older GPU, a noisy neighbour)."""
    return profile.with_overrides(name=f"{profile.name}-x{factor:g}", step_base_s=profile.step_base_s * factor,
                                  prefill_token_s=profile.prefill_token_s * factor,
                                  decode_seq_s=profile.decode_seq_s * factor,
                                  context_token_s=profile.context_token_s * factor)


@dataclass(slots=True)
class Done:
    req: SimRequest
    sent_at: float
    ttft: float
    e2e: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


def as_records(done: list[Done]) -> list[RequestRecord]:
    """The simulator's answers as the live client's records, so `bench.stats` measures both."""
    return [RequestRecord(d.req.id, d.sent_at, ok=True, ttft=d.ttft, e2e=d.e2e, prompt_tokens=d.prompt_tokens,
                          cached_tokens=d.cached_tokens, output_tokens=d.output_tokens) for d in done]


@dataclass(slots=True)
class Call:
    """One request a client sends: the prompt as tokens and who it belongs to."""

    request_id: str
    region: str
    tokens: list[int]
    output_tokens: int
    user: str | None = None
    session: str | None = None
    interaction_id: str | None = None
    stage: int | None = None
    final: bool = False
    tier: Tier = Tier.IW_N
    app: str | None = None  # the X-LB-App header live clients send (bench.workloads.base.RequestSpec.app)
    samples: int = 1  # the body's `n`: answers sampled in parallel, each `output_tokens` long
    adapter: str | None = None  # the LoRA adapter its `model` names (every replica serves the base and all adapters)


class PeerFront:
    """A peer router: blind pushing, its policy over its own in-flight counts (and, for a router
    that polls the engines, their metrics as of its last scrape), no queue.
    Implements what `SimReplica` calls on its LB (tick_at, cfg, dispatch, completed, ...)."""

    class _Cfg:
        probe_interval_s = 0.1  # the grid a replica keeps its state on (`tick_at`)
        early_reprobe_s = 0.005
        max_probe_share = 1.0  # nothing here decides on the probes (`wants_probe` below)

    def __init__(self, region: str, loop: EventLoop, policy: PeerPolicy, fleet: FleetSpec,
                 on_done: Callable[[SimRequest, int, int, int], None]):
        self.region, self.loop, self.policy, self.fleet = region, loop, policy, fleet
        self.cfg = self._Cfg()
        if policy.scrape_interval_s is not None:  # a router that polls the engines: on its own period
            self.cfg.probe_interval_s = policy.scrape_interval_s
        policy.bind(self.scraped)
        if hasattr(policy, "bind_lora"):
            policy.bind_lora(self.scraped_lora)
        self.replicas: dict[str, SimReplica] = {}
        self.order: list[str] = []
        self.inflight: dict[str, int] = {}
        self.on_done = on_done

    def scraped(self, worker: str) -> tuple[int, float]:
        """(waiting, KV usage) of `worker`'s engine as of the router's last poll: the state each
        replica keeps as of the last grid tick (`SimReplica._before_change`), as `lb`'s probes
        read it, else its live state, unchanged since that tick."""
        rep = self.replicas[worker]
        state = rep.snap if rep.snap_tick == self.tick_at(self.loop.now) else rep.engine.probe()
        return state[0], state[2]

    def scraped_lora(self, worker: str) -> tuple[frozenset, frozenset, int]:
        """(adapters running, adapters waiting, max LoRAs) of `worker`'s engine, as vLLM's
        `vllm:lora_requests_info` says them at the router's last poll; none from an SGLang engine,
        whose metrics do not name them."""
        engine = self.replicas[worker].engine
        p = engine.profile
        if p.max_loras is None or p.new_token_ratio is not None:
            return frozenset(), frozenset(), 0
        running, waiting = engine.adapters()
        return frozenset(running), frozenset(waiting), p.max_loras

    def tick_at(self, t: float) -> float:
        i = self.cfg.probe_interval_s
        return math.floor(t / i) * i

    def add_replica(self, rep: SimReplica) -> None:
        self.replicas[rep.id] = rep
        self.inflight[rep.id] = 0
        if rep.ready_at > self.loop.now:  # a worker joining later: added when it is ready
            self.loop.at(rep.ready_at, rep.became_ready)
        else:
            self.order.append(rep.id)

    def arrive(self, req: SimRequest, call: Call) -> None:
        now = self.loop.now
        # A router that keeps one prefix index per model (SGLang Router's per-model trees; llm-d
        # hashes the model into a prompt's first block): an adapter's prompts are its own
        tokens = call.tokens if call.adapter is None else [adapter_token(call.adapter), *call.tokens]
        peer_req = PeerRequest(call.request_id, tokens, session=call.session, user=call.user, adapter=call.adapter)
        target = self.policy.choose(peer_req, self.order, self.inflight, now)
        self.inflight[target] += 1
        rep = self.replicas[target]
        hop = self.fleet.one_way(self.region, rep.region)
        if hop:
            req.extra_latency += 2 * hop
            self.loop.after(hop, rep.push_unscheduled, req)
        else:
            rep.push_unscheduled(req)

    # what SimReplica calls
    def dispatch(self) -> None:
        pass

    def wants_first_tokens(self, replica_id: str) -> bool:
        return False  # a peer router reads no first-token count

    def wants_probe(self, view) -> bool:
        return True  # probes change nothing here (no queue, no pushing gate); kept as before

    def replica_ready(self, rep: SimReplica) -> None:
        self.order.append(rep.id)  # the router's worker list grows (a ring is rebuilt on its next choice)

    def replica_stopped(self, rep: SimReplica) -> None:
        pass

    def served(self, req: SimRequest, replica_id: str, ttft_s: float, e2e_s: float, output: int, now: float) -> None:
        pass  # the peers' published policies learn nothing from response times

    def first_token(self, req: SimRequest) -> None:
        pass  # the peers' published policies do not predict time to first token

    def completed(self, req: SimRequest, now: float, prompt: int, cached: int, output: int) -> None:
        self.inflight[req.served_by] -= 1
        self.on_done(req, prompt, cached, output)


class CompareLB(SimLB):
    """`SimLB` reporting each completion with its token counts to the arena."""

    def __init__(self, *args, on_done: Callable[[SimRequest, int, int, int], None], **kw):
        super().__init__(*args, **kw)
        self.report = on_done

    def completed(self, req: SimRequest, now: float, prompt: int, cached: int, output: int) -> None:
        super().completed(req, now, prompt, cached, output)
        self.report(req, prompt, cached, output)


def lb_config(**overrides) -> LBConfig:
    """`lb`'s default configuration as the daemon ships it (`LBConfig`'s defaults are the
    daemon's), with a variant's overrides."""
    return LBConfig(**overrides)


def build_lb_fronts(loop: EventLoop, fleet: FleetSpec, cfg: LBConfig, seed: int,
                    on_done: Callable[[SimRequest, int, int, int], None]) -> dict[str, SimLB]:
    """The seam to bench/sim/model.py: one `lb` per region, peered nearest first."""
    metrics = Metrics(Slo())
    names = [r.name for r in fleet.regions]
    lbs = {name: CompareLB(name, loop, cfg, metrics, seed=seed + i, phase=cfg.probe_interval_s * i / len(names),
                           on_done=on_done)
           for i, name in enumerate(names)}
    for name, lb in lbs.items():
        lb.peers = sorted(((fleet.one_way(name, other), peer) for other, peer in lbs.items() if other != name),
                          key=lambda p: p[0])
    return lbs


class Arena:
    """One seed of one system: fleet, fronts, and the requests clients send through them."""

    def __init__(self, fleet: FleetSpec, system: str, *, seed: int, lb_cfg: LBConfig | None = None,
                 peer: PeerPolicy | None = None, http_s: float = HTTP_S, http_jitter: float = 0.0,
                 jitter_seed: int = 0, stream: bool = True, max_tokens: str | int = EXACT, headers: bool = True):
        self.fleet, self.system, self.seed = fleet, system, seed
        # False: clients send none of lb's headers (session, interaction, stage, last call, app),
        # as third-party clients do; the `user` field stays (the OpenAI body carries it)
        self.headers = headers
        self.max_tokens = check_max_tokens(max_tokens)  # what clients declare (`declared_max_tokens`)
        self._http_s, self._jitter = http_s, http_jitter
        self.stream = stream  # False: every client asks for whole answers: the LB sees no first token
        self._rng = random.Random(f"http-{seed}-{jitter_seed}")
        self.loop = EventLoop()
        lora = {"max_loras": fleet.max_loras}
        self.profile = get_profile(fleet.profile).with_overrides(**lora)
        self.alt_profile = None if fleet.alt_profile is None else get_profile(fleet.alt_profile).with_overrides(**lora)
        self.callbacks: dict[str, tuple[Call, float, Callable[[Done], None]]] = {}
        self.arrived: dict[str, SimRequest] = {}  # requests in flight that reached their front
        self.done: list[Done] = []
        self.sent = 0
        if peer is not None:
            central = fleet.regions[0].name
            front = PeerFront(central, self.loop, peer, fleet, self._completed)
            self.fronts = {r.name: front for r in fleet.regions}
            self.chain_params = None
        else:
            self.fronts = build_lb_fronts(self.loop, fleet, lb_cfg or lb_config(), seed, self._completed)
            self.chain_params = prefix_chain_params(next(iter(self.fronts.values())).policy)
        self.replicas: list[SimReplica] = []
        n = 0
        for region in fleet.regions:
            for k in range(region.replicas):
                n += 1
                profile = self.alt_profile if self.alt_profile is not None and k % 2 else self.profile
                profile = slowed(profile, fleet.slow_factor) if k < region.slow_replicas else profile
                front = self.fronts[region.name]
                joins = fleet.join_at_s is not None and k == region.replicas - 1
                rep = SimReplica(f"{region.name}/{n}", region.name, profile.model, profile, self.loop, front,
                                 seed=seed * 1000 + n, ready_at=fleet.join_at_s if joins else 0.0, requested_at=0.0)
                front.add_replica(rep)
                self.replicas.append(rep)
        self.model = self.profile.model
        self.limit = min(self.profile.max_model_len, self.profile.kv_tokens)

    def http_s(self) -> float:
        """One hop through the HTTP stack (see HTTP_S)."""
        if not self._jitter:
            return self._http_s
        return self._http_s * (1.0 + self._jitter * (2.0 * self._rng.random() - 1.0))

    def _front_of(self, region: str):
        front = self.fronts[region]
        return front, self.fleet.one_way(region, front.region)

    def send(self, call: Call, on_done: Callable[[Done], None]) -> None:
        """The client in `call.region` sends now; `on_done` runs when its last token is back."""
        tokens = call.tokens[: self.limit - 16]
        output = max(1, min(call.output_tokens, self.limit - len(tokens)))
        call.tokens, call.output_tokens = tokens, output
        if not self.headers:
            call.session = call.interaction_id = call.app = call.stage = None
            call.final = False
        sent = self.loop.now
        self.sent += 1
        self.callbacks[call.request_id] = (call, sent, on_done)
        _, hop = self._front_of(call.region)
        self.loop.after(hop + self.http_s(), self._arrive, call)

    def _arrive(self, call: Call) -> None:
        now = self.loop.now
        req = SimRequest(call.request_id, call.region, self.model, call.user or "anonymous", now,
                         call.tokens, call.output_tokens, samples=call.samples, adapter=call.adapter)
        self.arrived[req.id] = req
        front, _ = self._front_of(call.region)
        req.facts = RequestFacts(request_id=call.request_id, model=self.model, prompt_tokens=len(call.tokens),
                                 max_tokens=declared_max_tokens(self.max_tokens, call.output_tokens,
                                                                self.limit - len(call.tokens)),
                                 arrival=now, user=call.user, session=call.session,
                                 interaction_id=call.interaction_id, interaction_stage=call.stage,
                                 final_call=call.final, tier=call.tier, stream=self.stream, app=call.app,
                                 samples=call.samples, adapter=call.adapter)
        if isinstance(front, PeerFront):
            front.arrive(req, call)
            return
        req.region = front.region
        self.hash_prompt(req.facts, call.tokens)
        front.arrive(req)

    def hash_prompt(self, facts: RequestFacts, tokens: list[int]) -> None:
        """Give `facts` the prefix chain of `tokens`, as `lb.core.prefix.request_chain` hashes
        a prompt's text (nothing when `lb`'s policy keeps no prefix memory)."""
        if self.chain_params is not None:
            block_chars, isolate = self.chain_params
            salt = chain_salt(facts, isolate)
            facts.extra[("lb.prefix.chain", block_chars, salt)] = token_chain(
                tokens, max(1, block_chars // CHARS_PER_TOKEN), salt)
            facts.extra[PREFIX_HASHER] = (8 * len(tokens), lambda n: token_prefix_hash(tokens, n))

    def _completed(self, req: SimRequest, prompt: int, cached: int, output: int) -> None:
        call, sent, on_done = self.callbacks.pop(req.id)
        self.arrived.pop(req.id, None)
        _, hop = self._front_of(call.region)
        back = req.extra_latency / 2 + hop + self.http_s()  # replica -> (forwarding LB) -> front -> client
        done = Done(req, sent, req.first_token + back - sent, self.loop.now + back - sent, prompt, cached, output)
        self.done.append(done)
        self.loop.after(back, on_done, done)

    def waited(self, since: float) -> list[float]:
        """The TTFT of every request sent at `since` or later, answered or not: one with no first
        token yet counts at what it has waited so far (a lower bound). Latencies over answered
        requests alone flatter a system that leaves requests waiting past the run's end: at 1.1x
        capacity on the reasoning replay one peer's p90 over answered requests was 0.37x `lb`'s
        (seed 0) while it had left 1.7x as many requests without a first token."""
        return [t for _, t in self._waits(since)]

    def waited_by_user(self, since: float) -> dict[str, list[float]]:
        """`waited`, per user (tenant); a call that names none belongs to no tenant."""
        out: dict[str, list[float]] = {}
        for user, t in self._waits(since):
            if user is not None:
                out.setdefault(user, []).append(t)
        return out

    def waited_between(self, since: float, until: float) -> list[float]:
        """`waited` for the requests sent in [since, until)."""
        return [t for _, t in self._waits(since, until)]

    def _waits(self, since: float, until: float = math.inf) -> Iterator[tuple[str | None, float]]:
        now = self.loop.now
        for d in self.done:
            if since <= d.sent_at < until:
                yield d.req.facts.user, d.ttft
        for rid, (call, sent, _) in self.callbacks.items():
            if since <= sent < until:
                req = self.arrived.get(rid)
                first = req.first_token if req is not None else None
                yield call.user, now - sent if first is None else first - sent

    @property
    def in_flight(self) -> int:
        return len(self.callbacks)
