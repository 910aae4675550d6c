"""The daemon's configuration: TOML (stdlib `tomllib`) validated into frozen dataclasses.

A bad config fails at start with the key path and the fix, e.g.
`replicas[1].engine: 'sglng' is not allowed; use one of: auto, sglang, vllm, llamacpp, openai`.
Every knob has a default that works; `config/single-region.toml` shows them all.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib.util
import json
import math
import os
import re
import tomllib
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from urllib.parse import urlsplit

from lb.core import engines
from lb.core.engines import REDETECT_S
from lb.core.admission import AdmissionConfig
from lb.core.affinity import AffinityConfig
from lb.core.breaker import BreakerConfig
from lb.core.leases import DEFAULT_LEASE_S
from lb.core.budgets import BudgetConfig
from lb.core.coalesce import coalesce_config
from lb.core.cors import origin_problem
from lb.core.deferred import DeferredConfig
from lb.core.discovery import DiscoveryConfig
from lb.core.fairness import FairnessConfig
from lb.core.identity import IdentityConfig
from lb.core.peering import PeerConfig, PeeringConfig, peers_from_list
from lb.core.planner import PLANNER_KEYS
from lb.core.policies import DEFAULT_POLICY, make_policy
from lb.core.queueing import make_queue
from lb.core.pushing import DEFAULT_MAX_OUTSTANDING, DEFAULT_MAX_UNSEEN, DEFAULT_PUSH_CREDIT
from lb.core.tiers import TierConfig
from lb.core.types import Pushing
from lb.core.urls import DEFAULT_DENY, parse_deny, url_for_display, url_problem
from lb.daemon import tls
from lb.daemon.scaling_hooks import ScalingConfig

ENGINES = engines.ENGINES  # auto, sglang, vllm, llamacpp, openai
PUSHING_MODES = tuple(p.value for p in Pushing)


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 8 * 1024 * 1024  # larger bodies get 413
    admin_token: str = ""  # bearer token for /admin; empty disables admin (env LB_ADMIN_TOKEN)
    shutdown_grace_s: float = 30.0  # how long in-flight requests may finish on SIGTERM
    access_log: bool = True  # one JSON line per request on stdout
    # Hostile clients (docs/reliability.md): a connection that has not sent a whole request
    # head this long after opening (slowloris), or idles this long between requests, is closed.
    idle_timeout_s: float = 60.0
    body_timeout_s: float = 30.0  # reading a request body longer than this: 408
    max_connections: int = 10000  # open client connections; beyond it a new one gets 503 and is closed
    # Address ranges and host names POST /admin/replicas refuses (resolved first), so the admin
    # API cannot point lb at cloud metadata; loopback stays allowed. Config-file replicas are not checked.
    admin_replica_deny: tuple[str, ...] = DEFAULT_DENY
    tls_cert: str = ""  # PEM certificate (chain): the listener serves HTTPS; re-read on SIGHUP (docs/operations.md)
    tls_key: str = ""  # its private key (PEM); empty: in tls_cert
    tls_client_ca: str = ""  # CA bundle: clients must present a certificate it signed (mTLS between peer LBs)
    tracing: bool = False  # OpenTelemetry spans (the otel extra); also on when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER is set
    # Browser pages allowed to call lb (CORS, lb.core.cors): origins ("https://app.example.com")
    # or "*"; empty: no cross-origin access, as vLLM's default. Reloaded on SIGHUP.
    cors_allowed_origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class UpstreamConfig:
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0  # silence between two chunks that ends a request
    retries: int = 2  # extra attempts on another replica, only before the first byte
    backoff_base_s: float = 0.02
    backoff_cap_s: float = 0.5
    max_connections_per_replica: int = 1024
    # A streamed request whose replica has not sent response headers this long after the
    # request went out is retried elsewhere (engines send them at once, before any queueing).
    first_byte_timeout_s: float = 15.0
    # Bounds on what a replica can make `lb` hold (docs/security.md):
    max_response_bytes: int = 32 * 1024 * 1024  # a non-streamed answer larger than this: 502 upstream_too_large
    max_error_body_bytes: int = 64 * 1024  # an error body is read up to this (its message kept), the rest dropped
    max_sse_line_bytes: int = 1024 * 1024  # a server-sent event line longer than this ends the stream (retried before the first byte)
    # A request outstanding this long on a replica whose probes have shown nothing running or
    # waiting all that time is hung (lb.core.hung): retried elsewhere, or its stream ended
    # with an error event; the replica is marked suspect. 0 turns the check off.
    hung_after_s: float = 20.0
    tls_ca_file: str = ""  # CA bundle trusted for https:// replicas (empty: the system's)
    tls_client_cert: str = ""  # client certificate presented to replicas that ask for one
    tls_client_key: str = ""  # its private key; empty: in tls_client_cert


# Request headers passed upstream besides the ones every request carries (Content-Type, Accept,
# Authorization unless [identity] api_keys is set or the replica has its own key, X-Request-Id).
DEFAULT_FORWARD_HEADERS = ("traceparent", "tracestate", "OpenAI-Organization", "OpenAI-Project")
# Never forwarded, whatever the allowlist says: hop-by-hop and framing headers (RFC 9110 7.6.1),
# and lb's own namespace (identity, tiers, peering: `x-lb-*`).
NEVER_FORWARDED = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                             "trailer", "transfer-encoding", "upgrade", "host", "content-length", "cookie"})


@dataclass(frozen=True)
class ProxyConfig:
    # request headers passed upstream besides Content-Type, Accept, Authorization and X-Request-Id:
    # names, or prefixes ending in `*` ("x-trace-*"), any case; x-lb-* and hop-by-hop never pass (docs/api.md)
    forward_headers: tuple[str, ...] = DEFAULT_FORWARD_HEADERS


@dataclass(frozen=True)
class ProbeConfig:
    interval_s: float = 0.1
    # a replica with no work on it (none of this LB's requests, nothing running or waiting at its
    # last probe) and a clean health record is probed every this many intervals: 1 probes every
    # replica every interval (lb.core.pushing.probe_gap)
    idle_intervals: int = 5
    timeout_s: float = 0.5
    unhealthy_after: int = 3  # consecutive failed probes
    healthy_after: int = 2  # consecutive good probes to come back
    early_reprobe_s: float = 0.002  # after a push, re-probe that replica this soon (when requests queue or its headroom is spent)
    # early re-probes keep probing under this share of a replica's time (probe latency / (latency
    # + gap)): vLLM renders /metrics in 6-17 ms of its API server, and back-to-back probes under load took a third of it
    max_probe_share: float = 0.25
    # a replica of engine "auto" that showed no load endpoint is asked again this often: it may
    # have answered before its metrics were up (lb.core.engines)
    redetect_s: float = REDETECT_S
    # a replica whose models were discovered (no `models` in its config) has its /v1/models read
    # again this often: adapters loaded or unloaded at run time (vLLM's and SGLang's
    # /load_lora_adapter) come and go from its list
    models_refresh_s: float = 30.0


@dataclass(frozen=True)
class PushingConfig:
    mode: str = Pushing.SP_PENDING.value
    max_outstanding: int = DEFAULT_MAX_OUTSTANDING  # sp-outstanding, and sp-pending over engines without a queue probe
    push_credit: int = DEFAULT_PUSH_CREDIT  # sp-pending: unseen pushes to an engine that does not report its KV room
    max_unseen: int = DEFAULT_MAX_UNSEEN  # sp-pending: unseen pushes to one replica at most, whatever its room
    # sp-pending: an answered call of an interaction under way (x-lb-interaction-id without
    # x-lb-final-call, else x-lb-session) keeps its context out of the replica's headroom until
    # its next call arrives, at most this long (lb.core.leases); 0: off
    lease_s: float = DEFAULT_LEASE_S


@dataclass(frozen=True)
class QueueConfig:
    order: str = "wsc"  # FairServe WSC: one tenant alone is served in arrival order (docs/fairness.md)
    max_len: int = 4096  # beyond this: 429
    timeout_s: float = 300.0  # longest wait in the LB queue before 503
    retry_after_s: int = 1


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = DEFAULT_POLICY
    seed: int = 0
    options: dict = field(default_factory=dict)  # passed to make_policy(name, **options)


@dataclass(frozen=True)
class ReplicaConfig:
    url: str
    engine: str = "auto"  # detected from its load endpoints (lb.core.engines); "openai": no queue to see, pushes capped by pushing.max_outstanding
    models: tuple[str, ...] = ()  # empty: discovered from the replica's /v1/models
    id: str = ""  # defaults to host:port
    api_key: str = ""  # sent upstream as a bearer token instead of the client's

    @property
    def key(self) -> str:
        return self.id or urlsplit(self.url).netloc


@dataclass(frozen=True)
class Config:
    server: ServerConfig = ServerConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    proxy: ProxyConfig = ProxyConfig()  # headers passed upstream (docs/api.md)
    probes: ProbeConfig = ProbeConfig()
    pushing: PushingConfig = PushingConfig()
    queue: QueueConfig = QueueConfig()
    routing: RoutingConfig = RoutingConfig()
    affinity: AffinityConfig = AffinityConfig()  # cache-affine queue scheduling (lb.core.affinity)
    breaker: BreakerConfig = BreakerConfig()  # per-replica circuit breaker on request failures
    # Fairness, tiers and admission (issue 5): validated by the core's own `from_dict`.
    identity: IdentityConfig = field(default_factory=IdentityConfig)
    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    deferred: DeferredConfig = field(default_factory=DeferredConfig)
    budgets: BudgetConfig = field(default_factory=BudgetConfig)  # tokens per minute per tenant (lb.core.budgets)
    state: dict = field(default_factory=dict)  # lb.daemon.state.make_store
    coalesce: dict = field(default_factory=dict)
    # Cross-region peering (issue 4): this LB's region, its peer LBs, probe/τ/adoption knobs.
    peering: PeeringConfig = field(default_factory=PeeringConfig)
    peers: tuple[PeerConfig, ...] = ()
    scaling: ScalingConfig = field(default_factory=ScalingConfig)  # issue 6: lb.daemon.capacity
    planner: dict = field(default_factory=dict)  # read by `lb plan`, not the daemon
    replicas: tuple[ReplicaConfig, ...] = ()
    # Replicas found in Kubernetes (EndpointSlices) or DNS (SRV/A), beside `replicas` (lb.daemon.discovery).
    discovery: tuple[DiscoveryConfig, ...] = ()
    source: str = ""  # the file it came from; SIGHUP re-reads it


_SECTIONS = {"server": ServerConfig, "upstream": UpstreamConfig, "proxy": ProxyConfig, "probes": ProbeConfig,
             "pushing": PushingConfig, "queue": QueueConfig, "affinity": AffinityConfig, "routing": RoutingConfig, "breaker": BreakerConfig}


def _suggest(key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(sorted(known))}"


def _coerce(path: str, value: object, typ: object) -> object:
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    if typ is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{path}: expected a table, got {value!r}")
    if typing.get_origin(typ) is tuple:  # tuple[str, ...]
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{path}: expected a list of strings, got {value!r}")
    raise AssertionError(f"unhandled config type {typ}")


def _build(cls: type, data: object, path: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)} - {"source"}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"{path}.{key}: unknown key; {_suggest(key, names)}")
        kwargs[key] = _coerce(f"{path}.{key}", value, hints[key])
    try:
        return cls(**kwargs)
    except ValueError as e:  # the section's own validation (e.g. BreakerConfig)
        raise ConfigError(str(e)) from None
    except TypeError as e:  # a required key is missing
        missing = [f.name for f in fields(cls) if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING]
        raise ConfigError(f"{path}: missing required key `{missing[0] if missing else '?'}` ({e})")


def _check(cfg: Config) -> None:
    def positive(path: str, v: float) -> None:
        if v <= 0:
            raise ConfigError(f"{path}: must be > 0, got {v}")

    positive("server.max_body_bytes", cfg.server.max_body_bytes)
    if not 0 <= cfg.server.port <= 65535:
        raise ConfigError(f"server.port: {cfg.server.port} is not a TCP port (0-65535)")
    positive("probes.interval_s", cfg.probes.interval_s)
    positive("probes.timeout_s", cfg.probes.timeout_s)
    positive("probes.unhealthy_after", cfg.probes.unhealthy_after)
    positive("probes.healthy_after", cfg.probes.healthy_after)
    positive("probes.redetect_s", cfg.probes.redetect_s)
    positive("probes.models_refresh_s", cfg.probes.models_refresh_s)
    if not isinstance(cfg.probes.idle_intervals, int) or cfg.probes.idle_intervals < 1:
        raise ConfigError(f"probes.idle_intervals: must be a whole number >= 1 (1: probe idle replicas every "
                          f"interval too), got {cfg.probes.idle_intervals!r}")
    if not 0 < cfg.probes.max_probe_share <= 1:
        raise ConfigError(f"probes.max_probe_share: must be in (0, 1] (a share of the replica's time), "
                          f"got {cfg.probes.max_probe_share}")
    positive("queue.max_len", cfg.queue.max_len)
    positive("queue.timeout_s", cfg.queue.timeout_s)
    positive("pushing.max_outstanding", cfg.pushing.max_outstanding)
    positive("pushing.push_credit", cfg.pushing.push_credit)
    positive("pushing.max_unseen", cfg.pushing.max_unseen)
    if not 0 <= cfg.pushing.lease_s < math.inf:
        raise ConfigError(f"pushing.lease_s: must be a finite number of seconds >= 0 (0 turns leases off), "
                          f"got {cfg.pushing.lease_s}")
    positive("upstream.connect_timeout_s", cfg.upstream.connect_timeout_s)
    positive("upstream.read_timeout_s", cfg.upstream.read_timeout_s)
    positive("upstream.first_byte_timeout_s", cfg.upstream.first_byte_timeout_s)
    positive("upstream.max_response_bytes", cfg.upstream.max_response_bytes)
    positive("upstream.max_error_body_bytes", cfg.upstream.max_error_body_bytes)
    positive("upstream.max_sse_line_bytes", cfg.upstream.max_sse_line_bytes)
    if cfg.upstream.hung_after_s < 0:
        raise ConfigError(f"upstream.hung_after_s: must be >= 0 (0 turns the check off), got {cfg.upstream.hung_after_s}")
    positive("server.idle_timeout_s", cfg.server.idle_timeout_s)
    positive("server.body_timeout_s", cfg.server.body_timeout_s)
    positive("server.max_connections", cfg.server.max_connections)
    for i, name in enumerate(cfg.proxy.forward_headers):
        path = f"proxy.forward_headers[{i}]"
        bare = name.rstrip("*").lower()
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9a-z-]+", bare) or name.count("*") > (1 if name.endswith("*") else 0):
            raise ConfigError(f"{path}: {name!r} is not a header name; write a name (\"traceparent\") or a prefix "
                              f"ending in * (\"x-trace-*\")")
        if bare.startswith("x-lb-") or (name.endswith("*") and "x-lb-".startswith(bare)):
            raise ConfigError(f"{path}: {name!r} would pass lb's own x-lb-* headers (identity, tier, peering); "
                              "those never go upstream: remove it")
        if bare in NEVER_FORWARDED or (name.endswith("*") and any(h.startswith(bare) for h in NEVER_FORWARDED)):
            raise ConfigError(f"{path}: {name!r} is a hop-by-hop or framing header lb sets itself; remove it "
                              f"(never forwarded: {', '.join(sorted(NEVER_FORWARDED))})")
    if cfg.upstream.retries < 0:
        raise ConfigError(f"upstream.retries: must be >= 0, got {cfg.upstream.retries}")
    if cfg.pushing.mode not in PUSHING_MODES:
        raise ConfigError(f"pushing.mode: {cfg.pushing.mode!r} is not allowed; use one of: {', '.join(PUSHING_MODES)}")
    try:
        make_policy(cfg.routing.policy, seed=cfg.routing.seed, **cfg.routing.options)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"routing.policy/options: {e}") from None
    try:
        make_queue(cfg.queue.order)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"queue.order: {e}") from None
    seen: dict[str, int] = {}
    for i, r in enumerate(cfg.replicas):
        path = f"replicas[{i}]"
        problem = url_problem(r.url, f"{path}.url")  # scheme, port, no credentials/query/path
        if problem:
            raise ConfigError(problem)
        if r.engine not in ENGINES:
            raise ConfigError(f"{path}.engine: {r.engine!r} is not allowed; use one of: {', '.join(ENGINES)}")
        if r.key in seen:
            raise ConfigError(f"{path}: duplicate replica {r.key!r} (also replicas[{seen[r.key]}]); give each a distinct url or id")
        seen[r.key] = i
    for i, p in enumerate(cfg.peers):
        problem = url_problem(p.url, f"peers[{i}].url")
        if problem:
            raise ConfigError(problem.replace("the replica's `api_key`", "peering.secret (peers sign, lb.core.peering)"))
    for i, origin in enumerate(cfg.server.cors_allowed_origins):
        problem = origin_problem(origin, f"server.cors_allowed_origins[{i}]")
        if problem:
            raise ConfigError(problem)
    try:
        parse_deny(cfg.server.admin_replica_deny, "server.admin_replica_deny")
        tls.server_context(cfg.server.tls_cert, cfg.server.tls_key, cfg.server.tls_client_ca)
        tls.upstream_ssl(cfg)
        tls.peer_ssl(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for i, d in enumerate(cfg.discovery):
        path = f"discovery[{i}]"
        try:
            d.check(path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if d.engine not in ENGINES:
            raise ConfigError(f"{path}.engine: {d.engine!r} is not allowed; use one of: {', '.join(ENGINES)}")
        module, extra = {"kubernetes": ("kubernetes_asyncio", "k8s"), "dns": ("dns.asyncresolver", "dns")}[d.kind]
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise ConfigError(f"{path}.kind: {d.kind} discovery needs the `{extra}` extra: pip install 'lb[{extra}]'")


_CORE_SECTIONS = {"identity": IdentityConfig.from_dict, "fairness": FairnessConfig.from_dict, "tiers": TierConfig.from_dict,
                  "admission": AdmissionConfig.from_dict, "deferred": DeferredConfig.from_dict,
                  "state": lambda d, path: dict(d), "coalesce": coalesce_config,
                  "scaling": ScalingConfig.from_dict, "planner": lambda d, path: dict(d),
                  "peering": PeeringConfig.from_dict, "budgets": BudgetConfig.from_dict}


# The core sections' own `from_dict` checks values; first, here, every key is known (or the
# closest one suggested) and every plainly typed value has its type, as in the daemon's sections.
_SCHEMAS: dict[str, type | dict] = {
    "identity": IdentityConfig, "fairness": FairnessConfig, "tiers": TierConfig, "admission": AdmissionConfig,
    "deferred": DeferredConfig, "scaling": ScalingConfig, "peering": PeeringConfig, "planner": PLANNER_KEYS,
    "budgets": BudgetConfig,
    "state": {"backend": str, "url": str, "prefix": str, "counter_ttl_s": float, "sync_interval_s": float,
              "share_pushes": bool}}
STATE_BACKENDS = ("memory", "redis")
DERIVED = {"identity": {"default_tier"}}  # set from another section ([tiers] default_tier), not written


def _check_schema(key: str, data: dict) -> None:
    schema = _SCHEMAS.get(key)
    if schema is None:
        return
    if isinstance(schema, dict):
        types = schema
    else:
        try:
            types = typing.get_type_hints(schema)
        except Exception:  # an annotation that does not resolve: the section's own checks remain
            types = {f.name: object for f in fields(schema)}
        types = {f.name: types.get(f.name, object) for f in fields(schema) if f.name not in DERIVED.get(key, ())}
    for name, value in data.items():
        if name not in types:
            raise ConfigError(f"{key}.{name}: unknown key; {_suggest(name, types)}")
        typ = types[name]
        if typ in (bool, int, float, str, dict) or typing.get_origin(typ) is tuple:
            _coerce(f"{key}.{name}", value, typ)
    if key == "state":
        backend = data.get("backend", "memory")
        if backend not in STATE_BACKENDS:
            raise ConfigError(f"state.backend: {backend!r} is not allowed; use one of: {', '.join(STATE_BACKENDS)}")
        if backend == "memory" and set(data) & {"url", "prefix"}:
            raise ConfigError("state.url/prefix: only for backend = \"redis\"; the memory backend shares nothing")
        url = data.get("url")
        if url is not None and urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"state.url: {url_for_display(url)!r} is not a Redis URL; write e.g. url = \"redis://127.0.0.1:6379/0\"")


def _core_section(key: str, value: object):
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a table, got {value!r}")
    _check_schema(key, value)
    try:
        return _CORE_SECTIONS[key](value, key)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def from_dict(data: dict, source: str = "") -> Config:
    top = {f.name for f in fields(Config)} - {"source"}
    kwargs: dict = {}
    for key, value in data.items():
        if key not in top:
            raise ConfigError(f"{key}: unknown section; {_suggest(key, top)}")
        if key == "replicas":
            if not isinstance(value, list):
                raise ConfigError("replicas: write each replica as a [[replicas]] table with url, engine, models")
            kwargs[key] = tuple(_build(ReplicaConfig, r, f"replicas[{i}]") for i, r in enumerate(value))
        elif key == "discovery":
            if not isinstance(value, list):
                raise ConfigError("discovery: write each source as a [[discovery]] table with kind = \"kubernetes\" or \"dns\"")
            kwargs[key] = tuple(_build(DiscoveryConfig, d, f"discovery[{i}]") for i, d in enumerate(value))
        elif key == "peers":
            try:
                kwargs[key] = peers_from_list(value)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif key in _CORE_SECTIONS:
            kwargs[key] = _core_section(key, value)
        else:
            kwargs[key] = _build(_SECTIONS[key], value, key)
    cfg = Config(**kwargs, source=source)
    cfg = replace(cfg, identity=replace(cfg.identity, default_tier=cfg.tiers.default_tier))
    cfg = from_env(cfg)
    _check(cfg)
    return cfg


def from_env(cfg: Config) -> Config:
    token = os.environ.get("LB_ADMIN_TOKEN")
    if token and not cfg.server.admin_token:
        cfg = replace(cfg, server=replace(cfg.server, admin_token=token))
    peer_secret = os.environ.get("LB_PEER_SECRET")
    if peer_secret and not cfg.peering.secret:
        cfg = replace(cfg, peering=replace(cfg.peering, secret=peer_secret))
    return cfg


def load(path: str | Path) -> Config:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file")
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a directory; give the TOML file in it")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); save the config as UTF-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read: {e.strerror or e}")
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}")
    return from_dict(data, source=str(p.resolve()))


def with_overrides(cfg: Config, *, host: str | None = None, port: int | None = None,
                   replicas: list[str] | None = None, engine: str | None = None,
                   models: list[str] | None = None, policy: str | None = None,
                   pushing: str | None = None, admin_token: str | None = None) -> Config:
    """Command-line flags win over the file. `--replica` replaces the file's replica list."""
    server = replace(cfg.server, **{k: v for k, v in (("host", host), ("port", port), ("admin_token", admin_token)) if v is not None})
    reps = cfg.replicas
    if replicas:
        reps = tuple(ReplicaConfig(url=u.rstrip("/"), engine=engine or "auto", models=tuple(models or ())) for u in replicas)
    elif engine or models:
        reps = tuple(replace(r, **({"engine": engine} if engine else {}), **({"models": tuple(models)} if models else {})) for r in reps)
    cfg = replace(cfg, server=server, replicas=reps,
                  routing=replace(cfg.routing, policy=policy) if policy else cfg.routing,
                  pushing=replace(cfg.pushing, mode=pushing) if pushing else cfg.pushing)
    _check(cfg)
    return cfg


SECRET_KEYS = ("admin_token", "api_key", "secret", "token")  # printed as "<set>", never their value


def _plain(v: object) -> object:
    """A config value as TOML-able data: dataclasses as tables, enums by value, None dropped."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in fields(v) if f.name != "source"}
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, dict):
        return {(k.value if isinstance(k, enum.Enum) else str(k)): _plain(x) for k, x in v.items()}
    if isinstance(v, (tuple, list, set, frozenset)):
        return [_plain(x) for x in v]
    return v


def _masked(key: str, v: object) -> object:
    if key == "api_keys" and isinstance(v, dict):
        return {f"<key {i + 1}>": tenant for i, tenant in enumerate(v.values())}
    if key in SECRET_KEYS and isinstance(v, str) and v:
        return "<set>"
    if key == "url" and isinstance(v, str):  # e.g. state.url = "redis://:password@host"
        return url_for_display(v)
    if isinstance(v, dict):
        return {k: _masked(k, x) for k, x in v.items()}
    if isinstance(v, list):
        return [_masked(key, x) for x in v]
    return v


def to_toml(cfg: Config) -> str:
    """The whole effective config (every section, defaults included, secrets masked) as TOML a
    person could save and start from; keys a section leaves unset are shown as comments."""
    def key(k: str) -> str:
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)

    def val(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v if x is not None) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{key(k)} = {val(x)}" for k, x in v.items() if x is not None) + "}"
        return json.dumps(str(v), ensure_ascii=False)

    def table(header: str, doc: dict) -> list[str]:
        lines = [header]
        for k, v in doc.items():
            lines.append(f"# {k} = (unset)" if v is None else f"{key(k)} = {val(v)}")
        return lines + [""]

    lines = []
    for f in fields(Config):
        if f.name in ("replicas", "peers", "discovery", "source"):
            continue
        doc = _masked(f.name, _plain(getattr(cfg, f.name)))
        lines += table(f"[{f.name}]", {k: _masked(k, v) for k, v in doc.items() if k not in DERIVED.get(f.name, ())})
    for name in ("peers", "replicas", "discovery"):
        for item in getattr(cfg, name):
            lines += table(f"[[{name}]]", {k: _masked(k, v) for k, v in _plain(item).items()})
    return "\n".join(lines)
