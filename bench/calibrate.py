"""`lb-bench calibrate`: what each engine profile produces, next to the numbers it was set from.

Pure computation: the engine model runs in virtual time (no sockets, no sleeps), so this
takes about a second. Per profile: prefill time of a 512- and a 2,048-token prompt alone,
decode tokens/s at batch 1, 16 and 64 (128-token prompts, 256 output tokens each, decode-only
steps), and how many requests run at once when a chat mix arrives together (the token sizes
of the first Azure conv 2023 requests, from bench/data):
`max_chat_concurrency` is the time-weighted mean of running requests while others wait
(what the KV admits when saturated), `peak_chat_concurrency` the most seen at any step.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import traces
from bench.engine import Engine, EngineRequest
from bench.profiles import PROFILES, Profile

CHAT_REQUESTS = 600


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", action="append", choices=sorted(PROFILES),
                        help="profile(s) to calibrate (default: all)")
    parser.add_argument("--json", type=Path, help="also write the numbers to this JSON file")


def _run(engine: Engine, now: float = 0.0):
    """Step the engine until idle; yields each step's result."""
    while (t := engine.next_event_time(now)) is not None:
        result = engine.step(t)
        now = result.end
        yield result


def _tokens(n: int, key: int) -> list[int]:
    return [key * 1_000_003 + i for i in range(n)]


def prefill_ms(profile: Profile, n: int) -> float | None:
    engine = Engine(profile)
    if n >= engine.max_request_tokens():
        return None
    engine.submit(EngineRequest("p", _tokens(n, 1), 1, ignore_eos=True), 0.0)
    return 1000 * max(r.end for r in _run(engine))


def decode_tps(profile: Profile, batch: int, prompt: int = 128, output: int = 256) -> float:
    engine = Engine(profile)
    for i in range(batch):
        engine.submit(EngineRequest(f"d{i}", _tokens(prompt, i), output, ignore_eos=True), 0.0)
    tokens = seconds = 0.0
    for r in _run(engine):
        if r.prefill_tokens == 0:
            tokens += len(r.tokens)
            seconds += r.duration
    return tokens / seconds


def chat_mix(n: int) -> tuple[list[tuple[int, int]], str]:
    """(prompt tokens, output tokens) pairs and where they came from."""
    rows = [(r.context_tokens, r.generated_tokens) for r in traces.azure_conv()[:n]]
    return rows, "Azure conv 2023 (first rows)"


def chat_concurrency(profile: Profile, mix: list[tuple[int, int]]) -> tuple[float, int]:
    """Running requests while others wait (time-weighted mean), and the peak."""
    engine = Engine(profile)
    limit = engine.max_request_tokens()
    for i, (p, o) in enumerate(mix):
        p = min(p, limit - 1)
        engine.submit(EngineRequest(f"c{i}", _tokens(p, i), max(1, min(o, limit - p)),
                                    ignore_eos=True), 0.0)
    busy = weighted = 0.0
    peak = 0
    for r in _run(engine):
        load = engine.load()
        peak = max(peak, load.num_running)
        if load.num_waiting:
            busy += r.duration
            weighted += r.duration * load.num_running
    return (weighted / busy if busy else float(peak)), peak


def calibrate(profile: Profile, mix: list[tuple[int, int]]) -> dict[str, float | None]:
    saturated, peak = chat_concurrency(profile, mix)
    return {
        "prefill_512_ms": prefill_ms(profile, 512),
        "prefill_2048_ms": prefill_ms(profile, 2048),
        "decode_tps_b1": decode_tps(profile, 1),
        "decode_tps_b16": decode_tps(profile, 16),
        "decode_tps_b64": decode_tps(profile, 64),
        "max_chat_concurrency": saturated,
        "peak_chat_concurrency": peak,
    }


def run(args: argparse.Namespace) -> int:
    mix, mix_source = chat_mix(CHAT_REQUESTS)
    results = {}
    print(f"chat mix: {len(mix)} requests arriving together, {mix_source}\n")
    print(f"{'profile':<20} {'metric':<22} {'model':>10} {'source':>8}  source note")
    for name in args.profile or list(PROFILES):
        profile = PROFILES[name]
        numbers = results[name] = calibrate(profile, mix)
        for metric, value in numbers.items():
            ref, note = profile.reference.get(metric, ("", ""))
            shown = "n/a" if value is None else f"{value:.0f}" if value >= 10 else f"{value:.1f}"
            print(f"{name:<20} {metric:<22} {shown:>10} {str(ref):>8}  {note}")
        print(f"{'':<20} source: {profile.source}\n")
    if args.json:
        args.json.write_text(json.dumps({"chat_mix": mix_source, "profiles": results}, indent=2))
    return 0
