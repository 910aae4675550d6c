"""What a workload is: requests with identity, produced closed-loop (programs) or open-loop.

Two shapes, as in the papers the benchmarks follow:
- `ClosedLoopWorkload`: each client runs one `Program` at a time (a Tree of Thoughts, a
  conversation). A program hands out its first requests, and after each completion the next
  ones, whose prompts extend what came before; so it depends on the real output text.
- `OpenLoopWorkload`: a trace replay; requests arrive at trace times (`RequestSpec.at`,
  seconds) whatever the system does.

Everything is deterministic per seed: same seed, same requests (given the same outputs).
"""
from __future__ import annotations

import functools
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Iterator, Protocol

# Identity headers: the LB honours the same names (docs/bench.md, identity headers).
H_USER = "X-LB-User"
H_SESSION = "X-LB-Session"
H_APP = "X-LB-App"
H_INTERACTION = "X-LB-Interaction-Id"
H_STAGE = "X-LB-Interaction-Stage"
H_FINAL = "X-LB-Final-Call"
H_TIER = "X-LB-Tier"
H_RESIDENCY = "X-LB-Residency"
H_REQUEST_ID = "X-Request-Id"


# What a client declares as `max_tokens`. A workload dictates each answer's length, and by
# default its client declares exactly that length: an oracle no real client is. Real ones
# declare nothing (chat UIs, most SDK calls) or a loose cap (reasoning and agent clients), and
# whatever `lb` reads from `max_tokens` (how long a request holds for its prefix's replica, the
# decode room it reserves) must hold up under both: `UNDECLARED` sends none, an int N sends N
# (less where the prompt leaves less room in the context), the answers as long as before.
EXACT, UNDECLARED = "exact", "none"


def check_max_tokens(value: object) -> str | int:
    """`exact`, `none` or a positive int (as given on a command line); else a ValueError that says so."""
    if value in (EXACT, UNDECLARED):
        return value
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or isinstance(value, bool):
        raise ValueError(f"max_tokens: give exact, none or a positive number of tokens, got {value!r}")
    return n


def declared_max_tokens(mode: str | int, output_tokens: int, room: int) -> int | None:
    """What the client sends as max_tokens for an answer of `output_tokens` (see EXACT):
    `room` is what the context leaves after the prompt."""
    if mode == EXACT:
        return output_tokens
    if mode == UNDECLARED:
        return None
    return max(output_tokens, min(int(mode), room))


@dataclass
class RequestSpec:
    """One request to send: chat messages, output length, and who it belongs to."""

    request_id: str
    messages: list[dict]
    max_tokens: int
    ignore_eos: bool = True  # the workload dictates the output length
    user: str | None = None
    session: str | None = None
    app: str | None = None
    interaction_id: str | None = None
    stage: int | None = None
    final: bool | None = None
    tier: str | None = None  # iw-f | iw-n | niw
    residency: str | None = None
    at: float = 0.0  # open loop: arrival, seconds from the start of the replay (unscaled)
    delay_s: float = 0.0  # closed loop: sent this long after its parent's answer (a tool's run; unscaled)
    n: int = 1  # parallel sampling: this many answers of `max_tokens` each (the API's `n`)
    adapter: str | None = None  # a LoRA adapter's name, sent as the body's `model` (None: the run's model)
    meta: dict = field(default_factory=dict)  # workload-specific facts (tree path, trace row)

    def headers(self, lb: bool = True) -> dict[str, str]:
        """The request's headers; `lb` False: none of lb's (session, interaction, stage, last
        call, app, user, tier, residency), as third-party clients send (the OpenAI `user` field
        in the body still names the user)."""
        if not lb:
            return {H_REQUEST_ID: self.request_id}
        pairs = {H_REQUEST_ID: self.request_id, H_USER: self.user, H_SESSION: self.session,
                 H_APP: self.app, H_INTERACTION: self.interaction_id, H_TIER: self.tier,
                 H_RESIDENCY: self.residency,
                 H_STAGE: None if self.stage is None else str(self.stage),
                 H_FINAL: None if self.final is None else ("1" if self.final else "0")}
        return {k: v for k, v in pairs.items() if v is not None}

    def body(self, model: str, declared: str | int = EXACT) -> dict:
        """The request's JSON; `declared`: what the client declares as max_tokens (EXACT below).
        Not declared exactly, the answer's length goes as `min_tokens` instead, which engines
        accept and the emulator ends its answer at (bench.engine.EngineRequest.min_new_tokens)."""
        body = {"model": self.adapter or model, "messages": self.messages, "max_tokens": self.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos and declared != EXACT:
            # the live client does not tokenize: a cap is kept to the context by whoever picks it
            cap = declared_max_tokens(declared, self.max_tokens, room=sys.maxsize)
            if cap is None:
                del body["max_tokens"]
            else:
                body["max_tokens"] = cap
            body["min_tokens"] = self.max_tokens
        elif self.ignore_eos:
            body["ignore_eos"] = True
        if self.user:
            body["user"] = self.user
        if self.n != 1:
            body["n"] = self.n
        return body

    def prompt_text(self) -> str:
        return "".join(m["content"] for m in self.messages)


class Program(Protocol):
    """One closed-loop program (a tree, a conversation) run by one client."""

    def start(self) -> list[RequestSpec]: ...

    def on_done(self, spec: RequestSpec, output: str | None) -> list[RequestSpec]:
        """Next requests after `spec` finished; `output` is None when it failed."""
        ...


class ClosedLoopWorkload(Protocol):
    name: str

    def program(self, client: int, index: int) -> Program:
        """The `index`-th program of client `client` (deterministic per seed)."""
        ...


class OpenLoopWorkload(Protocol):
    name: str

    def arrivals(self) -> Iterator[RequestSpec]:
        """Requests in arrival order (`at` non-decreasing); may be endless."""
        ...


def require_positive(workload: object, *keys: str) -> None:
    """A ValueError naming the first of a workload's `keys` that is not > 0, with its default."""
    for key in keys:
        if not getattr(workload, key) > 0:
            raise ValueError(f"{workload.name}: {key} must be > 0 (got {getattr(workload, key)!r}); "
                             f"e.g. --param {key}={getattr(type(workload), key)}")


def require_whole(workload: object, *keys: str) -> None:
    """A ValueError naming the first of a workload's `keys` that is not a whole number (a bool
    is not one), with its default."""
    for key in keys:
        value = getattr(workload, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{workload.name}: {key} must be a whole number (got {value!r}); "
                             f"e.g. --param {key}={getattr(type(workload), key)}")


def fixed_lengths(name: str, count: int, low: int, high: int) -> list[int]:
    """`count` lengths drawn uniformly from [low, high], the same for every seed: the fixed
    system prompts (apps, adapters) a fleet serves whatever the day's arrivals."""
    sizes = rng_for(0, name, "sizes")
    return [sizes.randint(low, high) for _ in range(count)]


def lognormal_tokens(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    """A token count drawn lognormal around `median`, kept within [low, high]."""
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def rng_for(seed: int, *key: object) -> random.Random:
    """An independent, reproducible stream per (seed, key): stable across runs and processes."""
    return random.Random("/".join(map(str, (seed, *key))))


# Short common English words (at most 8 letters): about one token each in BPE vocabularies
# and in the emulator's tokenizer, so N words ≈ N tokens. 256 of them: one random byte, one word.
_WORDS = tuple(w for w in """the of and to in is was for on are with as at be by this had not but what all
were when we there can an your which their said if do will each about how up out them then
she many some so these would other into has more her two like him see time could no make than
first been its who now people my made over did down only way find use may water long little
very after words called just where most know get through back much go good new write our me
man too any day same right look think also around another came come work three word must
because does part even place well such here take why things help put years different away
again off went old number great tell men say small every found still between name should home
big give air line set own under read last never us left end along while might next sound below
saw something thought both few those always looked show large often together asked house
world going want school important until form food keep children feet land side without boy
once animals life enough took sometimes four head above kind began almost live page got earth
need far hand high year mother light parts country father let night following picture being
study second eyes soon times story boys since white days ever paper hard near sentence better
best across during today others however sure means knew try told young miles sun ways thing
whole hear example heard several change answer room sea against top turned learn point city
play toward five using himself usually""".split() if len(w) <= 8)[:256]


@functools.lru_cache(maxsize=16384)
def _words(key: str, n_words: int) -> tuple[str, ...]:
    # randbytes of a multiple of 4 bytes is prefix-stable (32-bit words, little-endian).
    data = random.Random(key).randbytes(-(-n_words // 4) * 4)
    return tuple(_WORDS[b] for b in data[:n_words])


def pseudo_text(key: str, n_tokens: int, *, cache_len: int | None = None) -> str:
    """Deterministic filler of about `n_tokens` tokens; same key → same text, and the text for
    fewer tokens is a prefix of the text for more (so truncated blocks still share prefixes).
    Keys reused at several lengths (blocks) pass `cache_len` to draw their words once."""
    n = max(0, n_tokens)
    words = _words(key, max(n, cache_len or 0))
    return " ".join(words[:n]) + " " if n else ""
