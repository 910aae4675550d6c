"""Replica sources beside the config file and the admin API: Kubernetes and DNS.

`[[discovery]]` tables (lb.core.discovery.DiscoveryConfig) each start one task:

- `kubernetes` lists the EndpointSlices a label selector matches (kubernetes_asyncio, the
  `k8s` extra; in-cluster service account or a kubeconfig), then watches from the list's
  resourceVersion with bookmarks. A watch that ends or breaks resumes from the last
  resourceVersion (after a backoff if it broke); 410 Gone or an API error relists, and the
  list replaces everything, so nothing deleted while the watch was lost stays behind.
- `dns` resolves SRV (or A/AAAA) records of a headless Service or a Consul name every
  `interval_s` (dnspython, the `dns` extra); a lookup that fails keeps the current set, a
  name that does not exist or has no records empties it.

After each change lb.core.discovery decides what the source's replicas become; new ones are
probed before they take work (the registry adds them unhealthy), gone ones drain.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
from typing import Mapping

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lb.core.discovery import DiscoveryConfig, Endpoint, EndpointSlices, diff, dns_endpoints
from lb.daemon.config import ReplicaConfig
from lb.daemon.registry import Registry

log = logging.getLogger("lb.discovery")

SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
BACKOFF_S = (0.2, 5.0)  # first and longest wait before relisting after an error


def sync(registry: Registry, source: str, wanted: Mapping[str, Endpoint], api_key: str = "") -> None:
    """Make `source`'s replicas in the registry equal `wanted` (adds probe first, drains finish)."""
    owned, taken = {}, []
    for rid, rep in registry.replicas.items():
        if rep.view.draining:
            continue
        if rep.source == source:
            owned[rid] = Endpoint(rid, rep.cfg.url, rep.cfg.engine, rep.cfg.models)
        else:
            taken.append(rid)
    add, drain = diff(owned, wanted, taken)
    for rid in drain:
        registry.remove(rid)
    for ep in add:
        registry.add(ReplicaConfig(url=ep.url, engine=ep.engine, models=ep.models, id=ep.key, api_key=api_key),
                     source=source)
    if add or drain:
        log.info("%s: added %s, draining %s", source, [e.key for e in add] or "none", drain or "none")


class _Backoff:
    def __init__(self) -> None:
        self.wait = BACKOFF_S[0]

    async def sleep(self) -> None:
        await asyncio.sleep(self.wait * random.uniform(0.5, 1.0))
        self.wait = min(self.wait * 2, BACKOFF_S[1])

    def reset(self) -> None:
        self.wait = BACKOFF_S[0]


class KubernetesSource:
    def __init__(self, cfg: DiscoveryConfig, registry: Registry, source: str):
        self.cfg, self.registry, self.source = cfg, registry, source
        self.slices = EndpointSlices(cfg)
        self.lists = 0  # lists done (the first one included): lb_discovery_lists_total
        self.errors = 0  # watches lost and API errors: lb_discovery_errors_total

    async def _client(self):
        from kubernetes_asyncio import client, config

        conf = client.Configuration()
        namespace = self.cfg.namespace
        if self.cfg.kubeconfig:
            await config.load_kube_config(config_file=self.cfg.kubeconfig, client_configuration=conf)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=conf)
            if not namespace and os.path.exists(SA_NAMESPACE):
                with open(SA_NAMESPACE) as f:
                    namespace = f.read().strip()
        else:
            await config.load_kube_config(client_configuration=conf)
        self.namespace = namespace or "default"
        return client.ApiClient(conf), client.DiscoveryV1Api

    async def run(self) -> None:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        api_client, Api = await self._client()
        api = Api(api_client)
        backoff = _Backoff()
        relist = True
        try:
            while True:
                try:
                    if relist:
                        await self._list(api)
                        relist = False
                    await self._watch(api, watch.Watch())  # ended by the server: resume where it was
                    backoff.reset()
                except asyncio.CancelledError:
                    raise
                except ApiException as e:
                    relist = True
                    self.errors += 1
                    if e.status == 410:
                        log.info("%s: 410 Gone (resourceVersion too old); relisting", self.source)
                    else:
                        log.warning("%s: HTTP %s %s from the API server; relisting", self.source, e.status, e.reason)
                        await backoff.sleep()
                except Exception as e:  # connection refused or cut: resume the watch (a 410 then relists)
                    self.errors += 1
                    log.warning("%s: watch lost: %s: %.200s", self.source, type(e).__name__, e)
                    await backoff.sleep()
        finally:
            await api_client.close()

    async def _list(self, api) -> None:
        resp = await api.list_namespaced_endpoint_slice(self.namespace, label_selector=self.cfg.selector,
                                                        _preload_content=False, _request_timeout=30)
        async with resp:
            doc = orjson.loads(await resp.read())
        self.slices.relist(doc.get("items") or (), (doc.get("metadata") or {}).get("resourceVersion", ""))
        self.lists += 1
        sync(self.registry, self.source, self.slices.endpoints(), self.cfg.api_key)

    async def _watch(self, api, w) -> None:
        timeout = max(1, int(self.cfg.watch_timeout_s))
        stream = w.stream(api.list_namespaced_endpoint_slice, self.namespace, label_selector=self.cfg.selector,
                          resource_version=self.slices.resource_version, allow_watch_bookmarks=True,
                          timeout_seconds=timeout, _request_timeout=timeout + 30)
        async with w:
            async for event in stream:
                self.slices.event(event["type"], event["raw_object"])
                if event["type"] != "BOOKMARK":
                    sync(self.registry, self.source, self.slices.endpoints(), self.cfg.api_key)


class DnsSource:
    def __init__(self, cfg: DiscoveryConfig, registry: Registry, source: str):
        import dns.asyncresolver
        import dns.nameserver

        self.cfg, self.registry, self.source = cfg, registry, source
        self.lists = 0  # answered lookups
        self.errors = 0  # failed lookups (the current replicas were kept)
        if cfg.nameservers:
            self.resolver = dns.asyncresolver.Resolver(configure=False)
            servers = []
            for ns in cfg.nameservers:
                host, _, port = ns.rpartition(":") if ns.count(":") == 1 else (ns, "", "")
                servers.append(dns.nameserver.Do53Nameserver(host or ns, int(port) if port else 53))
            self.resolver.nameservers = servers
        else:
            self.resolver = dns.asyncresolver.Resolver()
        self.resolver.lifetime = min(5.0, cfg.interval_s)

    async def run(self) -> None:
        while True:
            records = await self.resolve()
            if records is not None:
                self.lists += 1
                sync(self.registry, self.source, dns_endpoints(records, self.cfg), self.cfg.api_key)
            await asyncio.sleep(self.cfg.interval_s)

    async def resolve(self) -> list[tuple[str, int]] | None:
        """(address, port) pairs; [] when the name has no records; None when the lookup failed."""
        import dns.exception
        import dns.rdatatype
        import dns.resolver

        try:
            if self.cfg.record != "SRV":
                answer = await self.resolver.resolve(self.cfg.name, self.cfg.record)
                return [(r.address, 0) for r in answer]
            answer = await self.resolver.resolve(self.cfg.name, "SRV")
            glue: dict[str, list[str]] = {}  # addresses the answer already carries for each target
            for rrset in answer.response.additional:
                if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    glue.setdefault(rrset.name.to_text(), []).extend(r.address for r in rrset)
            out = []
            for srv in answer:
                target = srv.target.to_text()
                addresses = glue.get(target) or await self._addresses(target)
                out += [(a, srv.port) for a in addresses]
            return out
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except (dns.exception.DNSException, OSError) as e:
            self.errors += 1
            log.warning("%s: looking up %s %s failed (%s); keeping the current replicas", self.source,
                        self.cfg.record, self.cfg.name, type(e).__name__)
            return None

    async def _addresses(self, target: str) -> list[str]:
        import dns.resolver

        try:
            return [r.address for r in await self.resolver.resolve(target, "A")]
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []  # a target that no longer resolves is gone; the others stay


class Discovery:
    """Runs every configured source; one that fails (no API access yet, a bad kubeconfig)
    logs why and starts again after a backoff, never taking the LB down."""

    KINDS = {"kubernetes": KubernetesSource, "dns": DnsSource}

    def __init__(self, cfgs: tuple[DiscoveryConfig, ...], registry: Registry):
        self.registry = registry
        self.sources = [self.KINDS[c.kind](c, registry, f"discovery[{i}]") for i, c in enumerate(cfgs)]
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._supervise(s), name=s.source) for s in self.sources]

    async def _supervise(self, source) -> None:
        backoff = _Backoff()
        while True:
            try:
                await source.run()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.error("%s (%s) failed: %s: %s; starting it again", source.source, source.cfg.kind,
                          type(e).__name__, e)
                await backoff.sleep()

    def describe(self):
        return []

    def collect(self):
        """Prometheus collector: each source's replicas, lists (or answered lookups) and errors."""
        labels = ["source", "kind"]
        replicas = GaugeMetricFamily("lb_discovery_replicas", "Active replicas a discovery source holds", labels=labels)
        lists = CounterMetricFamily("lb_discovery_lists", "Kubernetes lists (first and relists) or answered DNS lookups",
                                    labels=labels)
        errors = CounterMetricFamily("lb_discovery_errors", "Watches lost, API errors or failed DNS lookups",
                                     labels=labels)
        for s in self.sources:
            key = [s.source, s.cfg.kind]
            replicas.add_metric(key, sum(1 for r in self.registry.active() if r.source == s.source))
            lists.add_metric(key, s.lists)
            errors.add_metric(key, s.errors)
        return [replicas, lists, errors]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
