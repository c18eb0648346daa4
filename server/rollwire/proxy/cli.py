"""`rollwire proxy`: argument parsing only; the proxy is imported when the command runs.

Registered as the `proxy` entry point of the `rollwire.commands` group (pyproject.toml).
Flags are generated from ProxyConfig's fields; every other key is set with --set,
ROLLWIRE_* environment variables or the --config file (rollwire.common.config).
"""

from __future__ import annotations

import argparse

from rollwire.common.config import Flag, add_config_arguments

FLAGS = (
    Flag("host"),
    Flag("port", metavar="PORT"),
    Flag("metrics_port", metavar="PORT"),
    Flag("generators", "--generator", metavar="HOST:PORT"),
    Flag("discover", metavar="dns:///NAME:PORT"),
    Flag("policy"),
    Flag("spool.dir", "--spool-dir", metavar="DIR"),
    Flag("proxy_id", metavar="NAME"),
)
"""Command-line shortcuts for the keys set most often; help, type and choices come from the fields."""


def register(subparsers) -> None:
    """Add `rollwire proxy` (imports the config model only: pydantic and grpc, no torch)."""
    from rollwire.proxy.config import ProxyConfig

    p = subparsers.add_parser(
        "proxy",
        help="run the routing proxy in front of generator replicas",
        description="Serve GeneratorService and AdminService for many generator replicas behind one address.",
    )
    add_config_arguments(p, ProxyConfig, FLAGS, example="routing.max_in_flight_per_replica=16")
    p.add_argument("--ready-file", help="write {port, metrics_port, pid} as JSON here once serving")
    p.set_defaults(func=run_proxy_command)


def run_proxy_command(args: argparse.Namespace) -> int:
    from rollwire.common.config import ConfigError, dump_config, flag_values, load_config
    from rollwire.proxy.config import ProxyConfig

    try:
        config = load_config(ProxyConfig, args.config, args.set, flag_values(args))
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
