"""`rollwire proxy`: argument parsing only; the proxy is imported when the command runs."""

from __future__ import annotations

import argparse

POLICIES = ("least-loaded", "round-robin", "affinity")


def add_proxy_command(subparsers) -> None:
    p = subparsers.add_parser(
        "proxy",
        help="run the routing proxy in front of generator replicas",
        description="Serve GeneratorService and AdminService for many generator replicas behind one address.",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default 50050; 0 picks a free one)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default 9401; 0 picks a free one)")
    p.add_argument(
        "--generator",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a generator replica to route to; repeat for several",
    )
    p.add_argument("--discover", metavar="dns:///NAME:PORT", help="find replicas by resolving a DNS name periodically")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (default least-loaded)")
    p.add_argument(
        "--spool-dir", help="folder of spooled adapters, kept across restarts (default: a private temp folder)"
    )
    p.add_argument("--proxy-id", help="name in logs and status (default proxy@host:port)")
    p.add_argument("--config", help="TOML file with the proxy config")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. routing.max_in_flight_per_replica=16",
    )
    p.add_argument("--ready-file", help="write {port, metrics_port, pid} as JSON here once serving")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=run_proxy_command)


def run_proxy_command(args: argparse.Namespace) -> int:
    from rollwire.common.config import ConfigError, dump_config, load_config
    from rollwire.proxy.config import ProxyConfig

    flags = {
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "generators": args.generator or None,
        "discover": args.discover,
        "policy": args.policy,
        "spool.dir": args.spool_dir,
        "proxy_id": args.proxy_id,
    }
    try:
        config = load_config(ProxyConfig, args.config, args.set, flags)
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    if args.dry_run:
        print(dump_config(config), end="")
        return 0
    import asyncio

    from rollwire.common.logs import setup_logging
    from rollwire.proxy.app import run_proxy

    setup_logging("proxy", config.log_level)
    asyncio.run(run_proxy(config, args.ready_file))
    return 0
