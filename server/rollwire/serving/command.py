"""`rollwire generator` and `rollwire proxy`: a gRPC server process as a CLI subcommand.

Registering one imports only its config model (pydantic): the server, and torch with it, is
imported when the command runs, so `rollwire --help` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from rollwire.runtime.config import Flag, add_process_command, config_for_command
from rollwire.serving.config import ServerConfig

Serve = Callable[[Any, argparse.Namespace], Coroutine[Any, Any, None]]
"""`serve(config, args)`: runs the server until it stops (imports the heavy parts itself)."""


def register_server(
    subparsers: Any,
    name: str,
    model: type[ServerConfig],
    flags: Sequence[Flag | str],
    serve: Serve,
    *,
    help: str,
    example: str,
) -> argparse.ArgumentParser:
    """Add `rollwire NAME` (`help` in the command list, `model`'s docstring as its description)
    with its config flags and --ready-file. Running it resolves the config (flags > --set > env
    > --config file), prints it for --dry-run, else logs as NAME and awaits `serve(config, args)`."""
    p = add_process_command(subparsers, name, model, flags, help=help, example=example)
    p.set_defaults(func=functools.partial(_run, model=model, role=name, serve=serve))
    return p


def _run(args: argparse.Namespace, *, model: type[ServerConfig], role: str, serve: Serve) -> int:
    from rollwire.runtime.config import ConfigError
    from rollwire.runtime.logs import setup_logging

    config = config_for_command(model, args)
    if isinstance(config, int):
        return config
    setup_logging(role, config.log_level)
    try:
        asyncio.run(serve(config, args))
    except ConfigError as exc:  # what only starting could find out (a peer proxy already has this id)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
