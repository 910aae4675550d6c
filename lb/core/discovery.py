"""Replica discovery decisions: which replicas a Kubernetes or DNS source says should exist.

Pure: the daemon (lb.daemon.discovery) lists, watches and resolves, then asks this module
what the replica set should become, and applies the answer to the registry (added replicas
are probed before they take work, removed ones drain).

Kubernetes: an `EndpointSlices` object holds the slices a label selector matches, updated by
a relist (which replaces everything, so a slice deleted while the watch was lost leaves no
ghost) or by one watch event (ADDED/MODIFIED/DELETED; BOOKMARK only moves the
resourceVersion). An endpoint serves only while `conditions.ready` is not false and
`conditions.terminating` is not true: a pod that starts terminating is drained at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

DISCOVERY_KINDS = ("kubernetes", "dns")
DNS_RECORDS = ("SRV", "A", "AAAA")
# On the Service (its labels are copied onto its EndpointSlices) or on a hand-made slice:
ENGINE_LABEL = "lb/engine"  # e.g. sglang; overrides the source's `engine`
MODEL_LABEL = "lb/model"  # one model (label values cannot hold "/")
MODELS_ANNOTATION = "lb/models"  # comma-separated, any characters


@dataclass(frozen=True)
class DiscoveryConfig:
    kind: str  # kubernetes: watch EndpointSlices by label selector; dns: resolve SRV or A/AAAA records on an interval
    engine: str = "auto"  # engine of the replicas found, detected by default (kubernetes: an "lb/engine" label on the Service overrides it)
    # Models they serve; empty: an "lb/model" label or "lb/models" annotation on the slice, else each replica's /v1/models
    models: tuple[str, ...] = ()
    scheme: str = "http"  # replica URLs are scheme://address:port
    port: str = ""  # kubernetes: the EndpointSlice port's name or number (empty: its first port); dns: the port for A/AAAA records
    api_key: str = ""  # sent upstream as a bearer token to the replicas found
    namespace: str = ""  # kubernetes: empty means the pod's own namespace (in-cluster), else "default"
    selector: str = ""  # kubernetes: label selector on EndpointSlices, e.g. "kubernetes.io/service-name=sglang"
    kubeconfig: str = ""  # kubernetes: a kubeconfig file; empty: the in-cluster service account, else $KUBECONFIG or ~/.kube/config
    watch_timeout_s: float = 300.0  # kubernetes: each watch ends after this long and resumes from the last resourceVersion
    name: str = ""  # dns: e.g. "_http._tcp.sglang.ns.svc.cluster.local" (SRV) or "sglang.ns.svc.cluster.local" (A)
    record: str = "SRV"  # dns: SRV (port from the record) or A/AAAA (port from `port`)
    interval_s: float = 10.0  # dns: re-resolve this often; a failed lookup keeps the current set
    nameservers: tuple[str, ...] = ()  # dns: "ip" or "ip:port"; empty: /etc/resolv.conf

    def check(self, path: str) -> None:
        """Raise ValueError naming `path.key` and the fix."""
        if self.kind not in DISCOVERY_KINDS:
            raise ValueError(f"{path}.kind: {self.kind!r} is not allowed; use one of: {', '.join(DISCOVERY_KINDS)}")
        if self.scheme not in ("http", "https"):
            raise ValueError(f"{path}.scheme: {self.scheme!r} is not allowed; use http or https")
        if self.kind == "kubernetes":
            if not self.selector:
                raise ValueError(f"{path}.selector: required for kind = \"kubernetes\", e.g. "
                                 "selector = \"kubernetes.io/service-name=sglang\"")
            if self.watch_timeout_s <= 0:
                raise ValueError(f"{path}.watch_timeout_s: must be > 0, got {self.watch_timeout_s}")
        else:
            if not self.name:
                raise ValueError(f"{path}.name: required for kind = \"dns\", e.g. "
                                 "name = \"_http._tcp.sglang.inference.svc.cluster.local\"")
            if self.record not in DNS_RECORDS:
                raise ValueError(f"{path}.record: {self.record!r} is not allowed; use one of: {', '.join(DNS_RECORDS)}")
            if self.record != "SRV" and not self.port.isdigit():
                raise ValueError(f"{path}.port: {self.record} records carry no port; set port = \"30000\" (a number)")
            if self.interval_s <= 0:
                raise ValueError(f"{path}.interval_s: must be > 0, got {self.interval_s}")
        if self.port and self.port.isdigit() and not 0 < int(self.port) < 65536:
            raise ValueError(f"{path}.port: {self.port} is not a TCP port (1-65535)")


@dataclass(frozen=True)
class Endpoint:
    """One replica a source wants: its registry id (address:port), URL, engine and models."""
    key: str
    url: str
    engine: str
    models: tuple[str, ...]


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _slice_port(slice_: Mapping, want: str) -> int | None:
    for p in slice_.get("ports") or ():
        if p.get("port") is None:
            continue
        if not want or want == p.get("name") or want == str(p.get("port")):
            return int(p["port"])
    return None


def serving(endpoint: Mapping) -> bool:
    """Ready and not terminating (a missing condition counts as ready, as the API defines)."""
    cond = endpoint.get("conditions") or {}
    return cond.get("ready") is not False and cond.get("terminating") is not True


def slice_endpoints(slice_: Mapping, cfg: DiscoveryConfig) -> list[Endpoint]:
    """The serving endpoints of one EndpointSlice (as the API's JSON)."""
    meta = slice_.get("metadata") or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    port = _slice_port(slice_, cfg.port)
    if port is None:
        return []
    engine = labels.get(ENGINE_LABEL) or cfg.engine
    models = cfg.models
    if not models:
        listed = notes.get(MODELS_ANNOTATION) or labels.get(MODEL_LABEL) or ""
        models = tuple(m.strip() for m in listed.split(",") if m.strip())
    out = []
    for ep in slice_.get("endpoints") or ():
        if not serving(ep):
            continue
        for address in (ep.get("addresses") or ())[:1]:  # every address of an endpoint is the same pod
            key = _hostport(address, port)
            out.append(Endpoint(key, f"{cfg.scheme}://{key}", engine, models))
    return out


class EndpointSlices:
    """The slices one selector matches, as the last list and the watch events since say."""

    def __init__(self, cfg: DiscoveryConfig):
        self.cfg = cfg
        self.slices: dict[str, Mapping] = {}
        self.resource_version = ""

    def relist(self, items: Iterable[Mapping], resource_version: str) -> None:
        """A fresh list replaces everything seen before (no ghosts after a lost watch)."""
        self.slices = {self._name(s): s for s in items}
        self.resource_version = resource_version

    def event(self, kind: str, obj: Mapping) -> None:
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            self.slices[self._name(obj)] = obj
        elif kind == "DELETED":
            self.slices.pop(self._name(obj), None)
        elif kind != "BOOKMARK":
            raise ValueError(f"unexpected watch event type {kind!r}")
        if rv:
            self.resource_version = rv

    def endpoints(self) -> dict[str, Endpoint]:
        out: dict[str, Endpoint] = {}
        for name in sorted(self.slices):  # a pod in two slices (dual-stack): the first slice wins
            for ep in slice_endpoints(self.slices[name], self.cfg):
                out.setdefault(ep.key, ep)
        return out

    @staticmethod
    def _name(obj: Mapping) -> str:
        meta = obj.get("metadata") or {}
        return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def dns_endpoints(records: Iterable[tuple[str, int]], cfg: DiscoveryConfig) -> dict[str, Endpoint]:
    """(address, port) pairs a lookup answered (port 0: take `cfg.port`) as endpoints."""
    out: dict[str, Endpoint] = {}
    for address, port in records:
        key = _hostport(address, port or int(cfg.port))
        out.setdefault(key, Endpoint(key, f"{cfg.scheme}://{key}", cfg.engine, cfg.models))
    return out


def diff(owned: Mapping[str, Endpoint], wanted: Mapping[str, Endpoint],
         taken: Iterable[str] = ()) -> tuple[list[Endpoint], list[str]]:
    """(to add, to drain) that make a source's replicas `owned` equal `wanted`. A changed
    endpoint (engine, models) is drained and added again; a key another source (the config
    file, the admin API) already holds is left to it."""
    taken = set(taken)
    drain = [k for k, ep in owned.items() if wanted.get(k) != ep]
    add = [ep for k, ep in wanted.items() if owned.get(k) != ep and k not in taken]
    return add, drain
