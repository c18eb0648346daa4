"""Admission and placement: bounded in-flight per replica and one bounded FIFO queue.

Invariants:
- a replica never runs more than `max_in_flight_per_replica` groups placed by this proxy;
- at most `max_queue` requests wait; the next is refused at once with RESOURCE_EXHAUSTED
  and a retry hint, before any work is done;
- when a slot frees or a replica changes state, waiters are served in arrival order, each
  by a replica that can serve it (a waiter needing a version nobody free holds does not
  block those behind it);
- a waiter gives up with UNAVAILABLE when no replica could serve it for `no_replica_wait_s`,
  and with DEADLINE_EXCEEDED at its deadline; a lease granted to a waiter that left is
  released, so no slot leaks;
- every lease is released exactly once (release is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from rollwire.common.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from rollwire.server.proxy.config import RoutingSection
from rollwire.server.proxy.metrics import ProxyMetrics
from rollwire.server.proxy.policies import Policy
from rollwire.server.proxy.replica import Replica
from rollwire.server.proxy.replicas import ReplicaSet


@dataclass(frozen=True)
class Need:
    """What a replica must hold to serve a group."""

    adapter: str = ""
    """Adapter name; empty for the base model, which every replica serves."""
    version: int = 0
    """The concrete version, resolved before dispatch so a restart uses the same one."""
    any_replica: bool = False
    """The proxy knows no replica holding the adapter: let any replica answer, it may know better."""

    def served_by(self, replica: Replica) -> bool:
        return self.any_replica or not self.adapter or replica.holds(self.adapter, self.version)

    def __str__(self) -> str:
        return f"adapter {self.adapter!r} v{self.version}" if self.adapter and not self.any_replica else "this request"


@dataclass(eq=False)
class Lease:
    """One group's slot on one replica."""

    replica: Replica
    work: int
    dispatcher: Dispatcher
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.dispatcher._free(self)


@dataclass(eq=False)
class _Waiter:
    need: Need
    key: bytes
    work: int
    exclude: frozenset[str]
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Dispatcher:
    def __init__(self, replicas: ReplicaSet, policy: Policy, routing: RoutingSection, metrics: ProxyMetrics) -> None:
        self.replicas, self.policy, self.routing, self.metrics = replicas, policy, routing, metrics
        self._waiters: deque[_Waiter] = deque()
        self._changed = asyncio.Event()

    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, need: Need, key: bytes, work: int, exclude: frozenset[str], deadline: float) -> Lease:
        """A slot on a replica that can serve `need`, waiting in the queue if all are busy."""
        lease = self._place(need, key, work, exclude)
        if lease is not None:
            return lease
        if len(self._waiters) >= self.routing.max_queue:
            self.metrics.refused.inc()
            raise ResourceExhausted(
                f"every replica that can serve {need} is at its limit of {self.routing.max_in_flight_per_replica} groups "
                f"and {len(self._waiters)} requests already wait in the proxy (limit {self.routing.max_queue}); "
                "retry after the hinted delay or add replicas",
                reason="PROXY_QUEUE_FULL",
                retry_after_s=self.routing.retry_after_s,
            )
        waiter = _Waiter(need, key, work, exclude)
        self._waiters.append(waiter)
        self.metrics.queue_depth.set(len(self._waiters))
        start, lease = time.monotonic(), None
        try:
            lease = await self._wait(waiter, start, deadline)
            return lease
        finally:
            self.metrics.queue_wait.observe(time.monotonic() - start)
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            self.metrics.queue_depth.set(len(self._waiters))
            if lease is None and waiter.future.done():  # granted just as the waiter gave up
                waiter.future.result().release()

    async def _wait(self, waiter: _Waiter, start: float, deadline: float) -> Lease:
        while True:
            now = time.monotonic()
            servable = bool(self._eligible(waiter.need, waiter.exclude))
            limit = deadline if servable else min(deadline, start + self.routing.no_replica_wait_s)
            if now >= limit:
                if limit >= deadline:
                    raise DeadlineExceeded(
                        f"the request waited {now - start:.1f}s in the proxy's queue and its deadline passed before "
                        "a replica slot freed up; send fewer concurrent requests or add replicas",
                        reason="QUEUE_DEADLINE",
                    )
                raise self._no_replica(waiter.need, now - start)
            done, _ = await asyncio.wait({waiter.future}, timeout=limit - now)
            if done:
                return waiter.future.result()

    async def wait_for_replica(self, deadline: float) -> None:
        """Wait until some replica is routable (the proxy starting, every replica restarting)."""
        start = time.monotonic()
        limit = min(deadline, start + self.routing.no_replica_wait_s)
        while not self.replicas.routable():
            if time.monotonic() >= limit:
                raise self._no_replica(Need(), time.monotonic() - start)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), limit - time.monotonic())

    def _no_replica(self, need: Need, waited: float) -> Unavailable:
        return Unavailable(
            f"no generator replica could serve {need} for {waited:.1f}s ({self.replicas.describe()}); "
            "retry later or check the replicas",
            reason="NO_REPLICA",
            retry_after_s=self.routing.retry_after_s,
        )

    def wake(self) -> None:
        """Offer freed slots to the waiters, first come first served."""
        self._changed.set()
        self._changed = asyncio.Event()
        for waiter in list(self._waiters):
            if waiter.future.done():
                continue
            lease = self._place(waiter.need, waiter.key, waiter.work, waiter.exclude)
            if lease is not None:
                self._waiters.remove(waiter)
                waiter.future.set_result(lease)
        self.metrics.queue_depth.set(len(self._waiters))

    def _eligible(self, need: Need, exclude: frozenset[str]) -> list[Replica]:
        """Routable replicas that hold what `need` asks; replicas this group already failed
        on only when there is no other."""
        eligible = [r for r in self.replicas.routable() if need.served_by(r)]
        return [r for r in eligible if r.address not in exclude] or eligible

    def _place(self, need: Need, key: bytes, work: int, exclude: frozenset[str]) -> Lease | None:
        free = [r for r in self._eligible(need, exclude) if r.in_flight < self.routing.max_in_flight_per_replica]
        if not free:
            return None
        chosen = self.policy.choose([r.candidate() for r in free], key)
        replica = next(r for r in free if r.address == chosen.address)
        replica.in_flight += 1
        replica.work += work
        replica.idle.clear()
        self.metrics.in_flight.labels(replica.address).set(replica.in_flight)
        return Lease(replica, work, self)

    def _free(self, lease: Lease) -> None:
        replica = lease.replica
        replica.in_flight -= 1
        replica.work -= lease.work
        if replica.in_flight == 0:
            replica.idle.set()
        if self.replicas.get(replica.address) is replica:
            self.metrics.in_flight.labels(replica.address).set(replica.in_flight)
        self.wake()
