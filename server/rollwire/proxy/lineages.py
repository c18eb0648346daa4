"""Lineages and unloads: what a client's adapter name means now, kept in the spool's folder.

A client names adapters by an external name (TRL's `trl-policy`); replicas serve internal
names, which only ever grow their versions. A lineage is one run of versions under one
external name: the first is served under the name itself, each later one under `NAME.G`
(G = 2, 3, ...), a name no replica has seen, so a second run may start again at v1.

Invariants:
- an external name maps to exactly one lineage (its current one) for both doors: a gRPC
  Generate or PushAdapter naming NAME reaches NAME's current lineage (failover.resolve,
  fanout.FanOut.push); an earlier lineage is never served under NAME again;
- a version unloaded through the door is never served by name, by "latest" or a bare name,
  listed by /v1/models or GetStatus, until it is loaded again (the same bytes);
- both maps are durable (written atomically before the call that changed them answers) and
  reloaded at start; a damaged file is moved aside and logged, never fatal;
- both are bounded: lineages by MAX_NAMES external names, unloads by the versions the fleet
  still holds (`prune`) and MAX_UNLOADED per name (audit A16).
Peer proxies do not share this file: see docs/http.md ("Runs that restart their names").
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from rollwire.common.errors import InvalidArgument, ResourceExhausted
from rollwire.common.manifest import NAME_RE
from rollwire.common.reasons import Reason
from rollwire.runtime.durable import write_atomic
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
FILE = ".lineages.json"
MAX_NAMES = 4096
"""External names with a lineage after their first (loads are admin calls; a bound all the same)."""
MAX_UNLOADED = 256
"""Unloaded versions remembered per internal name (the oldest are forgotten first)."""
_INTERNAL = re.compile(r"^(?P<name>.+)\.(?P<generation>[0-9]{1,9})$")


class Lineages:
    """External name -> current lineage, and the unloaded versions of each internal name."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / FILE
        self._generation: dict[str, int] = {}
        """External name -> its current lineage's generation (2 and up; absent = 1, the name itself)."""
        self._unloaded: dict[str, set[int]] = {}
        self._load()

    # -- names --------------------------------------------------------------------------------
    def internal(self, name: str) -> str:
        """The internal name `name` is served under now (itself unless it started a lineage)."""
        generation = self._generation.get(name, 1)
        return name if generation == 1 else internal_name(name, generation)

    def external(self, internal: str) -> str | None:
        """The name a client knows `internal` by; None for an earlier lineage (served under no name)."""
        if internal in self._generation:
            return None  # the name's first lineage, replaced
        match = _INTERNAL.fullmatch(internal)
        if match and match["name"] in self._generation:
            return match["name"] if int(match["generation"]) == self._generation[match["name"]] else None
        return internal

    def reserved(self, name: str) -> bool:
        """Is `name` some external name's lineage (a client may not load under it)?"""
        match = _INTERNAL.fullmatch(name)
        return bool(match and match["name"] in self._generation)

    def next_lineage(self, name: str, taken: Callable[[str], bool]) -> tuple[str, int]:
        """(internal name, generation) of `name`'s next lineage: a valid name `taken` says no
        replica or spool has seen; RESOURCE_EXHAUSTED when none fits or the map is full."""
        if name not in self._generation and len(self._generation) >= MAX_NAMES:
            raise ResourceExhausted(
                f"this proxy already keeps {MAX_NAMES} adapter names that started again at v1; load {name!r} under a "
                "new name, or remove .lineages.json's entries for names no longer used (with the proxy stopped)",
                reason=Reason.SPOOL_FULL,
            )
        for generation in range(self._generation.get(name, 1) + 1, self._generation.get(name, 1) + 1000):
            candidate = internal_name(name, generation)
            if NAME_RE.fullmatch(candidate) and not taken(candidate):
                return candidate, generation
        raise InvalidArgument(
            f"adapter name {name!r} is too long to start a new lineage under (NAME.N must fit 64 characters); "
            "load the new run under a shorter name",
            reason=Reason.BAD_ADAPTER_NAME,
        )

    def switch(self, name: str, generation: int) -> None:
        """From now on `name` means its lineage `generation` (durable before it returns)."""
        self._generation[name] = generation
        self._save()
        log.info("adapter_lineage_started", name=name, internal=self.internal(name))

    # -- unloads ------------------------------------------------------------------------------
    def unloaded(self, internal: str) -> frozenset[int]:
        return frozenset(self._unloaded.get(internal, ()))

    def unload(self, internal: str, versions: Iterable[int]) -> None:
        held = self._unloaded.setdefault(internal, set())
        held.update(versions)
        for old in sorted(held)[: max(0, len(held) - MAX_UNLOADED)]:
            held.discard(old)
        self._save()

    def show(self, internal: str, version: int) -> None:
        """A version loaded again is served again."""
        held = self._unloaded.get(internal)
        if held and version in held:
            held.discard(version)
            if not held:
                del self._unloaded[internal]
            self._save()

    def prune(self, holds: Callable[[str, int], bool]) -> None:
        """Forget unloads of versions the fleet no longer holds (nothing could serve them)."""
        changed = False
        for internal in list(self._unloaded):
            kept = {v for v in self._unloaded[internal] if holds(internal, v)}
            if kept != self._unloaded[internal]:
                changed = True
                if kept:
                    self._unloaded[internal] = kept
                else:
                    del self._unloaded[internal]
        if changed:
            self._save()

    # -- the file -----------------------------------------------------------------------------
    def _save(self) -> None:
        body = {
            "lineages": dict(sorted(self._generation.items())),
            "unloaded": {n: sorted(v) for n, v in sorted(self._unloaded.items())},
        }
        write_atomic(self.path, json.dumps(body, indent=1).encode())

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            body = json.loads(self.path.read_text())
            generations = {str(k): int(v) for k, v in body.get("lineages", {}).items()}
            unloaded = {str(k): {int(x) for x in v} for k, v in body.get("unloaded", {}).items()}
            if any(g < 2 for g in generations.values()):
                raise ValueError("a lineage generation below 2")
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            aside = self.path.with_name(f"{FILE}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
            os.replace(self.path, aside)
            log.error("adapter_lineages_unreadable", file=str(self.path), moved_to=str(aside), error=str(exc)[:300])
            return
        self._generation, self._unloaded = generations, unloaded


def internal_name(name: str, generation: int) -> str:
    return f"{name}.{generation}"
