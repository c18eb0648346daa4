"""Admission and placement: bounded in-flight per replica, per-client limits and a bounded
queue served fairly across clients.

Invariants:
- a replica never runs more than `max_in_flight_per_replica` groups placed by this proxy;
- at most `max_queue` requests wait; the next is refused at once with RESOURCE_EXHAUSTED
  and a retry hint, before any work is done;
- a client (security identity or peer host, see `security.caller_identity`) has at most
  `fairness.max_in_flight_per_client` requests open and at most
  `fairness.max_queued_tokens_per_client` of work (n x max_new_tokens) queued; beyond
  either it is refused with RESOURCE_EXHAUSTED, reason CLIENT_LIMIT, and a retry hint,
  before any work (a client's first queued request is always accepted); a tenant's quotas
  (in-flight requests, queued tokens, tokens/s) likewise, reason TENANT_QUOTA (shares.py);
- each client waits in its own FIFO queue; when a slot frees or a replica changes state,
  the waiting tenant furthest behind its weighted share goes first (shares.py), and inside
  it the client served longest ago (round robin between clients), each waiter by a
  replica that can serve it (a waiter needing a version nobody free holds does not block
  those behind it), so one client's thousand queued groups do not starve another's one;
- a waiter gives up with UNAVAILABLE when no replica could serve it for `no_replica_wait_s`,
  and with DEADLINE_EXCEEDED at its deadline; a lease granted to a waiter that left is
  released, so no slot leaks;
- every lease is released exactly once (release is idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field

from rollwire.common.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from rollwire.common.reasons import Reason
from rollwire.proxy.config import FairnessSection, RoutingSection
from rollwire.proxy.fleet.replica import Replica
from rollwire.proxy.fleet.replicas import ReplicaSet
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.policies import Policy, routing_key
from rollwire.proxy.routing.shares import Share, Shares
from rollwire.proxy.tenants import FLEET
from rollwire.runtime.logs import Throttled, get_logger
from rollwire.runtime.waits import wait_at_most
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


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
class Client:
    """One client identity's share of the proxy; kept while it has requests open."""

    name: str
    in_flight: int = 0
    """Requests open at the proxy (queued or running)."""
    queued_work: int = 0
    """n x max_new_tokens summed over its waiting requests."""
    waiters: deque = field(default_factory=deque)
    served: int = 0
    """The dispatcher's turn when it was last given a slot (0: never)."""
    share: Share | None = None
    """Its tenant's share (a client's token belongs to one tenant); None until the dispatcher
    first sees it: the fleet's."""


@dataclass(eq=False)
class _Waiter:
    need: Need
    key: bytes
    work: int
    exclude: frozenset[str]
    client: Client
    prefer: str = ""
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(eq=False)
class Dispatcher:
    """Admits requests per client and hands out replica slots: a free slot goes to the waiting
    client served longest ago, then to that client's oldest waiter (see the module docstring)."""

    replicas: ReplicaSet
    policy: Policy
    routing: RoutingSection
    metrics: ProxyMetrics
    fairness: FairnessSection = field(default_factory=FairnessSection)
    shares: Shares = field(default_factory=Shares)
    """Tenants' weights and quotas (shares.py)."""
    clients: dict[str, Client] = field(default_factory=dict, init=False)
    """Admitted clients by name (those with requests open)."""
    _queued: dict[Client, None] = field(default_factory=dict, init=False)
    """Clients with waiters, in the order they started waiting (ties of `served` go by it)."""
    _anonymous: Client = field(default_factory=lambda: Client(""), init=False)
    _waiting: int = field(default=0, init=False)
    _turn: int = field(default=0, init=False)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _no_replica_log: Throttled = field(default_factory=lambda: Throttled(log, "no_replica"), init=False)

    def queued(self) -> int:
        return self._waiting

    def key_for(self, request: pb.GenerateRequest) -> bytes:
        """The routing key of a group: the policy's own (prefix.py keys by token blocks) or the
        shared one (group_key, else the prompt's first `affinity_prefix` characters or ids)."""
        kind = request.WhichOneof("prompt")
        text = request.text if kind == "text" else None
        ids = request.token_ids.ids if kind == "token_ids" else None
        own = getattr(self.policy, "key_for", None)
        if own is not None:
            return own(request.group_key, text, ids)
        return routing_key(request.group_key, text, ids, self.routing.affinity_prefix)

    @contextlib.contextmanager
    def admit(self, name: str, tenant: str = FLEET, work: int = 0):
        """Hold one of the client's `max_in_flight_per_client` request slots, and one of its
        tenant's (a request of `work` tokens), for a request's whole life; RESOURCE_EXHAUSTED
        (CLIENT_LIMIT, or TENANT_QUOTA naming the quota) when none is free."""
        client = self.clients.get(name) or Client(name, share=self.shares.get(tenant))
        limit = self.fairness.max_in_flight_per_client
        if client.in_flight >= limit:
            self.metrics.client_limited.labels("in_flight").inc()
            raise ResourceExhausted(
                f"this client already has {client.in_flight} requests open at the proxy (limit {limit} per client); "
                "wait for some to finish, or retry after the hinted delay",
                reason=Reason.CLIENT_LIMIT,
                retry_after_s=self.routing.retry_after_s,
            )
        share = client.share = client.share or self.shares.get(tenant)
        self.shares.open(share, work)
        self.clients[name] = client
        client.in_flight += 1
        self.metrics.clients.set(len(self.clients))
        try:
            yield client
        finally:
            self.shares.close(share)
            client.in_flight -= 1
            if client.in_flight <= 0 and self.clients.get(name) is client:
                del self.clients[name]
            self.metrics.clients.set(len(self.clients))

    async def acquire(
        self,
        need: Need,
        key: bytes,
        work: int,
        exclude: frozenset[str],
        deadline: float,
        client: Client | None = None,
        first: bool = True,
        prefer: str = "",
    ) -> Lease:
        """A slot on a replica that can serve `need`, waiting in the client's queue if all are
        busy. `first`: the request's first attempt (a retry is not refused for the client's
        queued work: it was admitted already). `prefer`: a session's sticky replica, taken
        whenever it has a free slot and is not overloaded (`_sticky`)."""
        client = client or self._anonymous
        share = self._share(client)
        lease = self._place(need, key, work, exclude, prefer)
        if lease is not None:
            self._served(client, work)
            return lease
        if first:
            self.shares.check_queue(share, work)
        limit = self.fairness.max_queued_tokens_per_client
        if first and client.queued_work and client.queued_work + work > limit:
            self.metrics.client_limited.labels("queued_tokens").inc()
            raise ResourceExhausted(
                f"this client already has {client.queued_work} tokens of work (n x max_new_tokens) waiting in the "
                f"proxy's queue and this request would take it over the limit of {limit} per client; retry after the "
                "hinted delay",
                reason=Reason.CLIENT_LIMIT,
                retry_after_s=self.routing.retry_after_s,
            )
        if self._waiting >= self.routing.max_queue:
            self.metrics.refused.inc()
            raise ResourceExhausted(
                f"every replica that can serve {need} is at its limit of {self.routing.max_in_flight_per_replica} groups "
                f"and {self._waiting} requests already wait in the proxy (limit {self.routing.max_queue}); "
                "retry after the hinted delay or add replicas",
                reason=Reason.PROXY_QUEUE_FULL,
                retry_after_s=self.routing.retry_after_s,
            )
        waiter = _Waiter(need, key, work, exclude, client, prefer)
        self._enqueue(waiter)
        start, lease = time.monotonic(), None
        try:
            lease = await self._wait(waiter, start, deadline)
            return lease
        finally:
            self.metrics.queue_wait.observe(time.monotonic() - start)
            self._dequeue(waiter)
            if lease is None and waiter.future.done():  # granted just as the waiter gave up
                waiter.future.result().release()

    def _enqueue(self, waiter: _Waiter) -> None:
        client = waiter.client
        client.waiters.append(waiter)
        client.queued_work += waiter.work
        self.shares.enqueued(self._share(client), waiter.work)
        self._waiting += 1
        self._queued.setdefault(client, None)
        self.metrics.queue_depth.set(self._waiting)

    def _dequeue(self, waiter: _Waiter) -> None:
        """Take a waiter out of its client's queue (idempotent)."""
        client = waiter.client
        if waiter in client.waiters:
            client.waiters.remove(waiter)
            client.queued_work -= waiter.work
            self.shares.dequeued(self._share(client), waiter.work)
            self._waiting -= 1
            if not client.waiters:
                self._queued.pop(client, None)
        self.metrics.queue_depth.set(self._waiting)

    def _share(self, client: Client) -> Share:
        """The client's tenant's share (the fleet's for a client the dispatcher never admitted)."""
        if client.share is None:
            client.share = self.shares.get(FLEET)
        return client.share

    def _served(self, client: Client, work: int) -> None:
        self._turn += 1
        client.served = self._turn
        self.shares.granted(self._share(client), work)

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
                        reason=Reason.QUEUE_DEADLINE,
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
            await wait_at_most(self._changed.wait(), limit - time.monotonic())

    def _no_replica(self, need: Need, waited: float) -> Unavailable:
        """A generic sentence for the caller: the replicas' addresses and errors are the
        operator's to read (this log line, GetStatus for an admin), not every caller's (audit A12)."""
        self._no_replica_log(need=str(need), waited_s=round(waited, 1), replicas=self.replicas.describe()[:1000])
        return Unavailable(
            f"no generator replica could serve {need} for {waited:.1f}s; retry later (the proxy's log and "
            "GetStatus name each replica's state)",
            reason=Reason.NO_REPLICA,
            retry_after_s=self.routing.retry_after_s,
        )

    def wake(self) -> None:
        """Offer freed slots to the waiters: one at a time to the client of the tenant furthest
        behind its share (then served longest ago) that has a waiter some free replica can
        serve (its oldest such waiter)."""
        self._changed.set()
        self._changed = asyncio.Event()
        if not self._waiting:
            return
        clients = list(self._queued)
        blocked: set[int] = set()
        while True:
            granted = False
            waiting = (c for c in clients if id(c) not in blocked)
            for client in sorted(waiting, key=lambda c: (self._share(c).vtime, c.served)):
                for waiter in list(client.waiters):
                    if waiter.future.done():
                        continue
                    lease = self._place(waiter.need, waiter.key, waiter.work, waiter.exclude, waiter.prefer)
                    if lease is not None:
                        self._dequeue(waiter)
                        self._served(client, waiter.work)
                        waiter.future.set_result(lease)
                        granted = True
                        break
                if granted:
                    break
                blocked.add(id(client))  # slots only shrink during one wake: nothing of it fits now
            if not granted:
                break
        self.metrics.queue_depth.set(self._waiting)

    def _eligible(self, need: Need, exclude: frozenset[str]) -> list[Replica]:
        """Routable replicas that hold what `need` asks; replicas this group already failed
        on only when there is no other."""
        eligible = [r for r in self.replicas.routable() if need.served_by(r)]
        return [r for r in eligible if r.address not in exclude] or eligible

    def _place(self, need: Need, key: bytes, work: int, exclude: frozenset[str], prefer: str = "") -> Lease | None:
        free = [r for r in self._eligible(need, exclude) if r.in_flight < self.routing.max_in_flight_per_replica]
        if not free:
            return None
        replica = self._sticky(free, prefer) if prefer else None
        if replica is None:
            chosen = self.policy.choose([r.candidate() for r in free], key)
            replica = next(r for r in free if r.address == chosen.address)
            outcome = getattr(self.policy, "outcome", "")
            if outcome:
                self.metrics.prefix_routes.labels(outcome).inc()
        replica.in_flight += 1
        replica.work += work
        replica.idle.clear()
        self.metrics.in_flight.labels(replica.address).set(replica.in_flight)
        return Lease(replica, work, self)

    def _sticky(self, free: list[Replica], prefer: str) -> Replica | None:
        """The preferred replica when it is free and not overloaded: it runs at most
        `affinity_load_factor` x the average load of the free replicas, or fewer than
        `affinity_min_gap` groups more than the least loaded of them (the affinity rule)."""
        sticky = next((r for r in free if r.address == prefer), None)
        if sticky is None:
            return None
        total = sum(r.in_flight for r in free)
        bound = math.ceil(self.routing.affinity_load_factor * (total + 1) / len(free))
        least = min(r.in_flight for r in free)
        if sticky.in_flight + 1 <= bound or sticky.in_flight - least < self.routing.affinity_min_gap:
            return sticky
        return None

    def _free(self, lease: Lease) -> None:
        replica = lease.replica
        replica.in_flight -= 1
        replica.work -= lease.work
        if replica.in_flight == 0:
            replica.idle.set()
        if self.replicas.get(replica.address) is replica:
            self.metrics.in_flight.labels(replica.address).set(replica.in_flight)
        self.wake()
