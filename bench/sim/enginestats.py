"""Engine-side evidence per replica of a simulated run: what each engine's scheduler did.

`WaitingSampler` samples every replica's waiting queue (the engine's own queue, not the
LB's) and running batch on a fixed virtual-time grid; `replica_stats` reads each engine's counters at the end:
requests finished, preemptions (SGLang: retractions), prefix-cache tokens evicted, prompt
tokens lost from the cache while their request waited, and the cache hit ratio.
"""
from __future__ import annotations

from bench.sim.arena import Arena

SAMPLE_S = 0.1


class WaitingSampler:
    def __init__(self, arena: Arena, until: float, every_s: float = SAMPLE_S):
        self.arena, self.until, self.every_s = arena, until, every_s
        self.samples: list[list[int]] = [[] for _ in arena.replicas]  # waiting
        self.running: list[list[int]] = [[] for _ in arena.replicas]
        arena.loop.after(every_s, self._sample)

    def _sample(self) -> None:
        for i, rep in enumerate(self.arena.replicas):
            load = rep.engine.load()
            self.samples[i].append(load.num_waiting)
            self.running[i].append(load.num_running)
        if self.arena.loop.now + self.every_s < self.until:
            self.arena.loop.after(self.every_s, self._sample)


def replica_stats(arena: Arena, waiting: WaitingSampler, skip: float = 0.0) -> list[dict]:
    """Per replica; waiting figures over the samples after the first `skip` share of the run."""
    out = []
    for i, rep in enumerate(arena.replicas):
        c = rep.engine.counters
        w = waiting.samples[i][int(len(waiting.samples[i]) * skip):]
        running = waiting.running[i][int(len(waiting.running[i]) * skip):]
        out.append({
            "replica": rep.id, "requests": c.requests,
            "busy_s": rep.busy_s,  # engine time spent in steps: work done, whatever the requests' sizes
            "waiting_mean": sum(w) / len(w) if w else 0.0, "waiting_max": max(w, default=0),
            "running_mean": sum(running) / len(running) if running else 0.0,
            "preemptions": c.preemptions, "evicted_tokens": c.evicted_tokens,
            "lost_while_waiting": c.lost_while_waiting,
            "hit_ratio": c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0,
        })
    return out
