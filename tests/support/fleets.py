"""Replica fleets started once and shared: the suite's time goes to process start-ups (~5 s a
replica on 2 cores), so tests that only read a fleet (send requests through proxies of their
own, push adapters under names of their own) share one, keyed by what they need: the model,
how many replicas, and their settings.

A test that kills, freezes or reconfigures a replica, or reads a replica's counters as
absolute values, starts its own with support.processes.start_generators instead: a shared
fleet carries what earlier modules did to it. At most `max_live` fleets live at once (the
least recently used is stopped first: memory is a budget too), and a fleet whose process has
exited is started afresh rather than handed out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest

from .processes import Service, start_generators, stop_all

FleetKey = tuple[str, int, tuple[str, ...]]


class Fleets:
    """Shared replica fleets by key, least recently used stopped beyond `max_live`."""

    def __init__(self, root: Path, max_live: int = 2) -> None:
        self.root = root
        self.max_live = max_live
        self.started = 0
        """Fleets started in this session (a shared fleet handed out again is not counted)."""
        self._live: OrderedDict[FleetKey, list[Service]] = OrderedDict()

    def replicas(self, model: Path, count: int, *args: str) -> list[Service]:
        """`count` replicas of `model` with support.processes.GENERATOR_ARGS and `args`, named
        `fleet<N>-<i>`; the same list for the same key while it lives and all its processes run."""
        key = (str(model), count, args)
        fleet = self._live.get(key)
        if fleet is not None and all(s.proc.poll() is None for s in fleet):
            self._live.move_to_end(key)
            return fleet
        if fleet is not None:
            stop_all(self._live.pop(key))
        while len(self._live) >= self.max_live:
            _, oldest = self._live.popitem(last=False)
            stop_all(oldest)
        self.started += 1
        prefix = f"fleet{self.started}"
        workdir = self.root / prefix
        workdir.mkdir(parents=True)
        fleet = start_generators(model, workdir, [f"{prefix}-{i}" for i in range(1, count + 1)], *args)
        self._live[key] = fleet
        return fleet

    def close(self) -> None:
        while self._live:
            stop_all(self._live.popitem()[1])


@pytest.fixture(scope="session")
def fleets(tmp_path_factory) -> Iterator[Fleets]:
    """The session's shared replica fleets (conftest.py registers this fixture)."""
    shared = Fleets(tmp_path_factory.mktemp("fleets"))
    try:
        yield shared
    finally:
        shared.close()
