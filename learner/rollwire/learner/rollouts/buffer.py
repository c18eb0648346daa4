"""Scored groups between the producer and the trainer, and the ledger that accounts for them.

Invariants:
- the buffer never lets a sample staler than `max_staleness` reach the loss: staleness is
  (version being trained) - (oldest adapter version among the group's trained tokens), checked
  when the batch is taken, against the version the batch will be trained at;
- every requested group ends exactly once: trained, or dropped with a reason (stale,
  zero_variance, refused, unavailable, reward_error, ...). The ledger checks
  requested == in_flight + buffered + trained + dropped after every change.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable

from rollwire.learner.rollouts.admission import buffer_refusal, split_stale
from rollwire.learner.rollouts.groups import ScoredGroup


class Signal:
    """Wakes every waiter when shared state changes; waiters re-check their own predicate.

    The waiting is an `asyncio.Condition`'s. Its `notify_all` needs the condition's lock, which
    the synchronous code that changes the state (the ledger's counters, done callbacks, timers)
    cannot take; so `notify` schedules one `notify_all` on the running loop. Notifications that
    arrive before it runs are folded into it, which loses nothing: a waiter re-checks the state,
    it does not count wake-ups, and the scheduled `notify_all` runs after every change it covers.
    """

    def __init__(self) -> None:
        self._condition = asyncio.Condition()
        self._scheduled: asyncio.Task | None = None

    def notify(self) -> None:
        """Wake every waiter soon (after the caller's synchronous code). Without a running loop
        nobody can be waiting, so there is nothing to wake."""
        if self._scheduled is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._scheduled = loop.create_task(self._notify_all(), name="rollwire-signal")

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` is true; it is checked now and after every notification."""
        async with self._condition:
            await self._condition.wait_for(predicate)

    async def _notify_all(self) -> None:
        async with self._condition:
            self._scheduled = None  # a change after this line schedules a new notify_all
            self._condition.notify_all()


class LedgerError(AssertionError):
    """The group accounting no longer adds up: a rollout was lost or counted twice."""


class GroupLedger:
    """Counts every group from its request to its end; observers mirror it into metrics."""

    def __init__(self) -> None:
        self.requested = 0
        self.in_flight = 0
        self.buffered = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()
        self.observers: list[Callable[[str, str, int], None]] = []
        self.changed = Signal()

    def request(self) -> None:
        self.requested += 1
        self.in_flight += 1
        self._emit("requested", "", 1)

    def generated(self) -> None:
        """A request ended (with groups or an error); what became of it is counted next."""
        self.in_flight -= 1
        self.changed.notify()

    def drop(self, reason: str, count: int = 1, *, from_buffer: bool = False) -> None:
        if from_buffer:
            self.buffered -= count
        self.dropped[reason] += count
        self._emit("dropped", reason, count)

    def train(self, count: int) -> None:
        """Groups taken from the buffer into an optimiser step."""
        self.buffered -= count
        self.trained += count
        self._emit("trained", "", count)

    @property
    def pending(self) -> int:
        """Groups requested and not yet trained or dropped."""
        return self.in_flight + self.buffered

    def check(self, *, idle: bool = False) -> None:
        """Raise LedgerError unless every group is accounted for (and, when `idle`, none is pending)."""
        total = self.in_flight + self.buffered + self.trained + sum(self.dropped.values())
        if total != self.requested or min(self.in_flight, self.buffered) < 0 or (idle and self.pending):
            raise LedgerError(
                f"group ledger does not add up: requested {self.requested} != in_flight {self.in_flight} + "
                f"buffered {self.buffered} + trained {self.trained} + dropped {dict(self.dropped)}"
            )

    def snapshot(self) -> dict:
        return {
            "requested": self.requested,
            "in_flight": self.in_flight,
            "buffered": self.buffered,
            "trained": self.trained,
            "dropped": dict(self.dropped),
        }

    def _emit(self, event: str, reason: str, count: int) -> None:
        for observer in self.observers:
            observer(event, reason, count)
        self.changed.notify()


class Buffer:
    """FIFO of scored groups; `take` returns only groups fresh enough for the version trained."""

    def __init__(self, max_staleness: int, keep_zero_variance: bool, ledger: GroupLedger) -> None:
        self.max_staleness = max_staleness
        self.keep_zero_variance = keep_zero_variance
        self.ledger = ledger
        self.next_train_version = 0
        """The earliest version the next batch can be trained at; set as a batch is taken."""
        self._groups: deque[ScoredGroup] = deque()
        self.drop_observers: list[Callable[[str, list[ScoredGroup]], None]] = []
        """Told every group dropped from the buffer (stale, shutdown), with the reason."""

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: ScoredGroup) -> bool:
        """Add a scored group (its request already ended); False when dropped (admission.buffer_refusal)."""
        refusal = buffer_refusal(group, self.keep_zero_variance)
        if refusal is not None:
            self.ledger.drop(refusal)
            return False
        self._groups.append(group)
        self.ledger.buffered += 1
        self.ledger.changed.notify()
        return True

    def prune(self, version: int) -> list[ScoredGroup]:
        """Drop (and count) every group too stale to train at `version`."""
        fresh, stale = split_stale(self._groups, version, self.max_staleness)
        if stale:
            self._groups = deque(fresh)
            self.ledger.drop("stale", len(stale), from_buffer=True)
            self._dropped("stale", stale)
        return stale

    async def take(self, count: int, version: int) -> list[ScoredGroup]:
        """The `count` oldest groups fresh enough for `version`; waits until there are enough."""
        await self.ledger.changed.wait_for(lambda: self.prune(version) is not None and len(self._groups) >= count)
        batch = [self._groups.popleft() for _ in range(count)]
        self.next_train_version = version + 1  # before anyone wakes: the producer's admission reads it
        self.ledger.train(count)
        return batch

    def count(self, predicate: Callable[[ScoredGroup], bool]) -> int:
        """Buffered groups for which `predicate` holds."""
        return sum(1 for g in self._groups if predicate(g))

    def drain(self, reason: str) -> int:
        """Drop everything left (at shutdown), counted under `reason`."""
        count, left = len(self._groups), list(self._groups)
        self._groups.clear()
        if count:
            self.ledger.drop(reason, count, from_buffer=True)
            self._dropped(reason, left)
        return count

    def _dropped(self, reason: str, groups: list[ScoredGroup]) -> None:
        for observer in self.drop_observers:
            observer(reason, groups)
