"""Scaling actuators: carry scaling decisions out of the LB into the fleet.

A decision (`lb.core.scaling.ScalingDecision`, or its JSON) says "pool (region, model) should
have N replicas". Actuators, chosen in config (`[[scaling.actuators]]`, see
config/scaling.toml):

- `command`    run a program with the decision as JSON on stdin; killed after `timeout_s`.
- `webhook`    POST the JSON, signed: `X-LB-Timestamp: <unix s>` and
               `X-LB-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>." + body)>`;
               retried with exponential backoff on connection errors, 429 and 5xx.
- `kubernetes` PATCH `/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale` with
               `{"spec": {"replicas": N}}` (merge patch), bearer token read from the
               service-account token file at each call (tokens rotate).
- `local`      start/stop local `lb-bench emulate` processes and report the replica URLs
               added/removed to a callback (the daemon's capacity loop registers them with
               the LB; a removed one is reported, and drained, before its process stops).

`ScalingHooks` never blocks routing: `submit()` is synchronous and only records the decision;
each actuator drains its own queue in its own asyncio task, keeping the newest decision per
pool, so a slow or failing actuator delays nobody but itself. Decisions are rate-limited
per pool and every decision and outcome is logged as one JSON line.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import aiohttp

from lb.core.planner import PLAN_SOURCES
from lb.core.scaling import make_strategy

log = logging.getLogger("lb.scaling")

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ActuatorError(RuntimeError):
    pass


class Actuator(Protocol):
    name: str

    async def apply(self, decision: dict) -> None: ...

    async def close(self) -> None: ...


def _as_json(decision) -> dict:
    return decision.to_json() if hasattr(decision, "to_json") else dict(decision)


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The webhook signature; receivers recompute it and compare in constant time."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


class CommandActuator:
    name = "command"

    def __init__(self, argv: list[str], timeout_s: float = 10.0):
        if not argv:
            raise ValueError("command actuator needs a non-empty `argv`")
        self.argv = list(argv)
        self.timeout_s = timeout_s

    async def apply(self, decision: dict) -> None:
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(decision).encode()), self.timeout_s)
        except BaseException as e:  # timeout, or the hooks stopping: leave no orphan behind
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            if isinstance(e, asyncio.TimeoutError):
                raise ActuatorError(f"{self.argv[0]} timed out after {self.timeout_s}s") from None
            raise
        if proc.returncode != 0:
            raise ActuatorError(f"{self.argv[0]} exited {proc.returncode}: {err.decode(errors='replace')[-300:]}")

    async def close(self) -> None:
        pass


class _Http:
    """A lazily created aiohttp session with retry on transient failures."""

    def __init__(self, timeout_s: float, retries: int, backoff_s: float, ssl=None):
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.ssl = ssl
        self._session: aiohttp.ClientSession | None = None

    async def send(self, method: str, url: str, body: bytes, headers: dict) -> int:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        last = "no attempt"
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._session.request(method, url, data=body, headers=headers, ssl=self.ssl) as r:
                    text = await r.text()
                    if r.status < 300:
                        return r.status
                    last = f"HTTP {r.status}: {text[:200]}"
                    if r.status != 429 and r.status < 500:
                        break  # the request itself is wrong: retrying will not help
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
        raise ActuatorError(f"{method} {url} failed: {last}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class WebhookActuator:
    name = "webhook"

    def __init__(self, url: str, secret: str | None = None, secret_env: str | None = None,
                 retries: int = 3, backoff_s: float = 0.5, timeout_s: float = 5.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url: {url!r} is not an http(s) URL; write e.g. url = \"https://scaler.internal/hook\"")
        self.url = url
        self.secret = secret or (os.environ.get(secret_env) if secret_env else None)
        if not self.secret:
            raise ValueError("webhook actuator needs `secret` or `secret_env` naming a set variable")
        self.http = _Http(timeout_s, retries, backoff_s)

    async def apply(self, decision: dict) -> None:
        body = json.dumps(decision, sort_keys=True).encode()
        ts = str(int(time.time()))
        await self.http.send("POST", self.url, body, {
            "Content-Type": "application/json", "X-LB-Timestamp": ts,
            "X-LB-Signature": sign(self.secret, ts, body)})

    async def close(self) -> None:
        await self.http.close()


class KubernetesActuator:
    """Scale a Deployment per pool; `deployment` is a template over {region} and {model}."""

    name = "kubernetes"

    def __init__(self, api_server: str = "https://kubernetes.default.svc", namespace: str | None = None,
                 deployment: str = "{model}", token_file: str = f"{SA_DIR}/token",
                 ca_file: str | None = f"{SA_DIR}/ca.crt", retries: int = 2, backoff_s: float = 0.5,
                 timeout_s: float = 5.0):
        self.api_server = api_server.rstrip("/")
        if namespace is None:
            try:
                namespace = open(f"{SA_DIR}/namespace").read().strip()
            except OSError:
                namespace = "default"
        self.namespace = namespace
        self.deployment = deployment
        self.token_file = token_file
        ssl_ctx = None
        if self.api_server.startswith("https://") and ca_file and os.path.exists(ca_file):
            import ssl
            ssl_ctx = ssl.create_default_context(cafile=ca_file)
        self.http = _Http(timeout_s, retries, backoff_s, ssl=ssl_ctx)

    def url_for(self, decision: dict) -> str:
        name = self.deployment.format(region=decision["region"], model=decision["model"])
        return f"{self.api_server}/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}/scale"

    async def apply(self, decision: dict) -> None:
        try:
            token = open(self.token_file).read().strip()
        except OSError as e:
            raise ActuatorError(f"service-account token unreadable: {e}") from None
        body = json.dumps({"spec": {"replicas": int(decision["desired"])}}).encode()
        await self.http.send("PATCH", self.url_for(decision), body, {
            "Content-Type": "application/merge-patch+json", "Authorization": f"Bearer {token}"})

    async def close(self) -> None:
        await self.http.close()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


ReplicaChange = Callable[[str, str, list[str], list[str]], Awaitable[None]]


class LocalActuator:
    """Keep `desired` local emulator processes per pool; newest stop first."""

    name = "local"

    def __init__(self, argv: list[str] | None = None, host: str = "127.0.0.1",
                 ready_timeout_s: float = 30.0, on_change: ReplicaChange | None = None,
                 max_replicas: int = 16):
        self.argv = argv or [sys.executable, "-m", "bench.cli", "emulate", "--host", "{host}",
                             "--port", "{port}", "--model", "{model}", "--profile", "tiny"]
        self.host = host
        self.ready_timeout_s = ready_timeout_s
        self.on_change = on_change
        self.max_replicas = max_replicas
        # Replicas of the pool this actuator does not run (e.g. static [[replicas]]): a
        # decision's `desired` counts the whole pool, so they are subtracted when it applies.
        self.unmanaged: Callable[[str, str], int] = lambda region, model: 0
        self.procs: dict[tuple[str, str], list[tuple[asyncio.subprocess.Process, str]]] = {}

    def urls(self, region: str, model: str) -> list[str]:
        return [url for _, url in self.procs.get((region, model), [])]

    async def _start(self, region: str, model: str) -> tuple[asyncio.subprocess.Process, str]:
        port = _free_port(self.host)
        argv = [a.format(host=self.host, port=port, model=model, region=region) for a in self.argv]
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        url = f"http://{self.host}:{port}"
        deadline = time.monotonic() + self.ready_timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
            while time.monotonic() < deadline:
                if proc.returncode is not None:
                    break
                try:
                    async with s.get(f"{url}/health") as r:
                        if r.status == 200:
                            return proc, url
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.1)  # poll interval while it boots, bounded by the deadline
        await self._stop(proc)
        raise ActuatorError(f"local replica {url} did not become ready in {self.ready_timeout_s}s")

    @staticmethod
    async def _stop(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), 5.0)
            except asyncio.TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            except ProcessLookupError:
                pass

    async def apply(self, decision: dict) -> None:
        key = (decision["region"], decision["model"])
        running = self.procs.setdefault(key, [])
        want = max(0, min(self.max_replicas, int(decision["desired"]) - self.unmanaged(*key)))
        added = []
        try:
            while len(running) < want:
                running.append(await self._start(*key))
                added.append(running[-1][1])
        finally:
            if self.on_change is not None and added:
                await self.on_change(key[0], key[1], added, [])
        leaving = [running.pop() for _ in range(len(running) - want)]
        if leaving and self.on_change is not None:
            # deregister first: the callback drains in-flight requests before the process stops
            await self.on_change(key[0], key[1], [], [url for _, url in leaving])
        for proc, _ in leaving:
            await self._stop(proc)

    async def close(self) -> None:
        for running in self.procs.values():
            while running:
                await self._stop(running.pop()[0])


ACTUATORS = {"command": CommandActuator, "webhook": WebhookActuator,
             "kubernetes": KubernetesActuator, "local": LocalActuator}


def make_actuator(table: dict, on_change: ReplicaChange | None = None) -> Actuator:
    """One actuator from a config table: `{type = "...", ...its options}`."""
    opts = dict(table)
    kind = opts.pop("type", None)
    if kind not in ACTUATORS:
        raise ValueError(f"scaling.actuators.type: {kind!r}; choose one of {sorted(ACTUATORS)}")
    if kind == "local":
        opts["on_change"] = on_change
    try:
        return ACTUATORS[kind](**opts)
    except TypeError as e:
        raise ValueError(f"scaling.actuators ({kind}): {e}") from None


class ScalingHooks:
    """Rate-limited, logged fan-out of decisions to actuators, off the request path."""

    def __init__(self, actuators: list[Actuator], min_interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, history: int = 256):
        self.actuators = list(actuators)
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.last: dict[tuple[str, str], tuple[float, int]] = {}  # pool → (accepted at, desired)
        self.pending = [dict() for _ in self.actuators]  # per actuator: pool → newest decision
        self.wakeups = [asyncio.Event() for _ in self.actuators]
        self.outcomes: collections.deque = collections.deque(maxlen=history)
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._drain(i), name=f"scaling-{a.name}")
                      for i, a in enumerate(self.actuators)]

    def submit(self, decision) -> bool:
        """Record a decision for every actuator; False when rate-limited or unchanged."""
        d = _as_json(decision)
        key, now = (d["region"], d["model"]), self.clock()
        prev = self.last.get(key)
        if d["desired"] == d.get("current") and (prev is None or prev[1] == d["desired"]):
            return False  # nothing to do
        if prev is not None and prev[1] == d["desired"]:
            return False  # already asked for exactly this
        if prev is not None and now - prev[0] < self.min_interval_s:
            log.info(json.dumps({"event": "scaling_rate_limited", **d}))
            return False
        self.last[key] = (now, d["desired"])
        log.info(json.dumps({"event": "scaling_decision", **d}))
        for pending, wake in zip(self.pending, self.wakeups):
            pending[key] = d
            wake.set()
        return True

    async def _drain(self, i: int) -> None:
        actuator, pending, wake = self.actuators[i], self.pending[i], self.wakeups[i]
        while True:
            await wake.wait()
            wake.clear()
            while pending:
                key = next(iter(pending))
                d = pending.pop(key)
                t0 = time.monotonic()
                try:
                    await actuator.apply(d)
                    outcome = {"ok": True}
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # an actuator's failure is logged, never propagated
                    outcome = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                outcome = {"event": "scaling_actuated", "actuator": actuator.name, "region": key[0],
                           "model": key[1], "desired": d["desired"],
                           "seconds": round(time.monotonic() - t0, 3), **outcome}
                self.outcomes.append(outcome)
                (log.info if outcome["ok"] else log.warning)(json.dumps(outcome))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for a in self.actuators:
            await a.close()


@dataclass(frozen=True)
class ScalingConfig:
    """The daemon's `[scaling]` table (config/scaling.toml documents every key)."""

    strategy: str | None = None  # None: only the stateless lb_desired_replicas, nothing actuated
    interval_s: float = 5.0  # how often the capacity loop decides each pool
    min_interval_s: float = 30.0  # actuator rate limit per pool
    params: dict = field(default_factory=dict)  # passed to lb.core.scaling.make_strategy
    actuators: tuple = ()  # [[scaling.actuators]] tables
    signal_window_s: float = 60.0  # observed tokens/s and queue-latency p95 over this past
    forecast_window_s: float = 600.0  # token forecast per window of this length (PreServe: 10 min)
    niw_per_replica: int = 8  # unified pool: deferred NIW requests that keep one replica from being donated
    kv_capacity_tokens: int = 100_000  # per replica, for the anticipated-KV look-ahead
    local_engine: str = "sglang"  # how the LB probes replicas the `local` actuator starts
    drain_timeout_s: float = 60.0  # scale-in: longest wait for a removed replica's requests
    # `lb plan --out` JSON: its count for the current window is `planned` in each pool's
    # signals (what lt-i/lt-u/lt-ua/preserve scale toward); re-read whenever the file changes.
    plan_file: str = ""
    plan_source: str = "auto"  # auto | preserve (per-window PreServe N) | ilp (the ILP's target)

    @classmethod
    def from_dict(cls, d: dict, path: str = "scaling") -> "ScalingConfig":
        d = dict(d)
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        tables = d.pop("actuators", [])
        if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
            raise ValueError(f"{path}.actuators: write each as a [[scaling.actuators]] table")
        try:
            cfg = cls(**d, actuators=tuple(dict(t) for t in tables))
        except TypeError as e:
            raise ValueError(f"{path}: {e}") from None
        if cfg.strategy is not None:
            try:
                make_strategy(cfg.strategy, **cfg.params)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}.strategy/params: {e}") from None
        for i, t in enumerate(cfg.actuators):
            try:
                make_actuator(t)
            except ValueError as e:
                raise ValueError(f"{path}.actuators[{i}]: {e}") from None
        for key in ("interval_s", "min_interval_s", "signal_window_s", "forecast_window_s", "drain_timeout_s"):
            if not float(getattr(cfg, key)) > 0:
                raise ValueError(f"{path}.{key}: must be > 0, got {getattr(cfg, key)}")
        if cfg.plan_source not in PLAN_SOURCES:
            raise ValueError(f"{path}.plan_source: {cfg.plan_source!r} is not allowed; use one of: "
                             f"{', '.join(PLAN_SOURCES)}")
        if cfg.niw_per_replica < 1 or cfg.kv_capacity_tokens < 1:
            raise ValueError(f"{path}: niw_per_replica and kv_capacity_tokens must be >= 1")
        return cfg
