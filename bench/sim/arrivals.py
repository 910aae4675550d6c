"""Open-loop arrivals for the simulator, drawn from the real traces in `bench/data`.

Rates come from ServeGen (`m-small`: per client, per 10-minute window, a rate, a CV and an
inter-arrival distribution). Each window of each client is a renewal process: inter-arrival
times follow the window's named distribution (Gamma or Weibull, shape from the trace) with
the mean set by the window's rate (times `rate_scale`, which maps Alibaba's production
volume onto the simulated fleet). Clients are split across models by a fixed hash, so each
model's series is a different sum of real tenants.

Multi-region is *derived*: every region replays the same ServeGen day shifted by its own
phase (e.g. 0 h, 8 h, 16 h for US/EU/Asia), with its own random draws. No trace has
per-region data; the summary says so.

Request shapes (prompt and output tokens) are sampled from the Azure conversation trace, or
from the Mooncake trace, whose `hash_ids` keep their shared-prefix structure.

Arrivals are produced one window at a time (numpy), so a day of hundreds of requests per
second never sits in memory at once.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from bench import traces

WINDOW_S = traces.SERVEGEN_WINDOW_S
WINDOWS_PER_DAY = 144


@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()  # Mooncake prefix block ids (512 tokens each); () = unique prompt


@dataclass
class Window:
    """All arrivals of one 10-minute window, sorted by time (parallel arrays)."""

    t: np.ndarray  # seconds from the start of the simulated day(s)
    region: np.ndarray  # index into the region list
    model: np.ndarray  # index into the model list
    tenant: np.ndarray  # ServeGen client index
    shape: np.ndarray  # index into the shape pool

    def __len__(self) -> int:
        return len(self.t)


def shape_pool(source: str, size_scale: float = 1.0, max_prompt: int = 8192) -> list[Shape]:
    """Request shapes from a trace, lengths scaled by `size_scale` (≥1 token each)."""
    def scale(n: int) -> int:
        return max(1, int(round(n * size_scale)))

    if source == "azure-conv":
        return [Shape(min(scale(r.context_tokens), max_prompt), scale(r.generated_tokens))
                for r in traces.azure_conv()]
    if source == "mooncake":
        return [Shape(min(scale(r.input_length), max_prompt), scale(r.output_length), r.hash_ids)
                for r in traces.mooncake_conversation()]
    raise ValueError(f"unknown shape source {source!r} (azure-conv | mooncake)")


def model_of_client(client: str, n_models: int) -> int:
    return zlib.crc32(client.encode()) % n_models


def _interarrivals(rng: np.random.Generator, w: traces.ServeGenWindow, rate: float, n: int) -> np.ndarray:
    mean = 1.0 / rate
    if w.distribution == "Weibull" and w.shape > 0:
        k = w.shape
        return rng.weibull(k, n) * (mean / math.gamma(1.0 + 1.0 / k))
    if w.distribution == "Gamma" and w.shape > 0:
        return rng.gamma(w.shape, mean / w.shape, n)
    return rng.exponential(mean, n)


def window_times(rng: np.random.Generator, w: traces.ServeGenWindow, rate: float, start: float) -> np.ndarray:
    """Arrival times of one renewal process in [start, start + WINDOW_S)."""
    if rate <= 0:
        return np.empty(0)
    expected = rate * WINDOW_S
    n = int(expected * 1.5 + 10 * math.sqrt(expected) + 10)
    gaps = _interarrivals(rng, w, rate, n)
    gaps[0] *= rng.random()  # enter the renewal process at a random point
    times = np.cumsum(gaps)
    while times[-1] < WINDOW_S:  # a heavy tail ran short: draw more
        more = np.cumsum(_interarrivals(rng, w, rate, n)) + times[-1]
        times = np.concatenate([times, more])
    return start + times[times < WINDOW_S]


class DiurnalArrivals:
    """ServeGen clients → per-window arrivals for every region and model."""

    def __init__(self, regions: Sequence[str], models: Sequence[str], *, phase_hours: Sequence[float],
                 rate_scale: float, n_shapes: int, day: int = 0, seed: int = 0,
                 clients: dict[str, tuple[traces.ServeGenWindow, ...]] | None = None):
        self.regions = list(regions)
        self.models = list(models)
        self.phase_windows = [int(round(h * 3600 / WINDOW_S)) for h in phase_hours]
        self.rate_scale = rate_scale
        self.n_shapes = n_shapes
        self.day = day
        self.seed = seed
        self.clients = clients if clients is not None else traces.servegen_clients()
        self.client_ids = sorted(self.clients, key=int)
        self.client_model = [model_of_client(c, len(self.models)) for c in self.client_ids]

    def source_window(self, region: int, window: int, day: int | None = None) -> int:
        """Index into the ServeGen series of `window` of the simulated day (or of trace day
        `day`) for `region`."""
        day = self.day if day is None else day
        return day * WINDOWS_PER_DAY + (window + self.phase_windows[region]) % WINDOWS_PER_DAY

    def expected_rate(self, region: int, model: int, window: int, day: int | None = None) -> float:
        """Mean arrival rate (req/s) of one region×model in one window: the forecastable part."""
        src = self.source_window(region, window, day)
        return self.rate_scale * sum(self.clients[c][src].rate for c, m in zip(self.client_ids, self.client_model)
                                     if m == model and src < len(self.clients[c]))

    def window(self, window: int) -> Window:
        rng = np.random.default_rng([self.seed, window])
        parts = []
        for r in range(len(self.regions)):
            src = self.source_window(r, window)
            for ci, client in enumerate(self.client_ids):
                series = self.clients[client]
                if src >= len(series):
                    continue
                w = series[src]
                t = window_times(rng, w, w.rate * self.rate_scale, window * WINDOW_S)
                if len(t):
                    parts.append((t, r, self.client_model[ci], ci))
        if not parts:
            empty = np.empty(0, dtype=np.int64)
            return Window(np.empty(0), empty, empty, empty, empty)
        t = np.concatenate([p[0] for p in parts])
        sizes = [len(p[0]) for p in parts]
        region = np.repeat([p[1] for p in parts], sizes)
        model = np.repeat([p[2] for p in parts], sizes)
        tenant = np.repeat([p[3] for p in parts], sizes)
        order = np.argsort(t, kind="stable")
        shape = rng.integers(0, self.n_shapes, len(t))
        return Window(t[order], region[order], model[order], tenant[order], shape)

    def windows(self, first: int, count: int) -> Iterator[Window]:
        for w in range(first, first + count):
            yield self.window(w)
