"""`agent`: tool-using agent sessions, a coding agent's shape (closed loop, with tool time).

Each session is one task worked in steps: the prompt is the agent's system prompt (its
instructions and tool descriptions, the same for every session), the task, and every earlier
step's answer (the tool call the model wrote) and observation (what the tool returned). After
an answer the client runs the tool, waits `think` seconds, and sends the next step with the
observation appended, so a session's context grows by a few hundred to a thousand tokens a
step and sits idle in the replicas' caches while its tool runs. A session ends after its
planned steps or when its context would pass `max_context` tokens.

Synthetic and held out: added after the policy was settled, nothing in `lb` chosen on it.
The sizes are a coding agent's scaled to an 8k-context model: a 1,500-token system prompt,
200-800-token tasks, 4-16 steps of 32-256-token answers and log-uniform 50-1,500-token
observations, tool runs exponential with a 1 s mean (at most 5 s). Every step's plan is drawn
when the session starts, so a session's requests are known from its seed.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from bench.workloads.base import RequestSpec, pseudo_text, rng_for

# Chat-template tokens around each message (header and end-of-turn), for the context cap.
MESSAGE_OVERHEAD_TOKENS = 8


@dataclass(frozen=True)
class Step:
    output_tokens: int  # the answer: the tool call the model writes
    observation_tokens: int  # what the tool returns, appended to the next prompt
    think_s: float  # the tool's run time before the next step is sent


class Session:
    def __init__(self, *, session_id: str, user: str, system: str, task: str, steps: list[Step],
                 tier: str | None):
        self.session_id, self.user, self.system, self.task = session_id, user, system, task
        self.steps, self.tier = steps, tier

    def _spec(self, step: int, messages: list[dict], delay_s: float) -> RequestSpec:
        return RequestSpec(
            request_id=f"{self.session_id}-step{step}", messages=messages,
            max_tokens=self.steps[step].output_tokens, user=self.user, session=self.session_id,
            app="agent", interaction_id=self.session_id, stage=step, final=step == len(self.steps) - 1,
            tier=self.tier, delay_s=delay_s, meta={"step": step})

    def start(self) -> list[RequestSpec]:
        return [self._spec(0, [{"role": "system", "content": self.system},
                               {"role": "user", "content": self.task}], 0.0)]

    def on_done(self, spec: RequestSpec, output: str | None) -> list[RequestSpec]:
        step = spec.meta["step"]
        if output is None or step + 1 >= len(self.steps):
            return []
        done = self.steps[step]
        observation = pseudo_text(f"{self.session_id}/obs{step}", done.observation_tokens)
        return [self._spec(step + 1, spec.messages + [{"role": "assistant", "content": output},
                                                      {"role": "user", "content": observation}],
                           done.think_s)]


@dataclass
class Agent:
    seed: int = 0
    system_tokens: int = 1500
    task_tokens: tuple[int, int] = (200, 800)
    steps: tuple[int, int] = (4, 16)
    output_tokens: tuple[int, int] = (32, 256)
    observation_tokens: tuple[int, int] = (50, 1500)
    think_mean_s: float = 1.0
    think_max_s: float = 5.0
    max_context: int = 7000
    tier: str | None = None
    name: str = "agent"

    def __post_init__(self) -> None:
        for key in ("task_tokens", "steps", "output_tokens", "observation_tokens"):
            value = getattr(self, key)
            if not (isinstance(value, (list, tuple)) and len(value) == 2 and 0 < value[0] <= value[1]):
                low, high = getattr(type(self), key)
                raise ValueError(f"agent: {key} must be a range [low, high] with 0 < low <= high (got {value!r}); "
                                 f"e.g. --param {key}=[{low},{high}]")
        for key in ("system_tokens", "think_mean_s", "think_max_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"agent: {key} must be >= 0 (got {getattr(self, key)!r})")
        first = self.system_tokens + self.task_tokens[1] + self.output_tokens[1] + 3 * MESSAGE_OVERHEAD_TOKENS
        if self.max_context < first:
            raise ValueError(f"agent: max_context must hold the first step ({first} tokens); got {self.max_context}")

    @functools.cached_property
    def system(self) -> str:
        return pseudo_text("agent/system", self.system_tokens)

    def plan(self, rng, task_tokens: int) -> list[Step]:
        """The session's steps, cut where the next prompt plus its answer would pass the cap."""
        lo, hi = self.observation_tokens
        context = self.system_tokens + task_tokens + 3 * MESSAGE_OVERHEAD_TOKENS
        steps: list[Step] = []
        for _ in range(rng.randint(*self.steps)):
            out = rng.randint(*self.output_tokens)
            obs = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            think = min(self.think_max_s, rng.expovariate(1.0 / self.think_mean_s)) if self.think_mean_s else 0.0
            if context + out > self.max_context:
                break
            steps.append(Step(out, obs, think))
            context += out + obs + 2 * MESSAGE_OVERHEAD_TOKENS
        return steps

    def draw(self, client: int, index: int) -> tuple[int, list[Step]]:
        """The `index`-th session of `client`: its task's length and its steps."""
        rng = rng_for(self.seed, self.name, client, index)
        task_tokens = rng.randint(*self.task_tokens)
        return task_tokens, self.plan(rng, task_tokens)

    def program(self, client: int, index: int) -> Session:
        task_tokens, steps = self.draw(client, index)
        session_id = f"agent-c{client}-{index}"
        return Session(session_id=session_id, user=f"client-{client}", system=self.system,
                       task=pseudo_text(f"{session_id}/task/{self.seed}", task_tokens), steps=steps, tier=self.tier)

    def mean_steps(self, sessions: int = 2000) -> float:
        """Requests per session on average (for offering a rate of requests as sessions)."""
        return sum(len(self.draw(0, i)[1]) for i in range(sessions)) / sessions
