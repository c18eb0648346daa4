"""The door's /pause per tenant (http/pause.py) and its pacing of a lineage's samples per version
(http/pacing.py), as pure logic on an event loop: what a pause holds and for how long, and how
many samples a lineage may start between two loads, against counts computed here.
Their behaviour through a real door is tests/integration/proxy/test_door_pacing_live.py."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time

import pytest

from rollwire.common.errors import DeadlineExceeded
from rollwire.common.reasons import Reason
from rollwire.proxy.http.pacing import MAX_LINEAGES, Pacing
from rollwire.proxy.http.pause import Pauses

FAR = 3600.0


async def _turns(n: int = 5) -> None:
    """Let the other tasks run until they block (no time passes)."""
    for _ in range(n):
        await asyncio.sleep(0)


# -- /pause ------------------------------------------------------------------------------------


async def test_a_pause_holds_its_own_tenant_until_resume_and_no_other():
    pauses = Pauses(max_s=FAR)
    await pauses.pause("team-a", "keep")
    assert pauses.paused("team-a") and not pauses.paused("team-b")
    await asyncio.wait_for(pauses.hold("team-b", time.monotonic() + FAR), 1)  # another tenant: at once
    held = asyncio.ensure_future(pauses.hold("team-a", time.monotonic() + FAR))
    await _turns()
    assert not held.done()
    pauses.resume("team-a")
    await asyncio.wait_for(held, 1)
    assert not pauses.paused("team-a")
    assert pauses._tenants == {}  # nothing kept once nothing is paused or running


async def test_a_pause_lapses_by_itself_after_pause_max_s():
    pauses = Pauses(max_s=0.05)
    await pauses.pause("team-a", "keep")
    started = time.monotonic()
    await asyncio.wait_for(pauses.hold("team-a", time.monotonic() + FAR), 2)
    assert time.monotonic() - started >= 0.05
    assert not pauses.paused("team-a")


async def test_a_held_request_fails_at_its_own_deadline_saying_why():
    pauses = Pauses(max_s=FAR)
    await pauses.pause("team-a", "abort")
    with pytest.raises(DeadlineExceeded) as refused:
        await asyncio.wait_for(pauses.hold("team-a", time.monotonic() + 0.05), 2)
    assert refused.value.reason == Reason.PAUSED and "/resume" in refused.value.message
    assert pauses.paused("team-a")  # the pause itself goes on


async def test_a_pause_in_mode_wait_returns_once_the_tenants_requests_in_flight_end():
    pauses = Pauses(max_s=FAR)
    with pauses.running("team-a"), pauses.running("team-b"):
        waiting = asyncio.ensure_future(pauses.pause("team-a", "wait"))
        keeping = asyncio.ensure_future(pauses.pause("team-b", "keep"))
        await _turns()
        assert keeping.done() and not waiting.done()
    await asyncio.wait_for(waiting, 1)


# -- pacing ------------------------------------------------------------------------------------


class Trainer:
    """TRL's sync as the door sees it: load vN, then unload v(N - window) once there is one."""

    def __init__(self, pacing: Pacing, name: str = "trl-policy", window: int = 5) -> None:
        self.pacing, self.name, self.window, self.version = pacing, name, window, 0

    def sync(self) -> None:
        self.version += 1
        self.pacing.loaded(self.name, self.version)
        if self.version > self.window:
            self.pacing.unloaded(self.name, self.version - self.window)


async def _request(pacing: Pacing, name: str, n: int, started: list, release: asyncio.Event) -> None:
    """One request: counted once the door lets it start, in flight until `release`."""
    async with pacing.paced(name, n, time.monotonic() + FAR):
        started.append(n)
        await release.wait()


async def test_a_lineage_is_unpaced_until_an_unload_shows_its_window():
    pacing = Pacing(factor=1.0, hold_max_s=FAR)
    trainer, started, release = Trainer(pacing), [], asyncio.Event()
    for _ in range(5):  # five loads, no unload yet
        trainer.sync()
    tasks = [asyncio.ensure_future(_request(pacing, "trl-policy", 1, started, release)) for _ in range(64)]
    await _turns()
    assert len(started) == 64 and pacing.budget("trl-policy") is None
    release.set()
    await asyncio.gather(*tasks)


async def test_a_load_lets_exactly_the_budget_go_however_many_wait():
    """A client keeping `in_flight` requests open over a window of W versions may start
    ceil(factor * in_flight / (W - 1)) samples per version; the rest wait for the next loads."""
    factor, window, in_flight = 1.25, 5, 32
    pacing = Pacing(factor=factor, hold_max_s=FAR)
    trainer, started, release = Trainer(pacing, window=window), [], asyncio.Event()
    for _ in range(window + 1):
        trainer.sync()  # the last one unloads v1: window 5
    tasks = [asyncio.ensure_future(_request(pacing, "trl-policy", 1, started, release)) for _ in range(in_flight)]
    await _turns()
    trainer.sync()  # the peak in flight is counted at a load
    budget = math.ceil(factor * in_flight / (window - 1))
    assert pacing.budget("trl-policy") == budget == 10
    await _turns()
    assert len(started) == in_flight  # they came before the budget was known: none held
    release.set()
    await asyncio.gather(*tasks)
    release, started = asyncio.Event(), []
    tasks = [asyncio.ensure_future(_request(pacing, "trl-policy", 1, started, release)) for _ in range(in_flight)]
    await _turns()
    assert len(started) == budget  # this version's budget, the others held
    for load in range(1, 3):
        trainer.sync()
        await _turns()
        assert len(started) == budget * (load + 1)  # a load lets one budget go, not every waiter
    release.set()
    trainer.sync()
    trainer.sync()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)


async def test_a_held_request_starts_after_hold_max_s_without_a_load():
    pacing = Pacing(factor=1.0, hold_max_s=0.05)
    trainer, started, release = Trainer(pacing, window=2), [], asyncio.Event()
    for _ in range(3):
        trainer.sync()
    first = [asyncio.ensure_future(_request(pacing, "trl-policy", 1, started, release)) for _ in range(4)]
    await _turns()
    trainer.sync()  # peak 4 over a window of 2: a budget of 4 samples per version
    assert pacing.budget("trl-policy") == 4
    release.set()
    await asyncio.gather(*first)
    release, started = asyncio.Event(), []
    clock = time.monotonic()
    tasks = [asyncio.ensure_future(_request(pacing, "trl-policy", 1, started, release)) for _ in range(6)]
    await _turns()
    assert len(started) == 4
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)  # no load came: the two held ones went at hold_max_s
    assert len(started) == 6 and time.monotonic() - clock >= 0.05


async def test_other_names_and_the_base_model_are_never_held():
    pacing = Pacing(factor=1.0, hold_max_s=FAR)
    trainer, release = Trainer(pacing, window=2), asyncio.Event()
    for _ in range(3):
        trainer.sync()
    tasks = [asyncio.ensure_future(_request(pacing, "trl-policy", 1, [], release)) for _ in range(2)]
    await _turns()
    trainer.sync()  # budget 2 per version
    release.set()
    await asyncio.gather(*tasks)
    hold, mine, others = asyncio.Event(), [], []
    paced = [asyncio.ensure_future(_request(pacing, "trl-policy", 1, mine, hold)) for _ in range(3)]
    free = [asyncio.ensure_future(_request(pacing, name, 1, others, hold)) for name in ("", "team-b:other", "x") * 5]
    await _turns()
    assert len(mine) == 2 and len(others) == 15  # the lineage's third waits; nothing else does
    hold.set()
    trainer.sync()
    await asyncio.wait_for(asyncio.gather(*paced, *free), 2)


async def test_one_request_always_starts_after_a_load_whatever_its_n():
    pacing = Pacing(factor=1.0, hold_max_s=FAR)
    trainer, release = Trainer(pacing, window=2), asyncio.Event()
    for _ in range(3):
        trainer.sync()
    task = asyncio.ensure_future(_request(pacing, "trl-policy", 1, [], release))
    await _turns()
    trainer.sync()
    release.set()
    await task
    started: list[int] = []
    big = asyncio.ensure_future(_request(pacing, "trl-policy", 64, started, asyncio.Event()))
    await _turns()
    assert started == [64]  # n over the budget: alone, it still starts
    big.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await big


async def test_generated_syncs_never_start_more_than_the_budget_per_version():
    """Random n, random requests and loads: between two loads the started samples stay within
    the budget plus one request's n, and every request ends once loads come."""
    rng = random.Random(20261207)
    pacing = Pacing(factor=1.25, hold_max_s=FAR)
    trainer = Trainer(pacing, window=rng.randint(2, 8))
    release = asyncio.Event()
    warm = [asyncio.ensure_future(_request(pacing, "trl-policy", 1, [], release)) for _ in range(rng.randint(4, 40))]
    for _ in range(trainer.window + 1):
        trainer.sync()
        await _turns()
    release.set()
    await asyncio.gather(*warm)
    first = pacing.budget("trl-policy")
    assert first is not None
    tasks: list[asyncio.Future] = []
    started: list[int] = []
    for _ in range(30):
        mark = len(started)
        trainer.sync()
        budget = pacing.budget("trl-policy")
        assert budget is not None
        done = asyncio.Event()
        done.set()
        for _ in range(rng.randint(0, 3 * first)):
            tasks.append(asyncio.ensure_future(_request(pacing, "trl-policy", rng.choice((1, 1, 2, 4)), started, done)))
        await _turns(10)
        assert sum(started[mark:]) <= budget + 3  # the last one let in may pass it by its n - 1
    for _ in range(200):
        if all(t.done() for t in tasks):
            break
        trainer.sync()
        await _turns(10)
    assert all(t.done() for t in tasks)


def test_the_lineages_tracked_are_bounded():
    pacing = Pacing(factor=1.0, hold_max_s=FAR)
    for i in range(MAX_LINEAGES + 50):
        pacing.loaded(f"name-{i}", 1)
    assert len(pacing._lineages) == MAX_LINEAGES
    assert pacing.budget("name-0") is None and "name-0" not in pacing._lineages
