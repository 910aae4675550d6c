"""SageServe's deferred queue for NIW (batch) work.

NIW requests are accepted at once and wait here, not in the LB queue. On every signal (a
probe round) the manager releases work into the LB queue while the region has room: one
request when effective KV utilization is below 60%, two below 50%. A request whose age
passes `promote_after_s`, or whose deadline is within `deadline_margin_s`, is released
regardless (promoted) so batch deadlines are met under sustained interactive load.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from .queueing import StaticKeyQueue
from .tiers import TierConfig
from .types import QueueEntry, ReplicaView, RequestFacts, Tier


@dataclass(frozen=True)
class DeferredConfig:
    release_one_below: float = 0.60
    release_two_below: float = 0.50
    promote_after_s: float = 3600.0
    deadline_margin_s: float = 600.0
    max_entries: int = 100_000
    # Directory holding the durable job journal (`jobs.jsonl`, see lb/core/jobs.py); unset:
    # the job API is off and held NIW work lives in memory only (lost on restart).
    persist_dir: str | None = None
    job_retention_s: float = 7 * 86400.0  # a finished job stays fetchable this long
    # Bounds on durable jobs (docs/security.md): over one, a new job gets 429 (413 for one body
    # larger than a tenant's byte budget). Finished jobs are dropped oldest-first, before their
    # retention ends, when the totals need room; unfinished ones never are.
    max_jobs: int = 10_000  # jobs held (unfinished and finished kept), all tenants
    max_job_bytes: int = 256 * 1024 * 1024  # bytes of their requests and responses, all tenants
    max_jobs_per_tenant: int = 1_000  # unfinished jobs of one tenant (x-lb-user or API key)
    max_job_bytes_per_tenant: int = 64 * 1024 * 1024  # bytes of one tenant's unfinished jobs
    max_journal_bytes: int = 512 * 1024 * 1024  # the journal is compacted when it grows past this (>= max_job_bytes)

    @classmethod
    def from_dict(cls, d: dict, path: str = "deferred") -> "DeferredConfig":
        d = dict(d)
        cfg = cls(**{k: d.pop(k) for k in list(d) if k in cls.__dataclass_fields__})
        if d:
            raise ValueError(f"{path}: unknown keys {sorted(d)}")
        if not 0 <= cfg.release_two_below <= cfg.release_one_below <= 1:
            raise ValueError(f"{path}: need 0 ≤ release_two_below ≤ release_one_below ≤ 1")
        if cfg.promote_after_s < 0 or cfg.deadline_margin_s < 0 or cfg.max_entries < 1:
            raise ValueError(f"{path}: promote_after_s and deadline_margin_s ≥ 0, max_entries ≥ 1")
        if cfg.persist_dir is not None and (not isinstance(cfg.persist_dir, str) or not cfg.persist_dir):
            raise ValueError(f"{path}.persist_dir: must be a directory path")
        if cfg.job_retention_s <= 0:
            raise ValueError(f"{path}.job_retention_s: must be > 0")
        for key in ("max_jobs", "max_job_bytes", "max_jobs_per_tenant", "max_job_bytes_per_tenant", "max_journal_bytes"):
            value = getattr(cfg, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{path}.{key}: must be an integer >= 1, got {value!r}")
        if cfg.max_journal_bytes < cfg.max_job_bytes:
            raise ValueError(f"{path}.max_journal_bytes: must be >= max_job_bytes ({cfg.max_job_bytes}): "
                             "a compacted journal holds every job kept")
        return cfg


def replica_kv_load(r: ReplicaView, available: Callable[[ReplicaView], bool] | None = None) -> float:
    """One replica's share of KV in use, 0..1: its probed KV usage, or full when requests wait
    in its own queue or the pushing mode would not push to it (`available`): it takes nothing
    more whatever its KV says."""
    return 1.0 if r.pending > 0 or (available is not None and not available(r)) else r.kv_usage


def effective_kv_utilization(replicas: Iterable[ReplicaView],
                             available: Callable[[ReplicaView], bool] | None = None) -> float:
    """Mean `replica_kv_load` of the healthy, non-draining replicas. No such replica: 1.0
    (release nothing)."""
    usages = [replica_kv_load(r, available) for r in replicas if r.healthy and not r.draining]
    return sum(usages) / len(usages) if usages else 1.0


@dataclass(frozen=True)
class Release:
    entry: QueueEntry
    promoted: bool  # released by age or deadline, not by spare capacity


class DeferredQueue(StaticKeyQueue):
    """Earliest E2E deadline first: the LB queue's heap (`StaticKeyQueue`), bounded."""

    name = "deferred"

    def __init__(self, cfg: DeferredConfig | None = None, tiers: TierConfig | None = None):
        super().__init__()
        self.cfg = cfg or DeferredConfig()
        self.tiers = tiers or TierConfig()
        # (enqueued_at, push seq, entry), oldest first, removed lazily as the deadline heap is:
        # age promotions are this heap's prefix, as deadline promotions are the other's
        self._by_age: list[tuple[float, int, QueueEntry]] = []
        self._seq: dict[QueueEntry, int] = {}  # push order, the deadline heap's tie-break
        self._pushes = itertools.count()
        self._models: dict[str, int] = {}  # model → entries held (`by_model`)

    def key(self, entry: QueueEntry) -> object:
        return self.tiers.e2e_deadline(entry.facts)

    def push(self, entry: QueueEntry) -> None:
        if entry in self:
            raise ValueError("entry is already deferred")
        if len(self) >= self.cfg.max_entries:
            raise OverflowError(f"deferred queue is full ({self.cfg.max_entries})")
        super().push(entry)
        seq = self._seq[entry] = next(self._pushes)
        heapq.heappush(self._by_age, (entry.enqueued_at, seq, entry))
        self._models[entry.facts.model] = self._models.get(entry.facts.model, 0) + 1

    def remove(self, entry: QueueEntry) -> bool:
        if not super().remove(entry):
            return False
        self._forget(entry)
        return True

    def pop(self, now: float) -> QueueEntry | None:
        entry = super().pop(now)
        if entry is not None:
            self._forget(entry)
        return entry

    def by_model(self) -> dict[str, int]:
        """How many entries are held per model (the capacity round's unified-pool rule),
        counted as they come and go, not by walking 100,000 of them."""
        return dict(self._models)

    def _forget(self, entry: QueueEntry) -> None:
        del self._seq[entry]
        model = entry.facts.model
        self._models[model] -= 1
        if not self._models[model]:
            del self._models[model]
        if len(self._by_age) > 2 * len(self._seq) + 16:  # as the deadline heap compacts
            self._by_age = [item for item in self._by_age if item[2] in self._seq]
            heapq.heapify(self._by_age)

    def capacity_releases(self, kv_utilization: float) -> int:
        if kv_utilization < self.cfg.release_two_below:
            return 2
        if kv_utilization < self.cfg.release_one_below:
            return 1
        return 0

    def _promoted_now(self, now: float) -> list[QueueEntry]:
        """Every entry `promoted` now, in the queue's order. Deadline promotions are a prefix
        of the deadline heap and age promotions of the age heap, so a round looks at those
        and one more of each, not at every entry (a scan of 100,000 held the event loop
        164 ms each probe interval, 10,000 8.5 ms; measured)."""
        found: dict[QueueEntry, None] = {}
        by_age = self._by_age
        while by_age and by_age[0][2] not in self._seq:  # removed since: gone for good
            heapq.heappop(by_age)
        first = self.peek(now)
        if first is None or not (self._deadline_near(first, now) or self._old(by_age[0][0], now)):
            return []  # neither heap's first is due: nothing is
        for entry in self.iter_in_order(now):  # earliest deadline first
            if not self._deadline_near(entry, now):
                break
            found[entry] = None
        oldest = list(self._by_age)  # popped lazily: O(log n) per entry looked at
        while oldest and self._old(oldest[0][0], now):
            entry = heapq.heappop(oldest)[2]
            if entry in self._seq:
                found[entry] = None
        return sorted(found, key=lambda e: (self.key(e), self._seq[e]))

    def promoted(self, entry: QueueEntry, now: float) -> bool:
        """Released regardless of load: held `promote_after_s`, or its deadline near."""
        return self._old(entry.enqueued_at, now) or self._deadline_near(entry, now)

    def _old(self, enqueued_at: float, now: float) -> bool:
        return now - enqueued_at >= self.cfg.promote_after_s

    def _deadline_near(self, entry: QueueEntry, now: float) -> bool:
        return self.tiers.e2e_deadline(entry.facts) - now <= self.cfg.deadline_margin_s

    def release_round(self, now: float, *, queued: int, replicas: Iterable[ReplicaView],
                      available: Callable[[ReplicaView], bool]) -> list[Release]:
        """One admission round (every probe interval): work already waiting in the LB queue
        (`queued` entries) means no spare capacity to hand out; else the region's effective
        KV utilization decides. The daemon's gate and the simulator both call this."""
        if not len(self):
            return []
        util = 1.0 if queued else effective_kv_utilization(replicas, available)
        return self.release(now, util)

    def release(self, now: float, kv_utilization: float) -> list[Release]:
        """One signal: promoted entries, then up to 1-2 more by spare capacity."""
        out = [Release(e, True) for e in self._promoted_now(now)]
        for r in out:
            self.remove(r.entry)
        for _ in range(self.capacity_releases(kv_utilization)):
            entry = self.pop(now)
            if entry is None:
                break
            out.append(Release(entry, False))
        return out


def to_record(entry: QueueEntry) -> dict:
    """A JSON-able record of a deferred entry (the daemon adds the body bytes it forwards)."""
    facts = asdict(entry.facts)
    facts["tier"] = entry.facts.tier.value
    return {"facts": facts, "enqueued_at": entry.enqueued_at, "seq": entry.seq}


def from_record(record: dict, payload: object = None) -> QueueEntry:
    facts = dict(record["facts"])
    facts["tier"] = Tier(facts["tier"])
    return QueueEntry(RequestFacts(**facts), record["enqueued_at"], record.get("seq", 0), payload)
