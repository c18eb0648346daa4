"""rollwire.runtime.waits: a bounded wait that never swallows its caller's cancellation."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rollwire.runtime.waits import wait_at_most


async def _cancel_as_the_wait_ends(bounded_wait) -> tuple[bool, int]:
    """The monitors' shape (wait for a wake-up or an interval, do a round, repeat), woken and
    cancelled in the same turn of the event loop; (the task ended, rounds it ran)."""
    wake, waiting, rounds = asyncio.Event(), asyncio.Event(), []

    async def monitor() -> None:
        while True:
            waiting.set()
            await bounded_wait(wake.wait(), 30.0)
            rounds.append(1)
            wake.clear()

    task = asyncio.create_task(monitor())
    await waiting.wait()  # the monitor is suspended in its wait
    wake.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return bool(done), len(rounds)


async def test_a_cancellation_that_arrives_as_the_wait_ends_stops_the_loop():
    assert await _cancel_as_the_wait_ends(wait_at_most) == (True, 0)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12 rebuilt wait_for on asyncio.timeout")
async def test_the_same_loop_on_wait_for_swallows_it_on_python_3_11():
    """Why the module exists: on asyncio.wait_for the loop runs another round and waits again,
    so its task outlives the cancel."""
    assert await _cancel_as_the_wait_ends(asyncio.wait_for) == (False, 1)


async def test_it_reports_whether_the_wait_finished_in_time():
    done = asyncio.Event()
    done.set()
    assert await wait_at_most(done.wait(), 1.0)
    assert not await wait_at_most(asyncio.Event().wait(), 0.01)
    assert not await wait_at_most(asyncio.Event().wait(), -5.0)  # a limit already passed: one look
