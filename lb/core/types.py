"""Plain data shared by every decision in `lb.core`.

Nothing here does I/O or reads a clock: the daemon (real time) and the simulator (virtual
time) fill these views and pass `now` explicitly, so one policy runs in both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, Sequence


class Pushing(str, Enum):
    """When the LB may push a request to a replica (SkyWalker §3.3)."""

    SP_PENDING = "sp-pending"  # SP-P: only to replicas with no pending (waiting) requests
    SP_OUTSTANDING = "sp-outstanding"  # SP-O: while LB-side outstanding < a fixed max
    BLIND = "blind"  # BP: push on arrival, the engine queues


class Tier(str, Enum):
    """SageServe workload tiers."""

    IW_F = "iw-f"  # interactive, fast
    IW_N = "iw-n"  # interactive, normal
    NIW = "niw"  # non-interactive batch, deadline in hours


@dataclass
class ReplicaView:
    """What the LB knows of one target (a local replica, or a peer LB seen as a target).

    `pending`, `running` and `kv_usage` come from the engine's own load endpoint at
    `last_probe_at`; `outstanding` is counted by the LB itself; `pushed_since_probe` counts
    requests sent after the last probe, which the probe cannot have seen yet.
    """

    id: str
    url: str
    engine: str = "openai"  # sglang | vllm | llamacpp | openai | peer
    models: frozenset[str] = frozenset()
    region: str = "local"
    healthy: bool = True
    pending: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1
    outstanding: int = 0
    pushed_since_probe: int = 0
    last_probe_at: float = 0.0
    # SP-P's headroom (lb.core.pushing): the engine's free KV tokens and batch cap at the last
    # probe (None when its load endpoint does not say), and the tokens the unseen pushes need.
    kv_free_tokens: int | None = None
    max_running: int | None = None
    pushed_tokens_since_probe: int = 0
    # engine reports its own waiting queue (False for a plain OpenAI server: LB counts only)
    reports_pending: bool = True
    draining: bool = False  # removed by admin/reload: finish in-flight, take nothing new

    def serves(self, model: str) -> bool:
        """A request naming no model (SGLang's /generate) takes any replica's own model."""
        return not model or not self.models or model in self.models


@dataclass(frozen=True)
class RequestFacts:
    """What routing, fairness and admission need of one request, parsed once."""

    request_id: str
    model: str
    # The text prefix hashing works on: the rendered messages or the completion prompt.
    prompt: str = ""
    prompt_tokens: int = 0  # estimate
    max_tokens: int | None = None
    stream: bool = False
    arrival: float = 0.0
    user: str | None = None
    session: str | None = None
    app: str | None = None
    interaction_id: str | None = None
    interaction_stage: int | None = None
    final_call: bool = False
    tier: Tier = Tier.IW_N
    residency: str | None = None
    hops: int = 0  # 1 when a peer LB forwarded it here
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def affinity_key(self) -> str:
        """Key for consistent hashing: session, else user, else the request itself."""
        return self.session or self.user or self.request_id


class Policy(Protocol):
    """Chooses among candidates that are already known to be available."""

    name: str

    def choose(self, req: RequestFacts, candidates: Sequence[ReplicaView], now: float) -> str | None: ...

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None: ...

    def forget(self, target_id: str) -> None: ...


class QueueOrder(Protocol):
    """The LB queue: its order is the schedule."""

    def push(self, entry: "QueueEntry") -> None: ...

    def pop(self, now: float) -> "QueueEntry | None": ...

    def peek(self, now: float) -> "QueueEntry | None": ...

    def remove(self, entry: "QueueEntry") -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self): ...


@dataclass(eq=False)
class QueueEntry:
    """One waiting request. Identity equality: the same facts may be queued twice."""

    facts: RequestFacts
    enqueued_at: float
    seq: int = 0
    payload: object = None  # the daemon's handle (future, body bytes); opaque to core
