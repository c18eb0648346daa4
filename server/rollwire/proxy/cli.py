"""`rollwire proxy`: argument parsing only; the proxy is imported when the command runs.

Registered as the `proxy` entry point of the `rollwire.commands` group (pyproject.toml).
Flags are generated from ProxyConfig's fields; every other key is set with --set,
ROLLWIRE_* environment variables or the --config file (rollwire.runtime.config).
"""

from __future__ import annotations

import argparse

from rollwire.runtime.flags import Flag
from rollwire.serving.command import register_server

SUMMARY = "run the routing proxy in front of generator replicas"
"""Its line in `rollwire --help`, which lists it without importing its config model."""
FLAGS = (
    Flag("host"),
    Flag("port", metavar="PORT"),
    Flag("metrics_port", metavar="PORT"),
    Flag("generators", "--generator", metavar="HOST:PORT"),
    Flag("discover", metavar="dns:///NAME:PORT"),
    Flag("policy"),
    Flag("spool.dir", "--spool-dir", metavar="DIR"),
    Flag("proxy_id", metavar="NAME"),
    Flag("http.port", "--http-port", metavar="PORT"),
    Flag("http.model_path", "--http-model", metavar="DIR"),
    Flag("http.adapter_root", "--http-adapter-root", metavar="DIR"),
)
"""Command-line shortcuts for the keys set most often; help, type and choices come from the fields."""


def register(subparsers) -> None:
    """Add `rollwire proxy` (imports the config model only: pydantic and grpc, no torch)."""
    from rollwire.proxy.config import ProxyConfig

    register_server(
        subparsers,
        "proxy",
        ProxyConfig,
        FLAGS,
        _serve,
        help=SUMMARY,
        example="routing.max_in_flight_per_replica=16",
    )


async def _serve(config, args: argparse.Namespace) -> None:
    from rollwire.proxy.app import run_proxy

    await run_proxy(config, args.ready_file)
