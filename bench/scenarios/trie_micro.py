"""Scenario `trie-micro`: the routing hot path, in-process, each policy side by side.

Per request: hash the prompt, choose among 12 available targets of 16, and insert the
decision (what the daemon does per dispatch), timed with perf_counter_ns; the trie held at
its size bound (100k block-prefix nodes, evicting as it goes) and prompts of 8 kB. A second
pass under tracemalloc reports the memory each policy holds at the bound. Variants:
  prefix-trie      lb's default (128-character blocks, flat dict of chain hashes)
  prefix-trie-64   the same with 64-character blocks (twice the nodes per prompt)
  prefix-pygtrie   the same policy with a pygtrie.Trie as the store (no eviction: it only
                   prices the walk and insert that the flat dict replaces; needs the
                   `bench` extra, `pip install lb[bench]`: lb itself does not depend on pygtrie)
  cache-aware      SGLang Router's algorithm over the same kind of trie
  consistent-hash  ring walk on the session key
  round-robin      the floor: no state worth the name
Run: `lb-bench scenario trie-micro [--quick]` or `python -m bench.scenarios.trie_micro`.
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import random
import statistics
import sys
import time
import tracemalloc

from lb.core.policies import make_policy
from lb.core.prefix import block_hashes
from lb.core.types import ReplicaView, RequestFacts

DESCRIPTION = "routing hot path: hash+choose+insert latency and memory at 100k trie nodes, 8 kB prompts"

PROMPT_CHARS = 8192
TARGETS = 16
AVAILABLE = 12


class PygtrieStore:
    """PrefixTrie's interface over pygtrie.Trie keyed by chain tuples; unbounded."""

    def __init__(self) -> None:
        try:
            import pygtrie
        except ImportError:
            raise SystemExit("trie-micro's prefix-pygtrie variant needs pygtrie: pip install 'lb[bench]'") from None
        self.trie = pygtrie.Trie()
        self.max_nodes = 0
        self.evictions = 0
        self.nodes = 0  # pygtrie's own len() walks the whole trie

    def __len__(self) -> int:
        return self.nodes

    def match(self, chain, wanted=None):
        depth, deepest = 0, None
        try:
            for step in self.trie.walk_towards(chain):
                if not step.key:
                    continue  # the root
                holders = step.get()
                if holders is None or (wanted is not None and wanted.isdisjoint(holders)):
                    break
                depth, deepest = depth + 1, holders
        except KeyError:  # the path ends before the chain does
            pass
        if deepest is None:
            return 0, []
        return depth, [t for t in deepest if wanted is None or t in wanted]

    def insert(self, chain, target, now):
        if not chain:
            return
        if chain not in self.trie:
            self.trie[chain] = {}
            self.nodes += 1
        for step in self.trie.walk_towards(chain):
            if step.key:
                if not step.is_set:
                    self.nodes += 1
                step.setdefault({})[target] = now

    def forget(self, target):
        for key, holders in list(self.trie.items()):
            holders.pop(target, None)


class Workload:
    """Prompts over shared documents (RAG/system prompts) and conversations that grow."""

    def __init__(self, seed: int, docs: int = 400):
        self.rng = random.Random(seed)
        self.docs = [self._text(self.rng.randrange(1024, 6144)) for _ in range(docs)]
        self.history: list[str] = []

    def _text(self, n: int) -> str:
        return self.rng.randbytes(n // 2 + 1).hex()[:n]

    def next_prompt(self) -> str:
        if self.history and self.rng.random() < 0.5:  # a follow-up turn: 7 kB seen, 1 kB new
            prompt = self.rng.choice(self.history)[: PROMPT_CHARS - 1024] + self._text(1024)
        else:
            doc = self.rng.choice(self.docs)
            prompt = doc + self._text(PROMPT_CHARS - len(doc))
        self.history.append(prompt)
        if len(self.history) > 2000:
            self.history.pop(self.rng.randrange(len(self.history)))
        return prompt


def make_variant(name: str, max_nodes: int, seed: int):
    if name == "prefix-pygtrie":
        policy = make_policy("prefix-trie", seed=seed)
        policy.scorers[0].trie = PygtrieStore()
        return policy
    if name == "prefix-trie-64":  # finer blocks: twice the nodes per prompt, half the text held
        return make_policy("prefix-trie", seed=seed, max_nodes=max_nodes, block_chars=64)
    opts = {"max_nodes": max_nodes} if name in ("prefix-trie", "cache-aware") else {}
    return make_policy(name, seed=seed, **opts)


def trie_of(policy):
    if hasattr(policy, "trie"):
        return policy.trie
    scorers = getattr(policy, "scorers", [])
    return getattr(scorers[0], "trie", None) if scorers else None


def views(rng: random.Random) -> list[ReplicaView]:
    vs = [ReplicaView(id=f"replica-{i}", url="", outstanding=rng.randrange(0, 40), running=rng.randrange(0, 40)) for i in range(TARGETS)]
    return rng.sample(vs, AVAILABLE)


def at_bound(store, max_nodes: int) -> bool:
    """A bounded store is at its bound once it evicts; the unbounded one once it has as many nodes."""
    if store is None:
        return True
    return store.evictions > 0 if store.max_nodes else len(store) >= max_nodes


def fill(policy, prompts, max_nodes: int, rng: random.Random, minimum: int = 2000) -> int:
    """Dispatch requests until the trie is at its bound; returns how many it took."""
    store = trie_of(policy)
    n = 0
    while n < minimum or not at_bound(store, max_nodes):
        facts = RequestFacts(request_id=f"w{n}", model="m", prompt=next(prompts), session=f"s{n % 5000}")
        policy.observe(facts, policy.choose(facts, views(rng), float(n)), float(n))
        n += 1
    return n


def percentiles(samples: list[float]) -> dict:
    s = sorted(samples)
    return {
        "p50": round(s[len(s) // 2], 1),
        "p90": round(s[int(len(s) * 0.9)], 1),
        "p99": round(s[int(len(s) * 0.99)], 1),
        "mean": round(statistics.fmean(s), 1),
    }


def measure(name: str, max_nodes: int, requests: int, seed: int) -> dict:
    policy = make_variant(name, max_nodes, seed)
    workload, rng = Workload(seed), random.Random(seed + 1)
    warm = fill(policy, iter(workload.next_prompt, None), max_nodes, rng)
    batch = [
        (RequestFacts(request_id=f"m{i}", model="m", prompt=workload.next_prompt(), session=f"s{i % 5000}"), views(rng))
        for i in range(requests)
    ]
    wall, cpu, matched = [], [], []
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for i, (facts, cands) in enumerate(batch):
        w0, c0 = wall_clock(), cpu_clock()
        target = policy.choose(facts, cands, 1e6 + i)
        policy.observe(facts, target, 1e6 + i)
        c1, w1 = cpu_clock(), wall_clock()
        wall.append((w1 - w0) / 1000)
        cpu.append((c1 - c0) / 1000)
        if policy.last.total_blocks:
            matched.append(policy.last.matched_blocks / policy.last.total_blocks)
    store = trie_of(policy)
    return {
        # wall time includes being preempted on a shared machine; thread CPU time does not
        "hash_choose_insert_us": percentiles(wall),
        "hash_choose_insert_cpu_us": percentiles(cpu),
        "requests": requests,
        "warmup_requests": warm,
        "trie_nodes": len(store) if store is not None else 0,
        "evictions": getattr(store, "evictions", 0),
        "mean_match_ratio": round(statistics.fmean(matched), 3) if matched else None,
    }


def memory_at_bound(name: str, max_nodes: int, seed: int) -> dict:
    """Bytes the policy holds once its trie is at the bound (prompts allocated before)."""
    workload, rng = Workload(seed), random.Random(seed + 1)
    prompts = [workload.next_prompt() for _ in range(max_nodes // 10)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    policy = make_variant(name, max_nodes, seed)
    fill(policy, iter(prompts), max_nodes, rng, minimum=0 if trie_of(policy) is not None else 2000)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    store = trie_of(policy)
    nodes = len(store) if store is not None else 0
    return {"memory_mb": round(held / 2**20, 1), "memory_nodes": nodes, "bytes_per_node": round(held / nodes) if nodes else None}


def hash_cost(requests: int, seed: int) -> float:
    """Mean thread CPU µs to hash one 8 kB prompt."""
    workload = Workload(seed)
    prompts = [workload.next_prompt() for _ in range(requests)]
    t0 = time.thread_time_ns()
    for p in prompts:
        block_hashes(p)
    return round((time.thread_time_ns() - t0) / 1000 / requests, 1)


VARIANTS = ["prefix-trie", "prefix-trie-64", "prefix-pygtrie", "cache-aware", "consistent-hash", "round-robin"]


def run(out_dir: pathlib.Path, quick: bool) -> dict:
    max_nodes = 20_000 if quick else 100_000
    requests = 1_000 if quick else 3_000
    seed = 7
    variants = {}
    for name in VARIANTS:
        started = time.monotonic()
        result = measure(name, max_nodes, requests, seed)
        result.update(memory_at_bound(name, max_nodes, seed))
        variants[name] = result
        if sys.stderr.isatty():
            print(f"  {name}: done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    base = variants["prefix-trie"]["hash_choose_insert_cpu_us"]["p50"]
    for result in variants.values():
        result["cpu_p50_vs_prefix_trie"] = round(result["hash_choose_insert_cpu_us"]["p50"] / base, 2)
    summary = {
        "scenario": "trie-micro",
        "params": {"max_nodes": max_nodes, "requests": requests, "prompt_chars": PROMPT_CHARS, "targets": TARGETS, "available": AVAILABLE},
        "hash_only_cpu_us_mean": hash_cost(min(requests, 1000), seed),
        "variants": variants,
    }
    summary["baseline"] = "prefix-trie"
    summary["notes"] = table(summary).splitlines()  # what `lb-bench scenario` prints after its table
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def table(summary: dict) -> str:
    head = f"{'variant':16} {'cpu p50':>8} {'cpu p99':>8} {'×p50':>6} {'wall p50':>9} {'wall p99':>9} {'nodes':>7} {'MB':>6} {'B/node':>7} {'match':>6}"
    rows = [head, "-" * len(head)]
    for name, v in summary["variants"].items():
        cpu, wall = v["hash_choose_insert_cpu_us"], v["hash_choose_insert_us"]
        rows.append(
            f"{name:16} {cpu['p50']:8} {cpu['p99']:8} {v['cpu_p50_vs_prefix_trie']:6} {wall['p50']:9} {wall['p99']:9} "
            f"{v['memory_nodes']:7} {v['memory_mb']:6} {v['bytes_per_node'] or '-':>7} {v['mean_match_ratio'] or '-':>6}"
        )
    rows.append("µs per request for hash + choose + insert; memory held at the size bound (tracemalloc)")
    rows.append(f"hashing an 8 kB prompt alone: {summary['hash_only_cpu_us_mean']} µs CPU")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results/trie-micro"))
    args = parser.parse_args()
    print(table(run(args.out, args.quick)))
    print(f"summary: {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
