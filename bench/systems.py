"""The systems a comparison puts in front of one emulated fleet: `lb` and what users would pick instead.

Each `System` starts inside a `bench.fleet.Fleet` over replica URLs that already answer and
returns the URLs clients should use; `unavailable(system)` says why one cannot run here (not
installed, cannot be installed) so the comparison lists it as skipped instead of dropping it.

- `lb`: `lb serve` with a routing policy and pushing mode. The emulators run `speed`× faster
  than the hardware they model, so the LB's engine-time knobs (the 100 ms probe interval, the
  cache-affine scheduler's hold/bypass bounds when that module is present) are divided by
  `speed` too; network-time knobs are left alone.
- SGLang Router 0.3.2 (`python -m sglang_router.launch_router`, PyPI `sglang-router`).
- vLLM router 0.1.17 (`vllm-router`, PyPI `vllm-router`). It reads
  `/get_load` as `{"load": N}` while the emulator answers SGLang's list shape; it starts and
  routes regardless, and its power_of_two keeps replicas about as even as nginx least_conn in
  the measured `imbalance`, so it appears to count its own in-flight requests (its logs, even
  at debug, do not say which).
- nginx (Debian `nginx`): one worker process, a generated config in the fleet's log folder,
  `least_conn` or `hash $session consistent` (X-LB-Session; requests without one hash on
  `$request_id`, i.e. spread at random), `proxy_buffering off`, keep-alive upstreams.
- `direct`: no LB; each client round-robins over the replicas itself (`bench.client`).

Multi-region (`start_regional`): `lb` runs one per region with peering (`bench.cluster`);
every other system is a single global coordinator in `central`, reached by the other
regions' clients through `bench.delay_proxy` and reaching their replicas through it too.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.cluster import ClusterSpec, Testbed, start_testbed
from bench.fleet import Fleet, all_workers_healthy, free_port
from bench.scenarios._lb import engine_time_config, merge_sections, start_lb
from lb.core.peering import PEER_POLICIES, PeeringConfig
from lb.core.policies import DEFAULT_POLICY

SGLANG_ROUTER_PIN = "sglang-router==0.3.2"
VLLM_ROUTER_PIN = "vllm-router==0.1.17"


@dataclass(frozen=True)
class System:
    name: str  # the column label in reports
    family: str  # lb | sglang-router | vllm-router | nginx | direct
    policy: str = ""
    pushing: str = ""  # lb only
    regional: bool = False  # lb only: one LB per region with peering (else one central LB)
    lb_config: dict = field(default_factory=dict, hash=False, compare=False)  # extra TOML sections

    def __str__(self) -> str:
        return self.name


def lb(policy: str = DEFAULT_POLICY, pushing: str = "sp-pending", *, regional: bool = False,
       name: str | None = None, config: dict | None = None) -> System:
    label = name or ("lb" + ("-regional" if regional else "") + f" {policy}/{pushing}")
    return System(label, "lb", policy, pushing, regional, config or {})


def sglang_router(policy: str) -> System:
    return System(f"sglang-router {policy}", "sglang-router", policy)


def vllm_router(policy: str) -> System:
    return System(f"vllm-router {policy}", "vllm-router", policy)


def nginx(policy: str) -> System:
    return System(f"nginx {policy}", "nginx", policy)


DIRECT = System("direct-rr", "direct")


def _vllm_router_bin() -> str | None:
    local = Path(sys.executable).with_name("vllm-router")
    return str(local) if local.exists() else shutil.which("vllm-router")


def unavailable(system: System) -> str | None:
    """Why `system` cannot run on this machine, or None."""
    if system.family == "sglang-router" and importlib.util.find_spec("sglang_router") is None:
        return f"sglang-router is not installed (pip install {SGLANG_ROUTER_PIN})"
    if system.family == "vllm-router" and _vllm_router_bin() is None:
        return f"vllm-router is not installed (pip install {VLLM_ROUTER_PIN})"
    if system.family == "nginx" and shutil.which("nginx", path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
        return "nginx is not installed (apt-get install nginx)"
    return None


def start(system: System, fleet: Fleet, replica_urls: list[str], *, speed: float = 1.0,
          name: str | None = None) -> list[str]:
    """Start `system` over `replica_urls`; returns the URLs clients round-robin over."""
    name = name or system.family
    if system.family == "direct":
        return list(replica_urls)
    if system.family == "lb":
        config = engine_time_config(speed, system.lb_config)
        return [start_lb(fleet, replica_urls, name=name, policy=system.policy, pushing=system.pushing,
                         config=config).url]
    if system.family == "sglang-router":
        return [fleet.sglang_router(replica_urls, policy=system.policy, name=name).url]
    if system.family == "vllm-router":
        port = free_port()
        args = [_vllm_router_bin(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *replica_urls,
                "--policy", system.policy, "--log-level", "warning"]
        return [fleet.start(name, args, "/readiness", port, timeout=60.0,
                            until=all_workers_healthy(len(replica_urls))).url]
    if system.family == "nginx":
        return [start_nginx(fleet, replica_urls, system.policy, name=name)]
    raise ValueError(f"unknown system family {system.family!r}")


NGINX_BALANCE = {"least_conn": "least_conn;", "hash-session": "hash $lb_session_key consistent;"}


def nginx_config(prefix: Path, port: int, replica_urls: list[str], policy: str) -> str:
    if policy not in NGINX_BALANCE:
        raise ValueError(f"nginx policy {policy!r}; use one of {', '.join(NGINX_BALANCE)}")
    servers = "".join(f"    server {u.split('://', 1)[-1].rstrip('/')} max_fails=0;\n" for u in replica_urls)
    temp = "".join(f"  {kind}_temp_path {prefix}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
{temp}  map $http_x_lb_session $lb_session_key {{ "" $request_id; default $http_x_lb_session; }}
  upstream fleet {{
    {NGINX_BALANCE[policy]}
{servers}    keepalive 256;
  }}
  server {{
    listen 127.0.0.1:{port};
    client_max_body_size 64m;
    location / {{
      proxy_pass http://fleet;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""


def start_nginx(fleet: Fleet, replica_urls: list[str], policy: str, *, name: str = "nginx") -> str:
    """nginx in the foreground with a generated config; returns its URL."""
    prefix = (fleet.log_dir / name).resolve()
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(nginx_config(prefix, port, replica_urls, policy))
    binary = shutil.which("nginx", path="/usr/sbin:/usr/bin:/sbin:/bin")
    check = subprocess.run([binary, "-t", "-p", str(prefix), "-c", str(conf)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"nginx rejected its config: {check.stderr.strip()}")
    return fleet.start(name, [binary, "-p", str(prefix), "-c", str(conf), "-g", "daemon off;"],
                       "/v1/models", port).url


# ---- multi-region ------------------------------------------------------------------------


@dataclass
class Regional:
    """Where one system's multi-region run sends each region's clients, and the replicas."""

    client_targets: dict[str, list[str]]  # region → URLs its clients round-robin over
    replicas: dict[str, list[str]]  # region → its replicas' own URLs (for load sampling)
    describe: str


def peer_policy_for(policy: str) -> str:
    """How the LBs choose among peers: the same algorithm where peering has it, else the
    daemon's peering default (predicted-ttft ranks replicas; peers are ranked by the prefix
    trie, and forwarding by predicted TTFT is a separate step)."""
    return policy if policy in PEER_POLICIES else PeeringConfig().policy


def start_regional(system: System, fleet: Fleet, spec: ClusterSpec, central: str) -> Regional:
    """`system` over `spec`'s regions: lb per region with peering when `system.regional`,
    else one coordinator in `central` that every other region reaches across the WAN."""
    if system.family == "lb":
        lb_spec = replace(spec, mode="peering" if system.regional else "central", central=central,
                          policy=system.policy, peer_policy=peer_policy_for(system.policy), pushing=system.pushing,
                          lb=merge_sections(spec.lb, system.lb_config))  # bench.cluster scales its durations
        tb: Testbed = start_testbed(fleet, lb_spec)
        return Regional({r: [u] for r, u in tb.client_targets.items()},
                        {r: [s.url for s in ss] for r, ss in tb.replicas.items()}, tb.describe())
    names = [r.name for r in spec.regions]
    replicas = {r.name: [fleet.emulator(f"{r.name}-emu{i}", profile=spec.profile, speed=spec.speed,
                                        seed=spec.seed + 100 * j + i, extra=list(spec.emulator_args)).url
                         for i in range(r.replicas)] for j, r in enumerate(spec.regions)}
    # Two proxies: the coordinator needs its (remote) workers reachable before it starts, and
    # the clients' routes need the coordinator's port.
    to_replicas = DelayRoutes(spec)
    if system.family == "direct":  # no coordinator: every client round-robins over every replica
        targets = {r: [to_replicas.url(r, home, u) for home in names for u in replicas[home]] for r in names}
        to_replicas.start(fleet, "delay-proxy")
        return Regional(targets, replicas, "direct-rr: every client → every replica\n" + "\n".join(to_replicas.labels))
    workers = [to_replicas.url(central, r, u) for r in names for u in replicas[r]]
    to_replicas.start(fleet, "delay-proxy-workers")
    coordinator = start(system, fleet, workers, speed=spec.speed)[0]
    to_coordinator = DelayRoutes(spec)
    targets = {r: [to_coordinator.url(r, central, coordinator)] for r in names}
    to_coordinator.start(fleet, "delay-proxy-clients")
    return Regional(targets, replicas, f"{system.name}: one coordinator in {central} at {coordinator}\n"
                    + "\n".join(to_replicas.labels + to_coordinator.labels))


class DelayRoutes:
    """Routes of one `bench.delay_proxy` process: URL at which region a reaches a URL in region b."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.routes: list[str] = []
        self.labels: list[str] = []

    def url(self, a: str, b: str, url: str) -> str:
        ms = self.spec.latency(a, b)
        if ms <= 0:
            return url
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        listen = free_port()
        self.routes.append(f"{listen}=127.0.0.1:{port}@{ms:g}")
        self.labels.append(f"  delay-proxy {a} → {b}: :{listen} → :{port} (+{ms:g} ms each way)")
        return f"http://127.0.0.1:{listen}"

    def start(self, fleet: Fleet, name: str) -> None:
        if not self.routes:
            return
        health = free_port()
        fleet.start(name, [sys.executable, "-m", "bench.delay_proxy", "--health-port", str(health),
                           *[a for r in self.routes for a in ("--route", r)]], "/", health)


def pick_names(spec: str, known: list[str]) -> list[str]:
    """`--systems A,B` against the names a run knows: those named, in the order given, each
    once; an unknown name exits naming the known ones (live scenarios and the simulator)."""
    names = list(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(map(repr, unknown))}; known: "
                         + ", ".join(map(repr, known)))
    return names
