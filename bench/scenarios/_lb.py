"""Start an `lb` daemon inside a scenario's Fleet (shared by the lb scenarios)."""
from __future__ import annotations

import sys
from pathlib import Path

from bench.fleet import Fleet, free_port
from lb.core.policies import DEFAULT_POLICY


PROBE_INTERVAL_S = 0.1  # lb's default, in engine time


def engine_time_keys() -> dict[tuple[str, str], float]:
    """lb's settings whose durations are engine time: (section, key) → the daemon's default."""
    keys = {("probes", "interval_s"): PROBE_INTERVAL_S}
    try:  # newer than this module: scale them when they are there (an older commit's lb lacks them)
        from lb.core.affinity import AffinityConfig
        d = AffinityConfig()
        keys.update({("affinity", "hold_s"): d.hold_s, ("affinity", "hold_per_token_s"): d.hold_per_token_s,
                     ("affinity", "max_bypass_s"): d.max_bypass_s})
        from lb.core.leases import DEFAULT_LEASE_S  # a session's next call comes after its tool's run
        keys[("pushing", "lease_s")] = DEFAULT_LEASE_S
    except ImportError:
        pass
    return keys


def engine_time_config(speed: float, config: dict | None = None) -> dict:
    """`config`'s TOML sections with every engine-time duration (`engine_time_keys`; the
    config's value where it sets one, else the default) divided by the emulators' speed-up,
    and no access log: what every scenario over emulators at `speed` starts lb with."""
    out = {section: dict(values) for section, values in (config or {}).items()}
    for (section, key), default in engine_time_keys().items():
        values = out.setdefault(section, {})
        values[key] = values.get(key, default) / speed
    out.setdefault("server", {}).setdefault("access_log", False)
    return out


def merge_sections(a: dict, b: dict) -> dict:
    """TOML sections of `a` with `b`'s keys over them, section by section."""
    return {k: {**a.get(k, {}), **b.get(k, {})} for k in {*a, *b}}


def start_lb(fleet: Fleet, replica_urls: list[str], *, name: str = "lb", engine: str = "sglang",
             policy: str = DEFAULT_POLICY, pushing: str = "sp-pending", config: dict | None = None,
             workdir: Path | None = None):
    """`lb serve` over `replica_urls`; `config` adds TOML sections, e.g. {"pushing": {"max_outstanding": 16}}."""
    port = free_port()
    args = [sys.executable, "-m", "lb.daemon.cli", "serve", "--port", str(port), "--engine", engine,
            "--policy", policy, "--pushing", pushing, *[a for u in replica_urls for a in ("--replica", u)]]
    if config:
        path = (workdir or fleet.log_dir) / f"{name}.toml"
        path.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in values.items())
                                for section, values in config.items()))
        args += ["--config", str(path)]
    return fleet.start(name, args, "/ready", port)


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, dict):  # an inline table, e.g. routing options
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return repr(v)
