"""Command-line flags for config keys, apart from the config loader (rollwire.runtime.config)
so that a command module can declare its flags without importing pydantic: `rollwire --help`
imports the command modules, not their config models."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """A command-line flag for one config key; its type, help, default and choices come from the field."""

    key: str
    """Dotted config key, e.g. "sglang.url"."""
    name: str = ""
    """The flag; default `--` + the key with dots and underscores as dashes (`--sglang-url`)."""
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return self.name or "--" + self.key.replace(".", "-").replace("_", "-")

    @property
    def dest(self) -> str:
        return "config_flag:" + self.key
