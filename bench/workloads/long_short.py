"""`long-short`: a chat service beside long documents, open loop.

Four system prompts of 300 tokens, each chat request one of them and a 100-token question of
its own, 200-token answers; one request in ten is instead a unique 6,000-token document to
summarize (300-token answers). Poisson arrivals at `total_rps`. A long prompt's prefill takes a
replica's steps for seconds and the chats that land behind it wait: the head-of-line blocking a
router can steer around or not. Synthetic, held out (added after the policy was settled, the
thirty-sixth session); the simulator's `long-short` is the same draws (bench/sim/workloads_sim.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from bench.workloads.base import RequestSpec, pseudo_text, require_positive, rng_for

CHAT = (4, 300, 100, 200)  # system prompts, their tokens, question tokens, answer tokens
DOC = (6000, 300)  # document tokens, answer tokens
DOC_SHARE = 0.1


@dataclass(frozen=True)
class Draw:
    i: int
    at: float  # at 1 req/s
    system: int | None  # the chat's system prompt; None: a document


def draws(seed: int) -> Iterator[Draw]:
    """The arrivals at 1 req/s, what each one is."""
    rng = rng_for(seed, "long-short")
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(1.0)
        yield Draw(i, t, None if rng.random() < DOC_SHARE else rng.randrange(CHAT[0]))
        i += 1


@dataclass
class LongShort:
    seed: int = 0
    total_rps: float = 1.0
    name: str = "long-short"

    def __post_init__(self) -> None:
        require_positive(self, "total_rps")

    def arrivals(self) -> Iterator[RequestSpec]:
        _, system_tokens, question_tokens, answer_tokens = CHAT
        doc_tokens, doc_answer = DOC
        for d in draws(self.seed):
            at = d.at / self.total_rps
            if d.system is None:
                yield RequestSpec(
                    request_id=f"doc-{self.seed}-{d.i}",
                    messages=[{"role": "user", "content": pseudo_text(f"ls-doc/{self.seed}/{d.i}", doc_tokens)}],
                    max_tokens=doc_answer, user=f"doc-{d.i % 32}", at=at, meta={"kind": "doc"})
            else:
                yield RequestSpec(
                    request_id=f"chat-{self.seed}-{d.i}",
                    messages=[{"role": "system", "content": pseudo_text(f"ls-system/{d.system}", system_tokens)},
                              {"role": "user", "content": pseudo_text(f"ls-question/{self.seed}/{d.i}", question_tokens)}],
                    max_tokens=answer_tokens, user=f"chat-{d.i % 64}", at=at,
                    meta={"kind": "chat", "system": d.system})
