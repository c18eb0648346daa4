"""Typed configuration: pydantic models loaded from a TOML file plus dotted overrides.

Every process has one config model; fields carry their help text and bounds. A file gives
defaults, `key.sub=value` overrides win, unknown keys are errors that name the key.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

T = TypeVar("T", bound=BaseModel)


class Section(BaseModel):
    """Base for config sections: unknown keys are refused, assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


def parse_override(text: str) -> tuple[list[str], object]:
    """`a.b=3` -> (["a", "b"], 3); values are read as JSON when they parse, else strings."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def load_config(
    model: type[T], path: str | Path | None = None, overrides: list[str] | None = None, values: dict | None = None
) -> T:
    """Build `model` from an optional TOML file, then dotted `overrides` ("a.b=1"), then
    `values` (dotted key -> value, e.g. from command-line flags; None values are skipped)."""
    data: dict = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    items = [parse_override(o) for o in overrides or []]
    items += [(key.split("."), value) for key, value in (values or {}).items()]
    for keys, value in items:
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(keys)}: {key} is not a section")
        if value is not None:
            node[keys[-1]] = value
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None


def dump_config(config: BaseModel) -> str:
    """The resolved configuration as TOML-like text for --dry-run."""
    lines: list[str] = []

    def emit(prefix: str, obj: BaseModel) -> None:
        nested = []
        for name in type(obj).model_fields:
            value = getattr(obj, name)
            if isinstance(value, BaseModel):
                nested.append((name, value))
            else:
                lines.append(f"{name} = {json.dumps(value, default=str)}")
        for name, value in nested:
            lines.append(f"\n[{prefix}{name}]")
            emit(f"{prefix}{name}.", value)

    emit("", config)
    return "\n".join(lines).strip() + "\n"
