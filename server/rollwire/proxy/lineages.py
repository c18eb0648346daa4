"""Lineages and unloads: what a client's adapter name means now, kept in the spool's folder
and shared by peer proxies.

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
- both maps are durable before the call that changed them answers (a peer's merge included):
  a change takes effect in memory at once (requests read it) and its caller then awaits
  `flush`, which writes the file atomically on a worker thread, never on the event loop
  (an fsync'd write took 20-60 ms on a busy disk here, 0.3 ms on an idle one, and TRL unloads a version on
  every weight sync);
  writes happen one at a time, each of the state as it is when it starts, so the file never
  goes back to an older state; the maps are reloaded at start; a damaged file is moved aside and logged,
  never fatal; a file written before stamps existed loads (its unloads get the lowest stamp);
- both are bounded: lineages by MAX_NAMES external names, unloads by the versions the fleet
  still holds (`prune`), MAX_UNLOADED marks per internal name (the lowest versions are
  forgotten first), MAX_NAMES internal names with marks and MAX_MARKS marks in all (an
  unload or a merge past it is refused, RESOURCE_EXHAUSTED) (audit A16).

Peer proxies share both (`shared` to send, `merge` to receive; publish/lineage_share.py carries them), and
any two proxies that saw the same changes hold the same map, whatever the order they came in:
- a generation only grows: a merge keeps the larger, so no peer can take a name back to an
  earlier lineage;
- each (internal name, version) an unload or a load touched carries a mark: unloaded or
  shown, with a stamp (time_ns, proxy id). A merge keeps, per version, the mark with the
  larger (time_ns, proxy id, unloaded); stamps come from a clock that never runs behind any
  stamp this proxy has seen, so a load made after seeing an unload always wins over it,
  whichever proxy's wall clock is behind. Marks are per version, not per name, so an unload of
  v1 on one proxy and of v2 on another both hold. A load of a version that carries no mark
  records none (loads are frequent; marks are for unloads): it counts only against unloads
  this proxy had seen;
- a merge checks everything before it changes anything (names, bounds, stamps no more than
  MAX_SKEW_NS ahead of this proxy's clock); a refused one leaves the map as it was;
- a new lineage is told to peers only once its first version is in theirs (`switch(...,
  shared=False)` then `release`): until then `shared` reports the name's earlier generation,
  so no peer routes NAME to a lineage it cannot serve yet.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from rollwire.common.errors import InvalidArgument, ResourceExhausted
from rollwire.common.manifest import QUALIFIED_RE
from rollwire.common.reasons import Reason
from rollwire.runtime.durable import write_atomic
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
FILE = ".lineages.json"
MAX_NAMES = 4096
"""External names with a lineage after their first (loads are admin calls; a bound all the
same), and internal names with unload marks."""
MAX_UNLOADED = 256
"""Marks (unloads, and loads since) remembered per internal name (the lowest versions are forgotten first)."""
MAX_MARKS = 32768
"""Marks kept in all (a map sent to a peer stays under 2 MiB, gRPC's limit being 8 MiB); the fleet
pruning marks of versions it no longer holds keeps real maps far below (a few per name)."""
MAX_GENERATION = 999_999_999
MAX_VERSION = (1 << 63) - 1
MAX_ORIGIN = 256
"""Longest proxy id a stamp may carry."""
MAX_SKEW_NS = 24 * 3600 * 10**9
"""How far ahead of this proxy's clock a peer's stamp may be: a stamp further ahead would win
every later conflict (a broken clock, or a hostile peer), so it is refused."""
_INTERNAL = re.compile(r"^(?P<name>.+)\.(?P<generation>[0-9]{1,9})$")


class Mark(NamedTuple):
    """What was last done to one version, and when: ordered by (at_ns, by, unloaded)."""

    at_ns: int
    by: str
    unloaded: bool


class Lineages:
    """External name -> current lineage, and the unloaded versions of each internal name."""

    def __init__(self, folder: Path, origin: str = "") -> None:
        self.path = folder / FILE
        self.origin = origin
        """This proxy's id, in the stamps of the marks it makes (set at start, app.py)."""
        self.revision = 0
        """Grows with every change (local or merged): a catch-up that sent the map sees one it missed."""
        self._generation: dict[str, int] = {}
        """External name -> its current lineage's generation (2 and up; absent = 1, the name itself)."""
        self._marks: dict[str, dict[int, Mark]] = {}
        """Internal name -> version -> its last unload or load."""
        self._unloaded: dict[str, frozenset[int]] = {}
        """Internal name -> the versions its marks say are unloaded (derived, read per request)."""
        self._held: dict[str, int] = {}
        """External name -> the generation peers may be told while a newer one's v1 is not in theirs yet."""
        self._clock = 0
        self._dirty = False
        """Changed in memory since the last write began (flush writes it)."""
        self._writing: asyncio.Lock | None = None
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
                "new name, or remove .lineages.json's entries for names no longer used (with every peer proxy stopped)",
                reason=Reason.SPOOL_FULL,
            )
        for generation in range(self._generation.get(name, 1) + 1, self._generation.get(name, 1) + 1000):
            candidate = internal_name(name, generation)
            if QUALIFIED_RE.fullmatch(candidate) and not taken(candidate):
                return candidate, generation
        raise InvalidArgument(
            f"adapter name {name!r} is too long to start a new lineage under (NAME.N must fit 64 characters); "
            "load the new run under a shorter name",
            reason=Reason.BAD_ADAPTER_NAME,
        )

    def switch(self, name: str, generation: int, shared: bool = True) -> None:
        """From now on `name` means its lineage `generation` (the caller awaits `flush`). With
        `shared` False peers are told the earlier generation until `release(name, generation)`."""
        before = self._generation.get(name, 1)
        if generation <= before:
            return  # a peer's merge moved it on meanwhile: generations never go back
        self._generation[name] = generation
        if not shared:
            self._held.setdefault(name, before)
        self._save()
        log.info("adapter_lineage_started", name=name, internal=self.internal(name))

    def release(self, name: str, generation: int) -> None:
        """Lineage `generation` of `name` may be told to peers now (its first version is in theirs)."""
        if name not in self._held:
            return
        if generation >= self._generation.get(name, 1):
            del self._held[name]
        else:
            self._held[name] = max(self._held[name], generation)
        self.revision += 1

    # -- unloads ------------------------------------------------------------------------------
    def unloaded(self, internal: str) -> frozenset[int]:
        return self._unloaded.get(internal, frozenset())

    def unload(self, internal: str, versions: Iterable[int]) -> None:
        """Unload `versions` of `internal`, stamped now (the caller awaits `flush`);
        RESOURCE_EXHAUSTED past MAX_MARKS (nothing changed then)."""
        versions = set(versions)
        if self._count() + len(versions - set(self._marks.get(internal, {}))) > MAX_MARKS:
            raise ResourceExhausted(
                f"this proxy already keeps {MAX_MARKS} unloads; load some unloaded versions again, or unload fewer "
                "(unloads of versions the fleet no longer holds are forgotten by themselves)",
                reason=Reason.SPOOL_FULL,
            )
        mark = Mark(self._tick(), self.origin, True)
        marks = self._marks.setdefault(internal, {})
        for version in versions:
            marks[version] = mark
        self._changed(internal)
        self._save()

    def show(self, internal: str, version: int) -> bool:
        """A version loaded again is served again (a mark stamped now; the caller awaits
        `flush`); True when that changed something, so peers are told."""
        mark = self._marks.get(internal, {}).get(version)
        if mark is None or not mark.unloaded:
            return False
        self._marks[internal][version] = Mark(self._tick(), self.origin, False)
        self._changed(internal)
        self._save()
        return True

    def prune(self, holds: Callable[[str, int], bool]) -> None:
        """Forget marks of versions the fleet no longer holds (nothing could serve them)."""
        changed = False
        for internal in list(self._marks):
            gone = [v for v in self._marks[internal] if not holds(internal, v)]
            for version in gone:
                del self._marks[internal][version]
            if gone:
                changed = True
                self._changed(internal)
        if changed:
            self._save()

    def _count(self) -> int:
        return sum(len(m) for m in self._marks.values())

    def _tick(self) -> int:
        """A stamp's time: now, or just after every stamp seen, whichever is later."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _changed(self, internal: str) -> None:
        """Bound `internal`'s marks and recompute its unloaded versions."""
        marks = self._marks.get(internal, {})
        for version in sorted(marks)[: max(0, len(marks) - MAX_UNLOADED)]:
            del marks[version]
        unloaded = frozenset(v for v, m in marks.items() if m.unloaded)
        if not marks:
            self._marks.pop(internal, None)
        if unloaded:
            self._unloaded[internal] = unloaded
        else:
            self._unloaded.pop(internal, None)
        self.revision += 1

    # -- peers --------------------------------------------------------------------------------
    def shared(self) -> tuple[dict[str, int], dict[str, dict[int, Mark]]]:
        """What peers are told: every name's generation (a new lineage only once released) and
        every mark. Merging it into a peer's map makes that peer hold at least this."""
        generations = {n: self._held.get(n, g) for n, g in sorted(self._generation.items())}
        generations = {n: g for n, g in generations.items() if g >= 2}
        return generations, {n: dict(sorted(m.items())) for n, m in sorted(self._marks.items())}

    def merge(self, generations: Mapping[str, int], marks: Mapping[str, Mapping[int, Mark]], peer: str = "") -> int:
        """Take a peer's map in: the larger generation per name, the later mark per version.
        Everything is checked first (INVALID_ARGUMENT, RESOURCE_EXHAUSTED; nothing changed then);
        the caller awaits `flush` before it answers. Returns how many names and versions changed here."""
        _check_generations(generations)
        newest = _check_marks(marks, self._clock_now() + MAX_SKEW_NS)
        added = {n for n in generations if n not in self._generation}
        if len(self._generation) + len(added) > MAX_NAMES:
            raise ResourceExhausted(
                f"a peer's lineages would take this proxy past {MAX_NAMES} adapter names that started again at v1; "
                "remove .lineages.json's entries for names no longer used (with every peer proxy stopped)",
                reason=Reason.SPOOL_FULL,
            )
        names = set(self._marks) | set(marks)
        total = sum(min(MAX_UNLOADED, len(set(self._marks.get(n, {})) | set(marks.get(n, {})))) for n in names)
        if len(names) > MAX_NAMES or total > MAX_MARKS:
            raise ResourceExhausted(
                f"a peer's unloads would take this proxy past {MAX_NAMES} adapter names with unloaded versions or "
                f"{MAX_MARKS} unloads in all; load unloaded versions again, or let the fleet drop them",
                reason=Reason.SPOOL_FULL,
            )
        changed = 0
        for name, generation in generations.items():
            if generation > self._generation.get(name, 1):
                self._generation[name] = generation
                self._held.pop(name, None)  # the peers know a newer one already
                changed += 1
        for internal, theirs in marks.items():
            ours = self._marks.get(internal, {})
            taken = {v: mark for v, mark in theirs.items() if v not in ours or mark > ours[v]}
            if taken:
                self._marks[internal] = ours | taken
                self._changed(internal)  # bounded again: the lowest versions go, on every proxy alike
                changed += sum(1 for v in taken if v in self._marks.get(internal, {}))
        self._clock = max(self._clock, newest)
        if changed:
            self._save()
            log.info("adapter_lineages_merged", peer=peer, changed=changed)
        return changed

    def _clock_now(self) -> int:
        return max(time.time_ns(), self._clock)

    # -- the file -----------------------------------------------------------------------------
    def _save(self) -> None:
        """Note a change: the caller awaits `flush` before it answers."""
        self._dirty = True

    async def flush(self) -> None:
        """Return once every change made so far is on disk (written off the event loop). A
        failed write raises (the change stays in memory and is written by the next flush)."""
        if self._writing is None:
            self._writing = asyncio.Lock()
        async with self._writing:
            if not self._dirty:
                return  # a write that began after the caller's change has covered it
            self._dirty, body = False, self._encode()
            try:
                await asyncio.to_thread(write_atomic, self.path, body)
            except BaseException:
                self._dirty = True
                raise

    def flush_now(self) -> None:
        """The same, from code that runs no event loop (start-up tools and tests)."""
        if self._dirty:
            self._dirty = False
            write_atomic(self.path, self._encode())

    def _encode(self) -> bytes:
        body = {
            "lineages": dict(sorted(self._generation.items())),
            "unloaded": {n: sorted(v) for n, v in sorted(self._unloaded.items())},
            "marks": {
                n: {str(v): {"unloaded": m.unloaded, "at_ns": m.at_ns, "by": m.by} for v, m in sorted(ms.items())}
                for n, ms in sorted(self._marks.items())
            },
        }
        return json.dumps(body, indent=1).encode()

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            body = json.loads(self.path.read_text())
            generations = {str(k): int(v) for k, v in body.get("lineages", {}).items()}
            marks = {
                str(n): {int(v): Mark(int(m["at_ns"]), str(m["by"]), bool(m["unloaded"])) for v, m in ms.items()}
                for n, ms in body.get("marks", {}).items()
            }
            for name, versions in body.get("unloaded", {}).items():  # a file from before marks: the lowest stamp
                for version in versions:
                    marks.setdefault(str(name), {}).setdefault(int(version), Mark(0, "", True))
            if any(g < 2 for g in generations.values()):
                raise ValueError("a lineage generation below 2")
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
            aside = self.path.with_name(f"{FILE}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
            os.replace(self.path, aside)
            log.error("adapter_lineages_unreadable", file=str(self.path), moved_to=str(aside), error=str(exc)[:300])
            return
        self._generation, self._marks = generations, marks
        for internal in list(marks):
            self._changed(internal)
        self._clock = max((m.at_ns for ms in marks.values() for m in ms.values()), default=0)


def internal_name(name: str, generation: int) -> str:
    return f"{name}.{generation}"


def _check_generations(generations: Mapping[str, int]) -> None:
    if len(generations) > MAX_NAMES:
        raise InvalidArgument(
            f"a peer sent {len(generations)} lineages; at most {MAX_NAMES} are kept",
            reason=Reason.BAD_LINEAGES,
        )
    for name, generation in generations.items():
        if not isinstance(name, str) or not QUALIFIED_RE.fullmatch(name):
            raise InvalidArgument(
                f"a peer sent the lineage of an invalid name {str(name)[:80]!r}", reason=Reason.BAD_LINEAGES
            )
        if not isinstance(generation, int) or not 2 <= generation <= MAX_GENERATION:
            raise InvalidArgument(
                f"a peer sent generation {generation!r} for {name!r}; generations are 2 to {MAX_GENERATION}",
                reason=Reason.BAD_LINEAGES,
            )
        if not QUALIFIED_RE.fullmatch(internal_name(name, generation)):
            raise InvalidArgument(
                f"a peer sent generation {generation} for {name!r}, whose internal name does not fit a name",
                reason=Reason.BAD_LINEAGES,
            )


def _check_marks(marks: Mapping[str, Mapping[int, Mark]], latest_ns: int) -> int:
    """Check a peer's marks; the newest stamp's time among them."""
    if len(marks) > MAX_NAMES:
        raise InvalidArgument(
            f"a peer sent unloads of {len(marks)} names; at most {MAX_NAMES} are kept", reason=Reason.BAD_LINEAGES
        )
    newest = 0
    for name, versions in marks.items():
        if not isinstance(name, str) or not QUALIFIED_RE.fullmatch(name):
            raise InvalidArgument(
                f"a peer sent unloads of an invalid name {str(name)[:80]!r}", reason=Reason.BAD_LINEAGES
            )
        if len(versions) > MAX_UNLOADED:
            raise InvalidArgument(
                f"a peer sent {len(versions)} unloads of {name!r}; at most {MAX_UNLOADED} are kept per name",
                reason=Reason.BAD_LINEAGES,
            )
        for version, mark in versions.items():
            if not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
                raise InvalidArgument(f"a peer sent an unload of {name!r} v{version!r}", reason=Reason.BAD_LINEAGES)
            if not isinstance(mark.by, str) or len(mark.by) > MAX_ORIGIN or not mark.by.isprintable():
                raise InvalidArgument(
                    f"a peer sent an unload of {name!r} v{version} stamped by an invalid proxy id",
                    reason=Reason.BAD_LINEAGES,
                )
            if not isinstance(mark.at_ns, int) or not 0 <= mark.at_ns <= latest_ns:
                raise InvalidArgument(
                    f"a peer sent an unload of {name!r} v{version} stamped {mark.at_ns!r} ns, more than a day ahead of "
                    "this proxy's clock; synchronise the proxies' clocks (NTP)",
                    reason=Reason.BAD_LINEAGES,
                )
            newest = max(newest, mark.at_ns)
    return newest
