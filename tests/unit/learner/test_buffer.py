"""The staleness filter, zero-variance handling and the group ledger."""

from __future__ import annotations

import asyncio

import pytest

from rollwire.learner.rollouts.admission import split_stale, staleness
from rollwire.learner.rollouts.buffer import Buffer, GroupLedger, LedgerError, Signal
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.tasks.task import Example


def group(versions: list[list[int]], rewards: list[float], gid: int = 0) -> ScoredGroup:
    samples = [
        ScoredSample([5] * len(v), [-0.5] * len(v), v, "x", "eos", r, r > 0)
        for v, r in zip(versions, rewards, strict=False)
    ]
    return ScoredGroup(Example(gid, "p", "a"), [1, 2], samples, adapter_version=min(min(v) for v in versions if v))


def test_staleness_counts_from_the_oldest_token_of_any_sample():
    g = group([[4, 4, 5], [5, 5]], [1, 0])  # a sample that spans versions 4 and 5
    assert g.min_version == 4
    assert staleness(g, 5) == 1
    assert staleness(g, 7) == 3


def test_split_stale_keeps_order_and_the_boundary():
    gs = [group([[v]], [1, 0], gid=v) for v in (3, 1, 4, 2)]
    fresh, stale = split_stale(gs, version=4, max_staleness=2)
    assert [g.example.id for g in fresh] == [3, 4, 2]  # staleness 1, 0, 2 are allowed
    assert [g.example.id for g in stale] == [1]


def filled(max_staleness=1, keep_zero_variance=False, groups=()):
    ledger = GroupLedger()
    buf = Buffer(max_staleness, keep_zero_variance, ledger)
    for g in groups:
        ledger.request()
        ledger.generated()
        buf.put(g)
    return buf, ledger


async def test_take_never_returns_a_group_staler_than_allowed():
    gs = [group([[1], [1]], [1, 0], 1), group([[2], [2]], [1, 0], 2), group([[3], [3]], [0, 1], 3)]
    buf, ledger = filled(max_staleness=1, groups=gs)
    batch = await buf.take(2, version=3)
    assert [g.example.id for g in batch] == [2, 3]
    assert all(staleness(g, 3) <= 1 for g in batch)
    assert ledger.dropped == {"stale": 1}
    assert buf.next_train_version == 4
    ledger.check(idle=True)


async def test_take_waits_for_enough_fresh_groups():
    buf, ledger = filled(max_staleness=0)
    waiting = asyncio.ensure_future(buf.take(2, version=5))
    for gid, v in ((1, 4), (2, 5), (3, 5)):
        ledger.request()
        await asyncio.sleep(0)
        assert not waiting.done()
        ledger.generated()
        buf.put(group([[v], [v]], [1, 0], gid))
    batch = await asyncio.wait_for(waiting, 1)
    assert [g.example.id for g in batch] == [2, 3]
    assert ledger.snapshot() == {"requested": 3, "in_flight": 0, "buffered": 0, "trained": 2, "dropped": {"stale": 1}}


@pytest.mark.parametrize("keep", [False, True])
def test_zero_variance_groups_are_dropped_or_kept_as_configured(keep):
    buf, ledger = filled(keep_zero_variance=keep, groups=[group([[1], [1]], [1, 1]), group([[1], [1]], [0, 1])])
    assert len(buf) == (2 if keep else 1)
    assert ledger.dropped == ({} if keep else {"zero_variance": 1})
    ledger.check()


def test_drain_counts_what_is_left():
    buf, ledger = filled(groups=[group([[1], [1]], [0, 1]), group([[1], [1]], [1, 0])])
    assert buf.drain("shutdown") == 2
    assert ledger.dropped == {"shutdown": 2}
    ledger.check(idle=True)


def test_ledger_refuses_to_lose_a_group():
    ledger = GroupLedger()
    ledger.request()
    ledger.generated()  # ended, but neither buffered nor dropped
    with pytest.raises(LedgerError, match="does not add up"):
        ledger.check()
    ledger.drop("refused")
    ledger.check(idle=True)


def test_ledger_observers_see_every_outcome():
    seen = []
    _buf, ledger = filled()
    ledger.observers.append(lambda event, reason, n: seen.append((event, reason, n)))
    ledger.request()
    ledger.generated()
    ledger.drop("reward_error")
    assert seen == [("requested", "", 1), ("dropped", "reward_error", 1)]


async def test_signal_wakes_every_waiter_after_synchronous_changes():
    signal, state = Signal(), {"n": 0}
    waiters = [asyncio.ensure_future(signal.wait_for(lambda k=k: state["n"] >= k)) for k in (1, 2, 3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    for _ in range(3):  # three changes from synchronous code, folded into one wake-up
        state["n"] += 1
        signal.notify()
    await asyncio.wait_for(asyncio.gather(*waiters), 1)


async def test_signal_a_true_predicate_returns_at_once_and_a_cancelled_waiter_blocks_nobody():
    signal, state = Signal(), {"ready": False}
    await asyncio.wait_for(signal.wait_for(lambda: True), 1)  # no notification needed
    cancelled = asyncio.ensure_future(signal.wait_for(lambda: state["ready"]))
    other = asyncio.ensure_future(signal.wait_for(lambda: state["ready"]))
    await asyncio.sleep(0)
    cancelled.cancel()
    state["ready"] = True
    signal.notify()
    await asyncio.wait_for(other, 1)
    assert cancelled.cancelled()


def test_signal_without_a_running_loop_has_nobody_to_wake():
    Signal().notify()  # e.g. a ledger counted outside the event loop: nothing to do, no error
