"""Start an `lb` daemon inside a scenario's Fleet (shared by the lb scenarios)."""
from __future__ import annotations

import sys
from pathlib import Path

from bench.fleet import Fleet, free_port
from lb.core.policies import DEFAULT_POLICY


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
