"""The container's HEALTHCHECK: GET /health on the port lb really listens on.

    python -m lb.daemon.healthcheck            # reads lb's command line from /proc/1/cmdline
    python -m lb.daemon.healthcheck serve --config /etc/lb/lb.toml --port 9000

The port is --port if lb was started with it, else `server.port` of its --config file, else
8080 (the default), so changing the port in either place needs no change to the Dockerfile.
Exit 0 when lb answers 200, 1 otherwise.
"""
from __future__ import annotations

import sys
import tomllib
import urllib.request


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def health_url(argv: list[str]) -> str:
    server: dict = {}
    config = _flag(argv, "--config")
    if config:
        try:
            with open(config, "rb") as f:
                server = tomllib.load(f).get("server", {})
        except (OSError, tomllib.TOMLDecodeError):
            pass  # lb itself refuses such a file; the probe then fails on the default port
    port = _flag(argv, "--port") or server.get("port", 8080)
    host = _flag(argv, "--host") or server.get("host", "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/health"


def main(argv: list[str]) -> int:
    if not argv:
        with open("/proc/1/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
    try:
        with urllib.request.urlopen(health_url(argv), timeout=2) as r:
            return 0 if r.status == 200 else 1
    except OSError:
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
