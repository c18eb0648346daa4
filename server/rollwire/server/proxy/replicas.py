"""The set of generator replicas behind the proxy: membership, health, catch-up.

Invariants:
- each member has one monitor task: an active gRPC health check every interval (sooner when
  its connection drops), a GetStatus refresh of what it has loaded, and, while it is not
  caught up, a catch-up that pushes every spooled version it lacks, oldest first; it is
  routable only after the catch-up finished, so a replica that joins, comes back or failed
  a push never takes work before it holds the newest versions;
- a dropped connection (a restart, even a quick one) marks the replica not caught up;
- a replica that stops answering health checks has its live groups cut off (their runs
  restart them elsewhere) instead of leaving them to hang until their deadline;
- removing a replica cancels its tasks, abandons its live groups (their runs restart them
  elsewhere) and forgets its metric series;
- every state change calls `on_change`, which lets waiting requests re-check for a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from rollwire.common.logs import get_logger, new_request_id
from rollwire.server.proxy.breaker import Breaker
from rollwire.server.proxy.config import ProxyConfig
from rollwire.server.proxy.metrics import ProxyMetrics
from rollwire.server.proxy.replica import Replica
from rollwire.server.proxy.spool import Spool
from rollwire.server.proxy.upstream import Upstream
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["GeneratorService"].full_name
# A replica refusing a catch-up version for these reasons already holds something newer.
ALREADY_AHEAD = {"VERSION_NOT_MONOTONIC", "VERSION_CONFLICT"}


class ReplicaSet:
    def __init__(self, config: ProxyConfig, spool: Spool, metrics: ProxyMetrics, on_change: Callable[[], None],
                 upstream: Upstream | None = None) -> None:
        self.config, self.spool, self.metrics, self.on_change = config, spool, metrics, on_change
        self.upstream = upstream or Upstream()
        self.members: dict[str, Replica] = {}
        self._background: set[asyncio.Task] = set()
        self.fingerprint = ""  # the base model every member must serve, set by the first to sync

    # -- membership --------------------------------------------------------------------
    def add(self, address: str, source: str, ttl_s: float | None = None) -> tuple[Replica, bool]:
        """Add a replica, or refresh its registration; (replica, created)."""
        expires = time.monotonic() + ttl_s if ttl_s else None
        replica = self.members.get(address)
        if replica is not None:
            if replica.source == "registered":
                replica.expires_at = expires
            return replica, False
        hc = self.config.health
        breaker = Breaker(hc.eject_after_failures, hc.eject_s, hc.eject_max_s)
        replica = Replica(address, source, breaker, self.upstream, expires)
        self.members[address] = replica
        replica.tasks = [asyncio.create_task(self._monitor(replica)), asyncio.create_task(self._watch_channel(replica))]
        self.metrics.replicas.set(len(self.members))
        log.info("replica_added", replica=address, source=source, ttl_s=ttl_s)
        self._publish(replica)
        return replica, True

    async def remove(self, address: str, reason: str) -> int:
        """Forget a replica; returns how many live groups were cut off it (to restart elsewhere)."""
        replica = self.members.pop(address, None)
        if replica is None:
            return 0
        abandoned = replica.abandon_all(f"replica {address} was removed: {reason}")
        for task in replica.tasks:
            task.cancel()
        await asyncio.gather(*replica.tasks, return_exceptions=True)
        await replica.channel.close(grace=None)
        self.metrics.forget_replica(address)
        self.metrics.replicas.set(len(self.members))
        log.info("replica_removed", replica=address, reason=reason, restarted=abandoned)
        self.on_change()
        return abandoned

    async def drain(self, address: str) -> Replica:
        """Stop new work on a replica and wait until its last group ends."""
        replica = self.members[address]
        if not replica.draining:
            replica.draining = True
            log.info("replica_draining", replica=address, in_flight=replica.in_flight)
            self._publish(replica)
        await replica.idle.wait()
        return replica

    def reconcile(self, source: str, addresses: set[str]) -> None:
        """Make the members from `source` (e.g. DNS) exactly `addresses`; leavers drain first."""
        for address in sorted(addresses - set(self.members)):
            self.add(address, source)
        for address, replica in list(self.members.items()):
            if replica.source == source and address not in addresses and not replica.draining:
                self._spawn(self._drain_and_remove(address, f"{source} no longer lists it"))

    def _spawn(self, coroutine) -> None:
        """Run a membership change in the background, keeping a reference until it ends."""
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _drain_and_remove(self, address: str, reason: str) -> None:
        with contextlib.suppress(KeyError):
            await self.drain(address)
            await self.remove(address, reason)

    async def close(self) -> None:
        for address in list(self.members):
            await self.remove(address, "the proxy is shutting down")

    # -- queries -----------------------------------------------------------------------
    def get(self, address: str) -> Replica | None:
        return self.members.get(address)

    def all(self) -> list[Replica]:
        return [self.members[a] for a in sorted(self.members)]

    def routable(self) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.all() if r.routable(now)]

    def healthy(self) -> list[Replica]:
        return [r for r in self.all() if r.healthy]

    def latest(self, name: str) -> int:
        """Newest version of `name` confirmed on at least one routable replica (0: none)."""
        return max((r.newest(name) for r in self.routable()), default=0)

    def describe(self) -> str:
        """Each replica's state in a few words, for error sentences."""
        if not self.members:
            return "no replicas are registered or discovered"
        now = time.monotonic()
        return "; ".join(f"{r.address}: {r.state(now) or 'ready'}" for r in self.all())

    def mark_unsynced(self, replica: Replica, why: str) -> None:
        """Take a replica out of rotation until a catch-up brings it to the newest versions."""
        if replica.synced:
            log.info("replica_needs_catch_up", replica=replica.address, why=why)
        replica.synced = False
        replica.detail = why
        replica.wake.set()
        self._publish(replica)

    # -- monitoring --------------------------------------------------------------------
    async def _monitor(self, replica: Replica) -> None:
        hc = self.config.health
        while True:
            if replica.expires_at is not None and time.monotonic() > replica.expires_at:
                self._spawn(self.remove(replica.address, "its registration lapsed without a heartbeat"))
                return
            replica.wake.clear()
            ok, answered, why = await self._check(replica)
            if ok:
                replica.failed_checks = 0
                if not replica.healthy:
                    replica.healthy = True
                    log.info("replica_healthy", replica=replica.address)
                if not replica.synced or time.monotonic() - replica.last_status >= hc.status_every_s:
                    await self.sync(replica)
            else:
                replica.failed_checks += 1
                if replica.healthy and replica.failed_checks >= hc.unhealthy_after:
                    replica.healthy = replica.synced = False
                    log.warning("replica_unhealthy", replica=replica.address, why=why)
                    if not answered:  # hung or gone: its groups would wait for their deadline
                        replica.abandon_all(f"replica {replica.address} stopped answering health checks")
                if not replica.healthy:
                    replica.detail = why
            self._publish(replica)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(replica.wake.wait(), hc.interval_s)

    async def _check(self, replica: Replica) -> tuple[bool, bool, str]:
        """(serving, answered, why not). A replica shutting down answers NOT_SERVING while
        its in-flight groups finish; one that does not answer at all is hung or gone."""
        try:
            reply = await replica.health.Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=self.config.health.timeout_s, metadata=replica.metadata
            )
        except grpc.aio.AioRpcError as exc:
            return False, False, f"health check failed with {exc.code().name}: {exc.details()}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return False, True, "health check reports NOT_SERVING (starting or shutting down)"
        return True, True, ""

    async def _watch_channel(self, replica: Replica) -> None:
        """A connection that drops may come back to a restarted process that lost its
        adapters, so the replica must be checked and caught up before it serves again."""
        ready = grpc.ChannelConnectivity.READY
        state = replica.channel.get_state(try_to_connect=True)
        while True:
            await replica.channel.wait_for_state_change(state)
            new = replica.channel.get_state()
            if state == ready and new != ready:
                self.mark_unsynced(replica, "its connection dropped; checking it again")
            state = new

    async def sync(self, replica: Replica) -> None:
        """Refresh what the replica holds, push what it lacks; routable once it holds it all."""
        async with replica.push_lock:
            try:
                status = await replica.generator.GetStatus(
                    pb.GetStatusRequest(), timeout=self.config.health.timeout_s, metadata=replica.metadata
                )
            except grpc.aio.AioRpcError as exc:
                replica.detail = f"GetStatus failed with {exc.code().name}: {exc.details()}"
                return
            replica.last_status = time.monotonic()
            replica.identity, replica.engine, replica.limits = status.replica, status.engine, status.limits
            replica.fingerprint = status.model_fingerprint
            if self.fingerprint and status.model_fingerprint != self.fingerprint:
                replica.synced = False
                replica.detail = (
                    f"it serves base model {status.model_fingerprint} but this proxy serves {self.fingerprint}; "
                    "point it at the same model folder"
                )
                return
            self.fingerprint = status.model_fingerprint
            replica.versions = {a.name: list(a.versions) for a in status.adapters}
            if await self._catch_up(replica) and not replica.synced:
                replica.synced, replica.detail = True, ""
                log.info("replica_ready", replica=replica.address, identity=replica.identity, adapters=replica.versions)

    async def _catch_up(self, replica: Replica) -> bool:
        """Push every spooled version above what the replica holds, oldest first."""
        for name in self.spool.names():
            for adapter in self.spool.versions(name):
                if adapter.version <= replica.newest(name):
                    continue
                result = await replica.push(adapter, await adapter.payload(), self.config.health.push_timeout_s, new_request_id())
                self.metrics.pushes.labels(replica.address, result.code.name).inc()
                if result.ok:
                    self.metrics.catchup_pushes.labels(replica.address).inc()
                    log.info("replica_caught_up", replica=replica.address, adapter=name, version=adapter.version)
                elif result.reason not in ALREADY_AHEAD:
                    replica.synced = False
                    replica.detail = f"catching up {name} v{adapter.version} failed with {result.code.name}: {result.message}"
                    log.warning("catch_up_failed", replica=replica.address, adapter=name, version=adapter.version,
                                code=result.code.name, error=result.message)
                    return False
        return True

    def _publish(self, replica: Replica) -> None:
        if replica.address in self.members:
            m, a = self.metrics, replica.address
            m.healthy.labels(a).set(int(replica.healthy))
            m.routable.labels(a).set(int(replica.routable()))
            m.in_flight.labels(a).set(replica.in_flight)
            for name in replica.versions:
                m.versions.labels(a, name).set(replica.newest(name))
        self.on_change()
