"""Start and stop the processes a scenario needs on loopback: emulators, LBs, routers.

A `Fleet` is a context manager: every process it starts gets a free port, is polled for
readiness against a deadline (never a fixed sleep), logs to a file, and is stopped (TERM,
then KILL) when the block ends, whatever happened inside. It also accounts CPU time per
process from /proc, so scenarios can tell when the machine, not the system under test, is
the bottleneck.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SATURATION = 0.85  # warn when the run used this share of the machine's cores


PORT_LOCKS = Path(tempfile.gettempdir()) / f"lb-fleet-ports-{os.getuid()}"  # an empty file per port reserved
MAX_RESERVED = 512  # ports this process keeps reserved; the oldest is let go first
_reserved: OrderedDict[int, int] = OrderedDict()  # port -> the fd holding its lock


def free_port() -> int:
    """A loopback port free now and reserved against every other process that takes its ports
    here, until this process exits or has reserved `MAX_RESERVED` newer ones.

    bind(0) alone is not enough: the port is free again once the socket closes, and before the
    service started on it binds, another process's bind(0) can be handed the same one. That was
    seen in CI with two test workers: one's emulator failed with "address already in use" and
    its readiness poll was answered by the other's. So each port handed out is flocked in
    `PORT_LOCKS` (a lock dies with its holder, so a crashed run leaves nothing held) and a port
    another process holds is skipped."""
    PORT_LOCKS.mkdir(exist_ok=True)
    for _ in range(256):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port in _reserved:
            continue
        fd = os.open(PORT_LOCKS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _reserved[port] = fd
        while len(_reserved) > MAX_RESERVED:
            os.close(_reserved.popitem(last=False)[1])
        return port
    raise RuntimeError(f"no free loopback port after 256 tries (locks in {PORT_LOCKS})")


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on `port` in this network namespace (state 0A is LISTEN)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listener_in_group(port: int, pgid: int) -> bool | None:
    """Whether a process of group `pgid` is listening on `port`; None when /proc cannot tell
    (no listener seen here, say in another network namespace)."""
    sockets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not sockets:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        if any(_fd_target(pid, fd) in sockets for fd in fds):
            return True
    return False


def _fd_target(pid: str, fd: str) -> str:
    # A busy process opens and closes descriptors between the listing and the readlink (a
    # daemon probing its replicas does every 100 ms): that one descriptor is gone, not the
    # whole process's answer (CI once read a starting lb as foreign this way).
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (utime, stime: fields 14 and 15 of /proc/pid/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None,
              until: Callable[[bytes], bool] | None = None) -> None:
    """Poll `url` until it answers 2xx (with a body `until` accepts, if given), `proc` dies,
    or the deadline passes (tests use it too). With `proc`, the answer counts only if `proc`'s
    process group holds the port: an answer from some other process is not `proc` being ready."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                body = r.read()
                if 200 <= r.status < 300 and (until is None or until(body)):
                    if proc is not None and _foreign_listener(url, proc):
                        raise RuntimeError(f"{url} was answered by a process outside the one started "
                                           f"(pid {proc.pid}): another process holds its port")
                    return
                last = Exception(f"answered {body[:200]!r}")
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout:g}s: {last}")


def _foreign_listener(url: str, proc: subprocess.Popen) -> bool:
    try:
        group = os.getpgid(proc.pid)
    except OSError:  # exited since the poll: the next poll reports how
        return False
    parts = urlsplit(url)
    return listener_in_group(parts.port or (443 if parts.scheme == "https" else 80), group) is False


def all_workers_healthy(n: int) -> Callable[[bytes], bool]:
    """For SGLang Router's and the vLLM router's `/readiness`: they register their workers in
    the background and serve once one is healthy, so a round robin over three started while
    one was still being added cycled over two (seen in CI: [1, 1, 0, 2])."""
    def ready(body: bytes) -> bool:
        try:
            return json.loads(body).get("healthy_workers") == n
        except (ValueError, AttributeError):
            return False
    return ready


@dataclass
class Service:
    name: str
    url: str
    popen: subprocess.Popen
    log_path: Path
    extra_ports: dict[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Fleet:
    """Processes on 127.0.0.1 for one scenario; `with Fleet() as fleet: ...` stops them all."""

    def __init__(self, log_dir: Path | None = None):
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="lb-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.services: list[Service] = []

    def start(self, name: str, args: list[str], ready_path: str, port: int, *, timeout: float = 30.0,
              env: dict | None = None, extra_ports: dict[str, int] | None = None,
              until: Callable[[bytes], bool] | None = None) -> Service:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        service = Service(name, f"http://127.0.0.1:{port}", popen, log_path, extra_ports or {})
        self.services.append(service)
        try:
            wait_http(service.url + ready_path, timeout, popen, until)
        except Exception as e:
            raise RuntimeError(f"{name} failed to start ({e}); log:\n{service.log_tail()}") from None
        return service

    def emulator(self, name: str = "emu", *, profile: str = "tiny", speed: float = 1.0,
                 model: str | None = None, seed: int = 0, extra: list[str] | None = None) -> Service:
        port = free_port()
        args = [sys.executable, "-m", "bench.cli", "emulate", "--host", "127.0.0.1", "--port", str(port),
                "--profile", profile, "--speed", str(speed), "--seed", str(seed)]
        if model:
            args += ["--model", model]
        return self.start(name, args + (extra or []), "/health", port)

    def emulators(self, n: int, *, alt_profile: str | None = None, **kwargs) -> list[Service]:
        """`n` emulators, seeds counted up from `seed`; with `alt_profile`, every second one runs
        that profile instead (a fleet of two engines' schedulers side by side)."""
        seed = kwargs.pop("seed", 0)
        profile = kwargs.pop("profile", "tiny")
        return [self.emulator(f"emu{i}", seed=seed + i, profile=alt_profile if alt_profile and i % 2 else profile,
                              **kwargs) for i in range(n)]

    def sglang_router(self, worker_urls: list[str], *, policy: str = "cache_aware", name: str = "sglang-router",
                      extra: list[str] | None = None) -> Service:
        """SGLang Router (PyPI `sglang-router`), ready once every worker is registered and healthy."""
        port, prom = free_port(), free_port()
        args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
                "--worker-urls", *worker_urls, "--policy", policy, *(extra or [])]
        return self.start(name, args, "/readiness", port, timeout=60.0, extra_ports={"prometheus": prom},
                          until=all_workers_healthy(len(worker_urls)))

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far per service, plus this process (`client`)."""
        return {**{s.name: cpu_seconds(s.pid) for s in self.services}, "client": own_cpu_seconds()}

    def stop(self) -> None:
        for service in reversed(self.services):
            if service.popen.poll() is None:
                os.killpg(service.pid, signal.SIGTERM)
        for service in reversed(self.services):
            try:
                service.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(service.pid, signal.SIGKILL)
                service.popen.wait(timeout=5)
        self.services.clear()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class CpuMeter:
    """CPU used by the fleet and this process over one measured stretch of wall time."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.before = fleet.cpu()
        self.t0 = time.monotonic()

    def result(self) -> dict:
        wall = time.monotonic() - self.t0
        after = self.fleet.cpu()
        used = {k: round(after[k] - self.before.get(k, 0.0), 3) for k in after}
        total = sum(used.values())
        return {"wall_s": round(wall, 3), "cpu_s": used, "cores_used": round(total / wall, 3) if wall else 0.0,
                "cores": cores()}


def saturation_warning(machine: dict, what: str = "") -> str | None:
    """A warning when the run kept the machine's cores nearly busy: the numbers then measure
    the machine, not the system under test."""
    if machine["cores_used"] >= SATURATION * machine["cores"]:
        top = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(machine["cpu_s"].items(), key=lambda kv: -kv[1])[:4])
        return (f"{what}machine near saturation: {machine['cores_used']:.2f} of {machine['cores']} cores busy "
                f"over {machine['wall_s']:.1f}s ({top}); results reflect CPU limits, not the system under test")
    return None
