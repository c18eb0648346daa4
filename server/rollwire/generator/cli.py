"""`rollwire generator`: argument parsing only; the replica (and torch) is imported when it runs.

Registered as the `generator` entry point of the `rollwire.commands` group (pyproject.toml).
Flags are generated from GeneratorConfig's fields; every other key is set with --set,
ROLLWIRE_* environment variables or the --config file (rollwire.runtime.config).
"""

from __future__ import annotations

import argparse

from rollwire.runtime.flags import Flag
from rollwire.serving.command import register_server

SUMMARY = "run a generator replica"
"""Its line in `rollwire --help`, which lists it without importing its config model."""
FLAGS = (
    Flag("model", metavar="DIR"),
    Flag("engine"),
    Flag("sglang.url", metavar="URL"),
    Flag("host"),
    Flag("port", metavar="PORT"),
    Flag("metrics_port", metavar="PORT"),
    Flag("replica_id", metavar="NAME"),
    Flag("adapter_window", metavar="K"),
    Flag("registration.proxy", "--register", metavar="PROXY_ADDR"),
    Flag("registration.ttl_seconds", "--register-ttl", metavar="SECONDS"),
    Flag("registration.advertise", "--advertise", metavar="HOST:PORT"),
    Flag("registration.token_file", "--register-token-file", metavar="FILE"),
    Flag("registration.ca_file", "--register-tls-ca", metavar="PEM"),
)
"""Command-line shortcuts for the keys set most often; help, type and choices come from the fields."""


def register(subparsers) -> None:
    """Add `rollwire generator` (imports the config model only: pydantic, no torch)."""
    from rollwire.generator.config import GeneratorConfig

    register_server(
        subparsers,
        "generator",
        GeneratorConfig,
        FLAGS,
        _serve,
        help=SUMMARY,
        example="limits.max_n=16",
    )


async def _serve(config, args: argparse.Namespace) -> None:
    from rollwire.generator.app import run_generator  # torch: only once the config is good

    await run_generator(config, args.ready_file, _registration(config))


def _registration(config):
    """The proxy membership asked for in config.registration (or --register), or None."""
    reg = config.registration
    if not reg.proxy:
        return None
    if config.host in ("0.0.0.0", "::", "") and not reg.advertise:
        raise SystemExit(
            f"--register: the proxy cannot dial {config.host!r}; give --advertise HOST:PORT, the address it can reach"
        )
    from rollwire.generator.registration import Registration
    from rollwire.serving.dial import Dialer

    return Registration(reg.proxy, reg.advertise, reg.ttl_seconds, Dialer.from_config(reg, "registration"))
