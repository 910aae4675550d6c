"""`lb`: the load-balancer daemon's command line.

    lb serve --config FILE [flags]          run one region's LB (flags override the file)
    lb serve --port N --replica URL ...     run without a file
    lb check-config FILE [flags]            validate and print the effective config
    lb plan --history FILE [--config FILE]  forecast demand and plan capacity (planner_cli)
"""
from __future__ import annotations

import argparse
import sys

from lb import __version__
from lb.daemon.config import ENGINES, PUSHING_MODES, Config, ConfigError, from_env, load, to_toml, with_overrides


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="listen address (server.host)")
    p.add_argument("--port", type=int, help="listen port (server.port)")
    p.add_argument("--replica", action="append", metavar="URL",
                   help="a replica's base URL; repeat for several; replaces the file's [[replicas]]")
    p.add_argument("--engine", choices=ENGINES, help="engine of the --replica URLs (default auto: detected from their load endpoints)")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="model the --replica URLs serve (default: discovered from /v1/models)")
    p.add_argument("--policy", help="routing policy (routing.policy), e.g. prefix-trie, consistent-hash, least-load")
    p.add_argument("--pushing", choices=PUSHING_MODES, help="selective pushing mode (pushing.mode)")
    p.add_argument("--admin-token", help="bearer token for /admin (server.admin_token; or env LB_ADMIN_TOKEN)")
    p.add_argument("--region", help="this LB's region name (peering.region)")
    p.add_argument("--peer", action="append", metavar="NAME=URL",
                   help="a peer LB in region NAME; repeat for several (secret: env LB_PEER_SECRET)")


def effective_config(path: str | None, args: argparse.Namespace) -> Config:
    cfg = load(path) if path else from_env(Config())
    cfg = with_overrides(cfg, host=args.host, port=args.port, replicas=args.replica, engine=args.engine,
                         models=args.model, policy=args.policy, pushing=args.pushing, admin_token=args.admin_token)
    if args.region or args.peer:
        from dataclasses import replace
        from lb.core.peering import apply_peer_args
        try:
            peering, peers = apply_peer_args(cfg.peering, cfg.peers, args.region, args.peer)
        except ValueError as e:
            raise ConfigError(str(e))
        cfg = replace(cfg, peering=peering, peers=peers)
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # the planning process: its own parser, the `plan` extra's deps
        from lb.daemon.planner_cli import main as plan_main
        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(prog="lb", description="regional load balancer for LLM inference")
    parser.add_argument("--version", action="version", version=f"lb {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan", help="forecast token demand and plan capacity (lb plan --help)")
    serve_p = sub.add_parser("serve", help="run the load balancer")
    serve_p.add_argument("--config", metavar="FILE", help="TOML config (see config/single-region.toml)")
    _add_overrides(serve_p)
    check_p = sub.add_parser("check-config", help="validate a config and print the effective one")
    check_p.add_argument("file", metavar="FILE")
    _add_overrides(check_p)
    args = parser.parse_args(argv)
    try:
        cfg = effective_config(args.config if args.command == "serve" else args.file, args)
    except ConfigError as e:
        print(f"lb: bad config: {e}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        print(to_toml(cfg))
        return 0
    if not cfg.replicas and not cfg.discovery:  # discovery finds them once running
        print("lb: no replicas: add [[replicas]] to the config or pass --replica URL "
              "(or start empty and add them via POST /admin/replicas with an admin token)", file=sys.stderr)
        if not cfg.server.admin_token:
            return 2
    from lb.daemon.app import serve
    serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
