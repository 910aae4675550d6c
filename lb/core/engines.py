"""Which engine a replica runs, and where its load is read.

Each engine adapter is an ordered list of load endpoints (newest shape first) with the parser
that reads it. A replica configured with `engine = "auto"` (the default) is told apart by the
same parsers: the first adapter, in `DETECT_ORDER`, whose endpoint answers in that adapter's own
shape is the engine; no adapter's shape means an OpenAI-compatible server with no load to read
("openai": LB-side outstanding counts only). SGLang goes first because its `/v1/loads` and
`/get_load` exist on no other engine, while a `/metrics` page may carry more than one family
(an exporter that merges them, or this project's emulator). vLLM keeps its load on `/metrics`
(`vllm:` names), llama.cpp on `/metrics` when started with `--metrics` (`llamacpp:` names).

An operator who leaves the engine out was, before detection, scheduled as "openai": blind to
the replica's queue, so selective pushing fell back to outstanding counts (docs/results.md,
"Where lb falls short"). A replica found to have no load endpoint is
asked again every `probes.redetect_s` (`REDETECT_S` by default): it may have answered before its
metrics were up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from lb.core import loadparse
from lb.core.loadparse import EngineLoad

Parser = Callable[[bytes], EngineLoad]
SHAPE_ERRORS = (ValueError, KeyError, TypeError)  # what a parser raises on an answer not in its shape

AUTO = "auto"
LOAD_ENDPOINTS: dict[str, list[tuple[str, Parser]]] = {
    "sglang": [("/v1/loads", loadparse.parse_sglang_v1_loads),
               ("/get_load", loadparse.parse_sglang_get_load),
               ("/metrics", loadparse.parse_sglang_metrics)],
    "vllm": [("/metrics", loadparse.parse_vllm_metrics)],
    "llamacpp": [("/metrics", loadparse.parse_llamacpp_metrics)],
    "openai": [],  # no load endpoint: LB-side outstanding counts only
}
# Engines whose load endpoint may not count first tokens while another page does: that page and
# its parser (`first_tokens_source`). SGLang's /metrics needs `--enable-metrics`.
FIRST_TOKENS_PAGE: dict[str, tuple[str, Parser]] = {"sglang": ("/metrics", loadparse.parse_sglang_metrics)}
KEEP_LAST = "keep the last count"


def first_tokens_source(engine: str, wanted: bool, absent_until: float, now: float) -> tuple[str, Parser] | str | None:
    """Where a probe whose load endpoint counted no first tokens gets the count: the page to
    read beside the load while pushes answered whole wait there (`wanted`: lb.core.backlog);
    KEEP_LAST while none waits (no request is spent on it; the first tokens since are met by
    those the LB knows of); None where the engine has no such page, or its page had no count
    (SGLang without --enable-metrics) until `absent_until`."""
    page = FIRST_TOKENS_PAGE.get(engine)
    if page is None:
        return None
    if not wanted:
        return KEEP_LAST
    return None if now < absent_until else page


LIVENESS = {"sglang": "/health", "vllm": "/health", "llamacpp": "/health", "openai": "/v1/models"}
ENGINES = (AUTO, *LOAD_ENDPOINTS)
DETECT_ORDER = ("sglang", "vllm", "llamacpp")
REDETECT_S = 30.0


@dataclass(frozen=True)
class Detected:
    engine: str
    endpoint: int = 0  # index into LOAD_ENDPOINTS[engine] of the endpoint that answered
    load: EngineLoad | None = None  # what it said, so the probe that detected needs no second read


def detection_paths() -> list[str]:
    """Every load endpoint of every adapter, each once, in the order detection reads them."""
    return list(dict.fromkeys(path for engine in DETECT_ORDER for path, _ in LOAD_ENDPOINTS[engine]))


def engine_from_answers(answers: Mapping[str, bytes | None]) -> Detected:
    """`answers`: each detection path's 200 body, or None where it answered otherwise."""
    for engine in DETECT_ORDER:
        for i, (path, parse) in enumerate(LOAD_ENDPOINTS[engine]):
            body = answers.get(path)
            if body is None:
                continue
            try:
                return Detected(engine, i, parse(body))
            except SHAPE_ERRORS:
                continue  # not this adapter's shape
    return Detected("openai")


def detection_due(configured: str, engine: str, reports_load: bool, detected_at: float, now: float,
                  redetect_s: float = REDETECT_S) -> bool:
    """Detect on the first probe of an "auto" replica, and again while it shows no load."""
    if configured != AUTO:
        return False
    return engine == AUTO or (not reports_load and now - detected_at >= redetect_s)


def queue_order_due(engine: str, read_for: str | None, detected: bool, healthy: bool) -> bool:
    """Read how an answering replica's engine orders its waiting queue (SGLang's
    `schedule_policy`) now? Once per engine detected (`read_for`: the engine it was last read
    for), and again while the replica is not yet healthy: one coming back may have restarted
    with other arguments. Not every probe: the answer changes only with a restart."""
    return detected or read_for != engine or not healthy
