"""Start and stop the processes a scenario needs on loopback: emulators, LBs, routers.

A `Fleet` is a context manager: every process it starts gets a free port, is polled for
readiness against a deadline (never a fixed sleep), logs to a file, and is stopped (TERM,
then KILL) when the block ends, whatever happened inside. It also accounts CPU time per
process from /proc, so scenarios can tell when the machine, not the system under test, is
the bottleneck.
"""
from __future__ import annotations

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SATURATION = 0.85  # warn when the run used this share of the machine's cores


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    or the deadline passes (tests use it too)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                body = r.read()
                if 200 <= r.status < 300 and (until is None or until(body)):
                    return
                last = Exception(f"answered {body[:200]!r}")
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout:g}s: {last}")


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

    def emulators(self, n: int, **kwargs) -> list[Service]:
        seed = kwargs.pop("seed", 0)
        return [self.emulator(f"emu{i}", seed=seed + i, **kwargs) for i in range(n)]

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
