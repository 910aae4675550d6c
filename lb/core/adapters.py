"""LoRA adapters: which ones a replica's batch runs, and whether a request's fits beside them.

An engine serving LoRA adapters runs at most `max_loras` of them in one batch (vLLM
`--max-loras`, SGLang `--max-loras-per-batch`). A waiting request whose adapter would make one
more is skipped until a running request of another adapter ends: it sits in that engine's
queue while the replica next to it, running its adapter or with a slot free, takes it at once.
Pushing it there anyway is a push the engine cannot run, the one thing selective pushing exists
to avoid. So a request for an adapter goes only where the adapter runs already or a slot is
free (`Adapters.fits`), and otherwise waits here, where any replica that frees a slot can take
it. A replica runs the adapters its last probe saw running (vLLM's `vllm:lora_requests_info`
`running_lora_adapters`) and those of this LB's own requests there not ended yet (the probe is
up to an interval old, and SGLang's load endpoints name none).

An adapter's KV is its own (vLLM's block hashes take the LoRA id, SGLang's radix tree splits by
`lora_id`): `lb.core.prefix.chain_salt` gives its prompts their own chain, so the trie never
takes one adapter's cached system prompt for another's.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from lb.core.types import ReplicaView

# A bound on the requests remembered (each ends, and `ended` forgets it; a caller that loses
# one leaves at most this many behind).
MAX_TRACKED = 1_000_000


class Adapters:
    """This LB's requests under way per replica and adapter."""

    def __init__(self) -> None:
        self.on: dict[str, Counter] = {}  # target id -> adapter -> requests there not ended
        self._of: dict[str, tuple[str, str]] = {}  # request id -> (target id, adapter)
        self._remote: dict[str, set[str]] = {}  # target id -> those of them another instance pushed

    def placed(self, request_id: str, target_id: str, adapter: str | None, *, remote: bool = False) -> None:
        """A request for `adapter` went to `target_id`: ours, or (`remote`) another instance's,
        heard through the shared store (lb.daemon.instances)."""
        if adapter is None or len(self._of) >= MAX_TRACKED:
            return
        self._of[request_id] = (target_id, adapter)
        self.on.setdefault(target_id, Counter())[adapter] += 1
        if remote:
            self._remote.setdefault(target_id, set()).add(request_id)

    def ended(self, request_id: str) -> None:
        placed = self._of.pop(request_id, None)
        if placed is None:
            return
        target_id, adapter = placed
        counts = self.on[target_id]
        counts[adapter] -= 1
        if counts[adapter] <= 0:
            del counts[adapter]
            if not counts:
                del self.on[target_id]
        remote = self._remote.get(target_id)
        if remote is not None:
            remote.discard(request_id)
            if not remote:
                del self._remote[target_id]

    def prune_remote(self, target_id: str, alive: set[str]) -> None:
        """Another instance's requests on `target_id` that its log of them no longer holds (their
        end never heard: that instance went away, or the message was lost) end here too, as the
        pushes they counted do (lb.core.instances.remote_unseen)."""
        for request_id in self._remote.get(target_id, set()) - alive:
            self.ended(request_id)

    def forget(self, target_id: str) -> None:
        """The replica left the fleet: nothing runs there any more."""
        for request_id in [r for r, (t, _) in self._of.items() if t == target_id]:
            self.ended(request_id)

    def count(self, view: ReplicaView) -> int:
        """How many adapters `view`'s batch runs as far as this LB knows: those its last probe
        saw running, and those of the requests under way there."""
        ours, seen = self.on.get(view.id), view.running_adapters
        return len(seen) + (sum(1 for a in ours if a not in seen) if ours else 0)

    def fits(self, view: ReplicaView, adapter: str | None) -> bool:
        """Whether a request for `adapter` can run on `view` now: no adapter or no known limit,
        its adapter runs there, or a slot is free."""
        limit = view.max_loras
        if adapter is None or limit is None or adapter in view.running_adapters:
            return True
        ours = self.on.get(view.id)
        return (ours is not None and adapter in ours) or self.count(view) < limit

    def limit(self, accepts: Callable[[ReplicaView], bool] | None, adapter: str
              ) -> Callable[[ReplicaView], bool]:
        """`accepts` narrowed to the replicas where `adapter` fits (asked afresh each time: each
        push and each end moves it)."""
        if accepts is None:
            return lambda view: self.fits(view, adapter)
        return lambda view: accepts(view) and self.fits(view, adapter)
