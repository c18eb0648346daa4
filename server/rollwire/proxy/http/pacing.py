"""Pacing a publisher's samples to what it can train on: no more samples of a lineage per version than it uses.

A trainer that loads its versions through the door (TRL's AsyncGRPOTrainer: load vN, unload
v(N-W)) trains on samples at most W-1 versions old and drops older ones. Its rollout worker
keeps a fixed number of requests in flight, sized for that window: TRL's is max_staleness x the
samples of one step, "the useful upper bound" in its own words. A server that answers them as
fast as it can, between loads, produces samples the trainer never uses: measured (docs/
benchmarks.md §12, 4 generations, batch 8) TRL dropped 8 of every 10 as stale through a door that
did not pace, and parsing, scoring and queueing them took its own core, while generating them
took the serving side's (which the next load then waited behind). One vLLM server on a CPU is
slow enough to waste less.

The rule: once a lineage (a tenant's adapter name) has shown its window W by an unload, its
requests may start at most `budget` = ceil(http.pacing_factor x C / (W - 1)) samples between one
load of it and the next, C being the most requests of it that were ever in flight at once (held
ones included: the client's own statement of how much it can use over W - 1 steps). A request
past the budget waits at the door for the lineage's next load, at most `http.pacing_hold_max_s`
(so a publisher whose steps do not need these samples is slowed, never stopped), and never past
its own deadline (then it goes on). `pacing_factor` 0 turns pacing off.

Invariants:
- only lineages that loaded and unloaded through this door are paced, each on its own: the
  base model, gRPC callers and every other name are never held here;
- every hold ends by the next load of its lineage, `pacing_hold_max_s`, or the request's deadline;
- the state is bounded: at most MAX_LINEAGES lineages are tracked (the one used longest ago is
  forgotten first, and then simply unpaced until it shows its window again);
- O(1) per request on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_LINEAGES = 1024


@dataclass
class _Lineage:
    newest: int = 0
    """The newest version loaded."""
    window: int = 0
    """W: newest - the version it unloaded at that load (0: not seen yet, unpaced)."""
    started: int = 0
    """Samples started since the last load."""
    in_flight: int = 0
    peak: int = 0
    """C: the most requests of it in flight at once, counted at its loads (never lowered: a client
    that keeps fewer in flight later is paced as loosely as before, never starved)."""
    peak_now: int = 0
    """The most in flight at once since the last load."""
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    """Replaced at every load; held requests wait on it."""

    def budget(self, factor: float) -> int | None:
        """Samples it may start per version (None: unpaced)."""
        if self.window < 2 or factor <= 0 or not self.peak:
            return None
        return max(1, math.ceil(factor * self.peak / (self.window - 1)))


class Pacing:
    """Each lineage's samples since its last load, on the proxy's event loop."""

    def __init__(self, factor: float, hold_max_s: float, held_counter=None) -> None:
        self.factor, self.hold_max_s = factor, hold_max_s
        self._lineages: OrderedDict[str, _Lineage] = OrderedDict()
        self._held = held_counter

    def _of(self, name: str, create: bool = True) -> _Lineage | None:
        lineage = self._lineages.get(name)
        if lineage is None and create:
            lineage = self._lineages[name] = _Lineage()
            while len(self._lineages) > MAX_LINEAGES:
                self._lineages.popitem(last=False)
        if lineage is not None:
            self._lineages.move_to_end(name)
        return lineage

    def loaded(self, name: str, version: int) -> None:
        """A load of `name`'s `version` answered: the budget starts again, held requests go."""
        lineage = self._of(name)
        assert lineage is not None
        lineage.newest = max(lineage.newest, version)
        lineage.started = 0
        lineage.peak = max(lineage.peak, lineage.peak_now, lineage.in_flight)
        lineage.peak_now = lineage.in_flight
        lineage.loaded.set()
        lineage.loaded = asyncio.Event()

    def unloaded(self, name: str, version: int) -> None:
        """An unload of `name`'s `version`: the distance to its newest is its window."""
        lineage = self._of(name, create=False)
        if lineage is not None and 0 < version < lineage.newest:
            lineage.window = lineage.newest - version

    def budget(self, name: str) -> int | None:
        lineage = self._lineages.get(name)
        return lineage.budget(self.factor) if lineage is not None else None

    @contextlib.asynccontextmanager
    async def paced(self, name: str, samples: int, deadline: float):
        """Around one request of `samples` samples of adapter `name` ("" for the base model):
        waits while its lineage is past its budget (module docstring), then counts it."""
        lineage = self._of(name, create=False) if name else None
        if lineage is None:
            yield
            return
        lineage.in_flight += 1
        lineage.peak_now = max(lineage.peak_now, lineage.in_flight)
        try:
            if self._over(lineage, samples):
                await self._hold(lineage, samples, deadline)
            lineage.started += samples
            yield
        finally:
            lineage.in_flight -= 1

    def _over(self, lineage: _Lineage, samples: int) -> bool:
        """Would `samples` more pass the budget? One request always starts after a load, whatever its n."""
        budget = lineage.budget(self.factor)
        return budget is not None and lineage.started > 0 and lineage.started + samples > budget

    async def _hold(self, lineage: _Lineage, samples: int, deadline: float) -> None:
        """Until a load leaves budget for it (the requests a load wakes check again, in the order
        they came: a load lets `budget` samples go, not all that waited), or the hold's end."""
        if self._held is not None:
            self._held.inc()
        until = min(time.monotonic() + self.hold_max_s, deadline)
        while self._over(lineage, samples):
            wait_s = until - time.monotonic()
            if wait_s <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lineage.loaded.wait(), wait_s)
