"""`rollwire generator` and `rollwire proxy`: a gRPC server process as a CLI subcommand.

Importing a command module imports nothing heavy (its flags, its one-line SUMMARY); registering
one imports its config model (pydantic); the server, and torch with it, is imported when the
command runs, so `rollwire --help` and a bad flag answer at once.

Python's cyclic garbage collector is off while a server starts: the start allocates some
600,000 objects that live as long as the process (torch, transformers, the model), and every
few thousand allocations a collection walked all of them again (~15% of a replica's start).
Once it serves, the collector is on again with those objects frozen (gc.freeze), so neither
later collections nor the interpreter's exit walk them (exit took ~3 s with torch loaded).
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollwire.runtime.flags import Flag
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
    from rollwire.runtime.config import add_process_command

    p = add_process_command(subparsers, name, model, flags, help=help, example=example)
    p.set_defaults(func=functools.partial(_run, model=model, role=name, serve=serve))
    return p


def _run(args: argparse.Namespace, *, model: type[ServerConfig], role: str, serve: Serve) -> int:
    import asyncio

    from rollwire.runtime.config import ConfigError, config_for_command
    from rollwire.runtime.logs import setup_logging

    config = config_for_command(model, args)
    if isinstance(config, int):
        return config
    setup_logging(role, config.log_level)
    gc.disable()  # until it serves (scaffold.serve_until_signal): see the module's docstring
    try:
        asyncio.run(serve(config, args))
    except ConfigError as exc:  # what only starting could find out (a peer proxy already has this id)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        gc.enable()  # on already, unless the start failed before serving (a caller in this process goes on)
    return 0
