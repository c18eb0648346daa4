"""Admission: which requests may start, which groups enter the buffer, and that an admitted
group is never thrown away as stale in an idealised run."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from rollwire.learner.rollouts.admission import buffer_refusal, may_request
from rollwire.learner.rollouts.buffer import Buffer, GroupLedger
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.tasks.task import Example


def group(version: int, rewards: tuple[float, ...] = (1.0, 0.0)) -> ScoredGroup:
    samples = [ScoredSample([5], [-0.5], [version], "x", "eos", r, r > 0) for r in rewards]
    return ScoredGroup(Example(0, "p", "a"), [1], samples, adapter_version=version)


def admitted_back_to_back(served: int, next_train_version: int, groups_per_step: int, max_staleness: int) -> int:
    pending = 0
    while may_request(
        served=served,
        next_train_version=next_train_version,
        pending=pending,
        groups_per_step=groups_per_step,
        max_staleness=max_staleness,
    ):
        pending += 1
    return pending


@pytest.mark.parametrize(("groups_per_step", "max_staleness"), [(1, 0), (4, 0), (2, 1), (3, 2)])
def test_with_the_newest_weights_served_the_producer_runs_max_staleness_batches_ahead(groups_per_step, max_staleness):
    # the batch being filled plus max_staleness more, each of groups_per_step groups
    assert admitted_back_to_back(7, 7, groups_per_step, max_staleness) == (max_staleness + 1) * groups_per_step


def test_sync_mode_requests_nothing_until_the_last_step_is_served():
    # trained into v8, v8 not yet served: a group sampled at v7 would be one version stale
    assert admitted_back_to_back(served=7, next_train_version=8, groups_per_step=2, max_staleness=0) == 0
    # one version behind is allowed at max_staleness 1, for one batch only
    assert admitted_back_to_back(served=7, next_train_version=8, groups_per_step=2, max_staleness=1) == 2


def test_zero_variance_groups_are_refused_unless_kept():
    assert buffer_refusal(group(3, (1.0, 1.0)), keep_zero_variance=False) == "zero_variance"
    assert buffer_refusal(group(3, (1.0, 1.0)), keep_zero_variance=True) is None
    assert buffer_refusal(group(3, (1.0, 0.0)), keep_zero_variance=False) is None


async def simulate(
    groups_per_step: int, max_staleness: int, in_flight: int, push_delay: int, steps: int
) -> GroupLedger:
    """A learner run without a model: a request is answered at once with the served version,
    a step takes a batch from the real Buffer and its push is served `push_delay` ticks later."""
    ledger = GroupLedger()
    buffer = Buffer(max_staleness, keep_zero_variance=False, ledger=ledger)
    version = served = buffer.next_train_version = 1
    landing: list[tuple[int, int]] = []  # (tick when served, version)
    for tick in itertools.count():
        if ledger.trained >= steps * groups_per_step:
            return ledger
        assert tick < 100 * steps, "the run stopped making progress"
        served = max([served] + [v for t, v in landing if t <= tick])
        while ledger.pending < in_flight and may_request(
            served=served,
            next_train_version=buffer.next_train_version,
            pending=ledger.pending,
            groups_per_step=groups_per_step,
            max_staleness=max_staleness,
        ):
            ledger.request()
            ledger.generated()
            buffer.put(group(served))
        buffer.prune(version)  # what take() would drop, counted; take() then returns at once
        if len(buffer) >= groups_per_step:
            await asyncio.wait_for(buffer.take(groups_per_step, version), 1)
            version += 1
            landing.append((tick + push_delay, version))
    raise AssertionError("unreachable")


@pytest.mark.parametrize("groups_per_step", [1, 2, 3])
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("push_delay", [0, 1, 3])
async def test_an_admitted_group_is_never_dropped_as_stale(groups_per_step, max_staleness, push_delay):
    for in_flight in (groups_per_step, 2 * groups_per_step + 1, 8):
        ledger = await simulate(groups_per_step, max_staleness, in_flight, push_delay, steps=12)
        assert ledger.dropped.get("stale", 0) == 0, (in_flight, ledger.snapshot())
        ledger.check()
