"""Plain data shared by every decision in `lb.core`.

Nothing here does I/O or reads a clock: the daemon (real time) and the simulator (virtual
time) fill these views and pass `now` explicitly, so one policy runs in both.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Collection, Protocol, Sequence


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
    engine: str = "openai"  # auto (until detected) | sglang | vllm | llamacpp | openai | peer
    models: frozenset[str] = frozenset()
    region: str = "local"
    # LoRA (lb.core.adapters): how many adapters one batch runs (None: no limit known) and which
    # ones its last probe saw running
    max_loras: int | None = None
    running_adapters: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()  # of `models`, those that are LoRA adapters (their cards name a parent)
    healthy: bool = True
    pending: int = 0
    running: int = 0
    kv_usage: float = 0.0  # 0..1
    outstanding: int = 0
    # what those are in the engine's own counts: a push of n parallel samples is n requests there
    # (lb.core.pushing.record_push), which a probe's count of pushes on the wire compares with
    outstanding_samples: int = 0
    pushed_since_probe: int = 0
    last_probe_at: float = 0.0
    # SP-P's headroom (lb.core.pushing): the engine's free KV tokens and batch cap at the last
    # probe (None when its load endpoint does not say), and the tokens the unseen pushes need.
    kv_free_tokens: int | None = None
    kv_total_tokens: int | None = None  # its whole KV cache (None when its load endpoint does not say)
    # the first tokens the engine has produced since it started, at the last probe (the count of
    # vLLM's TTFT histogram; None where its load endpoint has none): when the prefill of a push
    # answered whole, which shows the LB no first token, is done (lb.core.backlog)
    engine_first_tokens: int | None = None
    max_running: int | None = None
    # the batch cap learned from probes when the engine does not report one (vLLM keeps
    # max_num_seqs to itself; lb.core.pushing.learn_batch_cap)
    learned_max_running: int | None = None
    # the most requests seen running at a probe with none waiting: an engine whose cap is
    # unknown admits at least this many at once (SP-P's slow start, lb.core.pushing)
    proven_running: int = 0
    # (running, completions) at the probe that first showed requests waiting beside free KV
    # with that many running: a cap once a later probe shows the same after an answer ended
    cap_seen: tuple[int, int] | None = None
    completions: int = 0  # answers that ended on it (lb.core.pushing.settle_completion)
    # the engine's preemption counter at the last probe that had one; whether it has ever
    # preempted, so it keeps requests in its own queue; and whether it admits past its free KV
    # when it does (an engine that admits by prompt blocks; lb.core.pushing.note_preemptions)
    preemptions_seen: float | None = None
    requeues: bool = False
    overcommits: bool = False
    # its engine admits a waiting request whose prefix it holds ahead of those without one
    # (SGLang `--schedule-policy lpm`, from its /server_info; lb.core.pushing.holder_queue_open)
    orders_by_prefix: bool = False
    # when a probe last saw that counter grow: a request is not held for a replica that has
    # preempted lately beside a free one that has not and would idle (AffinityScheduler.hold)
    preempted_at: float | None = None
    probe_s: float = 0.0  # how long its last probe took (what one costs the engine; lb.core.scheduler.wants_probe)
    pushed_tokens_since_probe: int = 0
    # KV tokens of the contexts interactions under way will come back for, leased here between
    # their calls (lb.core.leases; the scheduler sets it each pass): not room for new work
    leased_tokens: int = 0
    # engine reports its own waiting queue (False for a plain OpenAI server: LB counts only)
    reports_pending: bool = True
    draining: bool = False  # removed by admin/reload: finish in-flight, take nothing new
    # uncached prompt tokens of this LB's pushes to it without a first token yet (waiting or
    # prefilling there; lb.core.backlog keeps it, the scheduler copies it before each choice)
    prefill_ahead: float = 0.0
    prefill_ahead_count: int = 0  # how many pushes those are
    # of `pushed_since_probe`, the pushes other LB instances made (lb.core.instances), and the
    # prompt tokens those would not find cached there (their own prefill work ahead)
    remote_since_probe: int = 0
    remote_prefill_since_probe: float = 0.0
    # (when, KV tokens) of recent pushes still in flight: what a probe may not have seen yet
    # (lb.core.pushing.record_push / settle_probe keep it; bounded by `outstanding`).
    push_log: deque = field(default_factory=deque, repr=False, compare=False)
    # the other LB instances' pushes to it not answered yet, as heard (lb.core.instances: bounded,
    # old ones dropped); the engine's own counts hold them beside ours (lb.core.pushing.settle_probe)
    remote_log: deque = field(default_factory=deque, repr=False, compare=False)

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
    max_tokens: int | None = None  # of each answer
    # Parallel sampling (the body's `n`): the engine prefills the prompt once and decodes this
    # many answers side by side, each of up to `max_tokens`, each a request in its own counts
    samples: int = 1
    # the LoRA adapter it runs with (its `model` names one a replica serves; lb.core.adapters),
    # None for a base model
    adapter: str | None = None
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


@dataclass
class Decision:
    """Why a policy chose what it chose: the explanation a placement carries into the
    access log and the `reason` metrics label (a small fixed set of words, bounded)."""

    target: str | None
    reason: str  # prefix | predicted | load | ring | round-robin | cache | imbalance | smallest-tree | anticipated | none
    # (a placement's reason may also be peer: no local replica could take it; peer-faster: one
    # could, and a peer's predicted TTFT plus the round trip was lower by the margin;
    # peer-prefix: none could, and that peer region holds its context)
    matched_blocks: int = 0
    total_blocks: int = 0
    # the longest prefix any candidate held: above `matched_blocks` when the policy left a
    # prefix's holder for a lower predicted time or load (what a recompute cost, in blocks)
    best_blocks: int = 0
    # the chosen target's predicted TTFT, if the policy predicts one (predicted-ttft: its cost,
    # the TTFT plus the small delay the request adds to the batch running there)
    predicted_ttft_s: float | None = None


class PrefixMemory(Protocol):
    def affinity(self, req: "RequestFacts", targets: Collection[str]) -> tuple[int, int, list[str]]:
        """(matched blocks, prompt blocks, holders) of the longest prefix of `req` that a
        target in `targets` holds."""

    def opening_holders(self, req: "RequestFacts") -> Collection[str]:
        """The targets holding the first block of `req`'s prompt (every match starts there)."""

    def cache_size(self, target_id: str, kv_tokens: int, bytes_per_token: float) -> None:
        """The target's engine holds `kv_tokens` of KV in all, `bytes_per_token` of prompt each:
        remember no more than fits."""

    def answered(self, req: "RequestFacts", target_id: str, output_tokens: int) -> None:
        """The target answered `req` with `output_tokens` tokens (its engine holds them after the prompt)."""

    def answer_after(self, req: "RequestFacts", target_id: str, depth: int, *, claim: bool = True,
                     take: bool = False) -> int:
        """Tokens of an answer the target gave where `req`'s `depth`-block match there ends (0:
        none, or another request claimed it); `claim` makes an unclaimed one `req`'s, `take` spends it."""

    def decode_step_s(self, target_id: str | None = None) -> float | None:
        """The inter-token time learned from the answers of `target_id` (None: the fleet's
        typical one), or None where nothing is learned."""

    def prefill_token_s(self) -> float | None:
        """The prefill time of a token the policy's own model puts on a typical replica (None:
        it keeps no rates)."""


class Policy(Protocol):
    """Chooses among candidates that are already known to be available (the scheduler's
    filter chain ran first). Every hook the scheduler calls is declared here; subclass
    `lb.core.policies.PolicyBase` for the no-op defaults."""

    name: str
    last: Decision  # why the last `choose` chose what it did

    def choose(self, req: RequestFacts, candidates: Sequence[ReplicaView], now: float) -> str | None: ...

    def observe(self, req: RequestFacts, target_id: str, now: float) -> None:
        """`req` was placed on `target_id` (trie inserts, load tracking)."""

    def served(self, req: RequestFacts, target_id: str, ttft_s: float | None, e2e_s: float | None,
               output_tokens: int, now: float) -> None:
        """`target_id` answered `req`: its first token after `ttft_s` (None when the answer came
        back whole, not streamed), its last after `e2e_s` (seconds from the push),
        `output_tokens` generated. Policies that learn rates use it."""

    def register(self, target_id: str) -> None:
        """A target became known, available or not (the consistent-hash ring keeps it)."""

    def forget(self, target_id: str) -> None:
        """A target is gone for good."""

    @property
    def prefix_memory(self) -> PrefixMemory | None:
        """What cache-affine queue scheduling (lb.core.affinity) asks about prefixes; None
        for a policy that remembers none."""

    @property
    def load_tracker(self):
        """The policy's own anticipated-load tracker (`lb.core.anticipator.LoadAwarePolicy`),
        which capacity planning reuses instead of keeping a second one; None for others."""


@dataclass(eq=False)
class QueueEntry:
    """One waiting request. Identity equality: the same facts may be queued twice."""

    facts: RequestFacts
    enqueued_at: float
    seq: int = 0
    payload: object = None  # the daemon's handle (future, body bytes); opaque to core
    # Per-request limits on where it may go: only targets `accepts` says yes to (e.g. the
    # /generate route needs an SGLang replica), and not the targets in `exclude` (they
    # already failed this request) unless no other healthy one serves it.
    accepts: Callable[[ReplicaView], bool] | None = None
    exclude: frozenset[str] = frozenset()
    # When cache-affine ordering first saw it among the queue's first entries (None: not yet):
    # its bounds on holds and reordering count from here, not from its arrival
    fronted_at: float | None = None
