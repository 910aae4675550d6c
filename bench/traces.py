"""Loaders for the real traces and datasets shipped in `bench/data` (see its README).

Each loader returns plain, immutable rows with times in seconds from the start of the trace.
A missing file raises `TraceMissing`, an unparsable one `TraceCorrupt`; both are `TraceError`,
whose one-line message names the file (`lb-bench` prints it instead of a traceback).
"""
from __future__ import annotations

import contextlib
import csv
import functools
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# Another folder with the same layout may stand in (tests use it to check the errors).
DATA_DIR = Path(os.environ.get("LB_BENCH_DATA") or Path(__file__).resolve().parent / "data")

# Mooncake: one hash id per block of this many tokens (Mooncake FAST'25 release notes).
MOONCAKE_BLOCK_TOKENS = 512
SERVEGEN_WINDOW_S = 600.0


class TraceError(Exception):
    """A dataset in bench/data cannot be used; the message is one line naming the file."""


class TraceMissing(TraceError, FileNotFoundError):
    """A dataset file or folder is absent."""


class TraceCorrupt(TraceError, ValueError):
    """A dataset file is there but a row does not parse."""


def data_path(*parts: str) -> Path:
    path = DATA_DIR.joinpath(*parts)
    if not path.exists():
        raise TraceMissing(f"dataset {path} is absent (it ships in bench/data; restore it with git checkout -- bench/data)")
    return path


@contextlib.contextmanager
def _rows_of(path: Path):
    """Turn a parse error anywhere in reading `path` into one `TraceCorrupt` naming it."""
    try:
        yield
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as e:
        raise TraceCorrupt(f"dataset {path} is corrupt ({type(e).__name__}: {e}); "
                           "restore it with git checkout -- bench/data") from None


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.cache
def gsm8k_questions() -> tuple[str, ...]:
    path = data_path("gsm8k", "test_first200.jsonl")
    with _rows_of(path):
        return tuple(row["question"] for row in _jsonl(path))


@functools.cache
def mtbench_conversations() -> tuple[tuple[str, ...], ...]:
    """MT-Bench questions, each a tuple of its (two) user turns."""
    path = data_path("mtbench", "question.jsonl")
    with _rows_of(path):
        return tuple(tuple(row["turns"]) for row in _jsonl(path))


@dataclass(frozen=True)
class AzureRequest:
    t: float  # seconds from the first request
    context_tokens: int
    generated_tokens: int


@functools.cache
def azure_conv() -> tuple[AzureRequest, ...]:
    rows = []
    path = data_path("azure", "conv_2023_first30min.csv")
    with _rows_of(path), open(path, newline="") as f:
        for row in csv.DictReader(f):
            # Timestamps carry 7 fractional digits; datetime takes at most 6.
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    if not rows:
        raise TraceCorrupt(f"dataset {path} has no rows")
    t0 = rows[0][0]
    return tuple(AzureRequest((s - t0).total_seconds(), c, g) for s, c, g in rows)


@dataclass(frozen=True)
class MooncakeRequest:
    t: float  # seconds from trace start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # one per MOONCAKE_BLOCK_TOKENS-token block; equal ids = equal blocks


@functools.cache
def mooncake_conversation() -> tuple[MooncakeRequest, ...]:
    path = data_path("mooncake", "conversation_first15min.jsonl")
    with _rows_of(path):
        return tuple(MooncakeRequest(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]),
                                     tuple(r["hash_ids"])) for r in _jsonl(path))


@dataclass(frozen=True)
class ServeGenWindow:
    start: float  # seconds from the start of day 1
    rate: float  # requests per second in this window
    cv: float  # coefficient of variation of inter-arrival times
    distribution: str  # "Gamma", "Weibull" or "" (idle window)
    shape: float
    scale: float


@functools.cache
def servegen_clients() -> dict[str, tuple[ServeGenWindow, ...]]:
    """ServeGen m-small language clients: client id → its 10-minute rate windows."""
    folder = data_path("servegen", "m-small")
    clients = {}
    for path in sorted(folder.glob("chunk-*-trace.csv"), key=lambda p: int(p.name.split("-")[1])):
        with _rows_of(path), open(path, newline="") as f:
            windows = tuple(ServeGenWindow(float(r[0]), float(r[1]), float(r[2] or 0), r[3],
                                           float(r[4] or 0), float(r[5] or 0)) for r in csv.reader(f) if r)
        clients[path.name.split("-")[1]] = windows
    if not clients:
        raise TraceMissing(f"dataset {folder} holds no chunk-*-trace.csv files")
    return clients
