"""Named registries: the one place where each engine, routing policy and loss is named.

A registry maps a name to a factory. Everything that lists the names reads the registry:
config validation (a field annotated `Annotated[str, REGISTRY]` accepts exactly the
registered names, checked when the config is loaded, so a name registered at run time is
accepted), the command line's `choices`, the contract tests that parametrize over it and the
test that finds every name in the docs. Adding an entry is one `register` line.

Invariants:
- a factory given as "package.module:attribute" is imported only by `load`, so listing,
  validating and offering the names never imports the entry's module (and never torch);
- a name is registered at most once; `check` refuses any other name with a sentence that
  lists the registered ones;
- a registry is a singleton: copying returns the same object, so pydantic's copies of field
  metadata still see entries registered later.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Entry(Generic[F]):
    """One registered name: its factory ("module:attribute" or the object) and a one-line summary."""

    name: str
    target: str | F
    summary: str
    traits: Mapping[str, Any] = field(default_factory=dict)
    """Facts about the entry that code must not infer from its name (e.g. an engine that needs no weights)."""

    def load(self) -> F:
        """The factory itself, importing its module now if it was registered by path."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attribute = self.target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
        return obj


class Registry(Generic[F]):
    """Names of one kind (`kind` is "engine", "routing policy", ...) and their factories."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[F]] = {}

    def register(self, name: str, target: str | F, summary: str, **traits: Any) -> None:
        """Add `name`; `target` is "package.module:attribute" (imported lazily) or the factory."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        if isinstance(target, str) and (":" not in target or not all(target.partition(":")[::2])):
            raise ValueError(f"{self.kind} {name!r}: {target!r} must look like 'package.module:attribute'")
        self._entries[name] = Entry(name, target, summary, dict(traits))

    def unregister(self, name: str) -> None:
        """Remove `name` (tests that register a dummy entry put things back with this)."""
        del self._entries[self.check(name)]

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order (the first is the conventional default)."""
        return tuple(self._entries)

    def check(self, name: str) -> str:
        """`name` if registered; otherwise ValueError listing the registered names."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self._entries)}")
        return name

    def entry(self, name: str) -> Entry[F]:
        return self._entries[self.check(name)]

    def load(self, name: str) -> F:
        """The factory registered as `name`, imported now if it was registered by path."""
        return self.entry(name).load()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[F]]:
        return iter(list(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"

    def __copy__(self) -> Registry[F]:
        return self

    def __deepcopy__(self, memo: dict) -> Registry[F]:
        return self

    # -- pydantic: `Annotated[str, REGISTRY]` is a string that must be a registered name ----------
    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> Any:
        result = handler(schema)
        result["enum"] = list(self._entries)
        return result
