"""The set of generator replicas behind the proxy: membership, health, catch-up.

Invariants:
- each member has one monitor task: an active gRPC health check every interval (sooner when
  its connection drops), a GetStatus refresh of what it has loaded, and, while it is not
  caught up, a catch-up that pushes every spooled version it lacks, oldest first; it is
  routable only after the catch-up finished, so a replica that joins, comes back or failed
  a push never takes work before it holds the newest versions;
- a dropped connection (a restart, even a quick one) marks the replica not caught up;
- a replica that stops answering health checks has its live groups cut off (their runs
  resume them elsewhere, or restart them) instead of leaving them to hang until their deadline;
- removing a replica cancels its tasks, abandons its live groups (their runs resume them
  elsewhere, or restart them) and forgets its metric series;
- every state change calls `on_change`, which lets waiting requests re-check for a slot;
- the base model is declared or agreed by the spool, never learned from a member
  (basemodel.py); a member serving another one is refused membership: it is never routed
  to, pushed to or caught up, its refusals never count towards quarantine, it is named in
  its status, a log line and `replica_foreign_base_model`; a registered one is told so at
  its next heartbeat (../admin.py). BASE_MODEL_MISMATCH from a replica means "wrong replica",
  never "wrong bytes": the replica is checked again, the version stays;
- what catch-up pushes, what a refusal or a failure decides, and when a replica counts as
  caught up: catchup.py; a replica that refused (or was given up on for) versions is routed
  what it holds, and version-aware routing never sends it a version it lacks;
- one digest per version: a version a replica holds with other bytes than the spool's
  (GetStatus digests, or VERSION_CONFLICT when catch-up pushes it) is never routed to it,
  is logged (`replica_digest_conflict`) and counted (`replica_digest_conflicts`); in
  catch-up it is a fault, not "already held": the replica stays behind until it holds the
  spool's newest versions;
- pushes are checked against the base model's fingerprint and a member's linear-layer
  shapes before they are spooled (publish/fanout.py);
- a member a `register` token added is dialled with its member token (runtime/members.py) and
  passes its canary (canary.py) before it is caught up or routed;
- a member reporting limits under the operator's floor (`floor`) is refused (`member_under_floor`);
  the fleet's limits (`fleet_limits`) come only from routable members serving the fleet's base
  model, so a member that leaves rotation, or was never admitted, moves no client's limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from rollwire.common.manifest import TENANT_SEPARATOR
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.fleet.basemodel import BaseModel, Shapes
from rollwire.proxy.fleet.breaker import Breaker
from rollwire.proxy.fleet.canary import Canary
from rollwire.proxy.fleet.catchup import CatchUp
from rollwire.proxy.fleet.replica import Replica
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.spool import Spool
from rollwire.runtime.logs import get_logger
from rollwire.runtime.members import member_token, read_member_key, read_signing_key, signed_member_token
from rollwire.runtime.waits import wait_at_most
from rollwire.serving.dial import Dialer, on_each_drop
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["GeneratorService"].full_name


class ReplicaSet:
    def __init__(
        self,
        config: ProxyConfig,
        spool: Spool,
        metrics: ProxyMetrics,
        on_change: Callable[[], None],
        upstream: Dialer | None = None,
    ) -> None:
        self.config, self.spool, self.metrics, self.on_change = config, spool, metrics, on_change
        self.upstream = upstream or Dialer()
        self.members: dict[str, Replica] = {}
        self._background: set[asyncio.Task] = set()
        self.base = BaseModel(config.base_model, spool)
        spool.max_version_step = config.spool.max_version_step
        self.publishing: dict[tuple[str, int], asyncio.Task | None] = {}
        self.answered: set[tuple[str, int]] = set()
        """(name, version) of publications whose caller was answered at "spooled" and that still run."""
        """(name, version) a publication (publish/fanout.py; its task) is delivering now, spooled but still on its
        way to the replicas: catch-up leaves it to that publication, and a replica that lacks it
        yet is not behind. A second copy pushed over the same links would halve both (a thin
        link then took twice as long and closed connections mid-push); the publication hands
        whoever it missed to catch-up when it settles (mark_unsynced)."""
        self.catch_up = CatchUp(config, spool, metrics, self)
        self.member_key = read_member_key(config.upstream.member_key_file, "upstream.member_key_file")
        self.member_signer = read_signing_key(
            config.upstream.member_signing_key_file, "upstream.member_signing_key_file"
        )
        """The fleet key member tokens derive from; None = no `register` token may add a member."""
        self.canary = Canary(config.registration, metrics)

    # -- membership --------------------------------------------------------------------
    def add(self, address: str, source: str, ttl_s: float | None = None, member: bool = False) -> tuple[Replica, bool]:
        """Add a replica, or refresh its registration; (replica, created). A `member` (added by a
        `register` token, ../admin.py) is dialled with its member token and vetted by its canary."""
        expires = time.monotonic() + ttl_s if ttl_s else None
        replica = self.members.get(address)
        if replica is not None:
            if replica.source == "registered":
                replica.expires_at = expires
            return replica, False
        hc = self.config.health
        breaker = Breaker(hc.eject_after_failures, hc.eject_s, hc.eject_max_s)
        replica = Replica(address, source, breaker, self.upstream, expires, self.member_token(address, member), member)
        self.members[address] = replica
        self.metrics.know_replica(address)
        replica.tasks = [
            asyncio.create_task(self._monitor(replica)),
            asyncio.create_task(on_each_drop(replica.channel, lambda: self._dropped(replica))),
        ]
        self.metrics.replicas.set(len(self.members))
        log.info("replica_added", replica=address, source=source, ttl_s=ttl_s)
        self._publish(replica)
        return replica, True

    def member_token(self, address: str, registered: bool = False) -> str:
        """What the member at `address` is dialled with instead of upstream.token_file's token: the
        proxy's signature of its address for every member, else (no signing key) the fleet-key
        token for a member a `register` token added; "" = the upstream token."""
        if self.member_signer is not None:
            return signed_member_token(self.member_signer, address)
        return member_token(self.member_key, address) if registered and self.member_key else ""

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
        await replica.bulk_channel.close(grace=None)
        self.catch_up.forget(address)
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

    def fleet_limits(self) -> list[pb.Limits]:
        """The limits of the routable members that serve the fleet's base model: what the fleet
        promises its clients (proxy GetStatus, the door, session checks). None from a member out of
        rotation, refused or of another base model, and none under the floor (`_under_floor`)."""
        fleet = self.fingerprint
        return [r.limits for r in self.routable() if r.limits is not None and r.fingerprint == fleet]

    def healthy(self) -> list[Replica]:
        """Members that pass health checks, serve the fleet's base model and are neither refused
        nor waiting for their canary (push targets)."""
        return [r for r in self.all() if r.healthy and not r.foreign and r.vetted and not r.refused]

    @property
    def fingerprint(self) -> str:
        """The base model every member must serve (basemodel.py); before one is declared or
        agreed, the one every healthy member serves, if they agree: shown, never adopted."""
        serving = {r.fingerprint for r in self.healthy() if r.fingerprint}
        return self.base.fingerprint or (serving.pop() if len(serving) == 1 else "")

    @property
    def base_shapes(self) -> Shapes | None:
        """The fleet's base linear-layer shapes, once a member serving it reported them."""
        return self.base.shapes.get(self.base.fingerprint)

    def latest(self, name: str) -> int:
        """Newest version of `name` confirmed on at least one routable replica (0: none)."""
        return max((r.newest(name) for r in self.routable()), default=0)

    def promised(self, name: str) -> int:
        """The newest version of `name` a caller was told is loaded while its publication still
        runs (a load answered at "spooled"); 0: none. "latest" resolves to it, waiting for it."""
        return max((v for n, v in self.answered if n == name), default=0)

    def coming(self, name: str, version: int) -> bool:
        """Is the fleet being given this version: published now, or spooled and newer than any
        routable replica serves (catch-up brings it)? A request naming it waits for a replica."""
        if (name, version) in self.publishing:
            return True
        return version > self.latest(name) and self.spool.get(name, version) is not None

    def describe(self) -> str:
        """Each replica's state in a few words, for error sentences."""
        if not self.members:
            return "no replicas are registered or discovered"
        now = time.monotonic()
        return "; ".join(f"{r.address}: {r.state(now) or 'ready'}" for r in self.all())

    def push_basis(self, pushed: str) -> tuple[str, Shapes]:
        """(fingerprint, base linear shapes) a push trained on base model `pushed` is checked
        against (basemodel.BaseModel.basis); UNAVAILABLE before a member serving it reported them."""
        serving = {r.fingerprint for r in self.healthy() if r.fingerprint}
        return self.base.basis(pushed, serving, self.describe(), self.config.routing.retry_after_s)

    def recheck(self, replica: Replica, why: str) -> None:
        """A replica that claims another base model than its status said: read its status again
        before anything else is pushed to it."""
        replica.fingerprint = ""
        self.mark_unsynced(replica, why)

    def _refuse(self, replica: Replica) -> None:
        """Keep a member of another base model out of the fleet, naming it, once per change."""
        why = self.base.refusal(replica.name, replica.address, replica.fingerprint)
        if not replica.foreign:
            log.error(
                "replica_refused_membership",
                replica=replica.address,
                identity=replica.identity,
                serves=replica.fingerprint,
                fleet_serves=self.fingerprint,
                why=why,
            )
        replica.foreign, replica.synced, replica.detail = True, False, why

    def check_now(self) -> None:
        """Have every monitor re-read its replica and catch it up at once, staying in rotation
        (a peer proxy sent a version its sender has not brought to the replicas)."""
        for replica in self.all():
            replica.last_status = 0.0
            replica.wake.set()

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
                    replica.limits = None  # out of rotation: its limits are no longer the fleet's
                    log.warning("replica_unhealthy", replica=replica.address, why=why)
                    if not answered:  # hung or gone: its groups would wait for their deadline
                        replica.abandon_all(f"replica {replica.address} stopped answering health checks")
                if not replica.healthy:
                    replica.detail = why
            self._publish(replica)
            await wait_at_most(replica.wake.wait(), hc.interval_s)

    async def _check(self, replica: Replica) -> tuple[bool, bool, str]:
        """(serving, answered, why not). A replica shutting down answers NOT_SERVING while
        its in-flight groups finish; one that does not answer at all is hung or gone."""
        try:
            reply = await replica.health.Check(  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
                health_pb2.HealthCheckRequest(service=SERVICE),
                timeout=self.config.health.timeout_s,
                metadata=replica.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            return False, False, f"health check failed with {exc.code().name}: {exc.details()}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return False, True, "health check reports NOT_SERVING (starting or shutting down)"
        return True, True, ""

    def _dropped(self, replica: Replica) -> None:
        self.catch_up.forget(replica.address)  # a restarted replica may accept what it refused
        self.mark_unsynced(replica, "its connection dropped; checking it again")

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
            if not await self._admit(replica, status):
                return
            self._take_versions(replica, status.adapters)
            if await self.catch_up.run(replica) and not replica.synced:
                replica.synced, replica.detail = True, ""
                log.info("replica_ready", replica=replica.address, identity=replica.identity, adapters=replica.versions)

    async def _admit(self, replica: Replica, status: pb.GetStatusResponse) -> bool:
        """Whether a replica that answered GetStatus may be caught up: it serves the fleet's base
        model, reports limits at or above the floor, and (a member) passed its canary."""
        replica.identity, replica.engine, replica.limits = status.replica, status.engine, None
        replica.fingerprint = status.model_fingerprint
        shapes = {x.module: (x.out_features, x.in_features) for x in status.base_linear_layers}
        if replica.vetted:  # an unvetted member's shapes could mislead push checks
            self.base.report(status.model_fingerprint, shapes)
        if self.base.foreign(status.model_fingerprint):
            self._refuse(replica)
            return False
        if replica.foreign:
            replica.foreign = False
            log.info("replica_admitted", replica=replica.address, serves=status.model_fingerprint)
        if replica.refused:
            return False
        if why := self._under_floor(status.limits):
            replica.refused = why
            self.metrics.member_refusals.labels("floor").inc()
            log.error("member_under_floor", replica=replica.address, identity=replica.identity, why=why)
            return False
        replica.limits = status.limits
        if not replica.vetted:
            trusted = [r for r in self.routable() if r.fingerprint == replica.fingerprint and r is not replica]
            if not await self.canary.vet(replica, trusted, replica.fingerprint):
                return False
            self.base.report(status.model_fingerprint, shapes)
        return True

    def _under_floor(self, limits: pb.Limits) -> str:
        """Which reported limit is under the operator's floor, in words; "" when none."""
        floor = self.config.floor
        for key in ("max_n", "max_new_tokens", "max_prompt_tokens", "max_context"):
            reported, least = getattr(limits, key), getattr(floor, key)
            if reported < least and (key != "max_context" or reported):
                return (
                    f"it reports {key} {reported}, under this proxy's floor of {least} (floor.{key}); raise the "
                    "replica's limit, or lower the floor"
                )
        return ""

    async def refresh(self, replica: Replica) -> None:
        """Re-read what a replica serves (GetStatus), without catching it up: a peer proxy sent
        a version another proxy is committing on the replicas now (publish/peers.py). A failure
        changes nothing: the monitor's own checks judge the replica's health."""
        try:
            status = await replica.generator.GetStatus(
                pb.GetStatusRequest(), timeout=self.config.health.timeout_s, metadata=replica.metadata
            )
        except grpc.aio.AioRpcError:
            return
        if self.base.foreign(status.model_fingerprint):
            return
        self._take_versions(replica, status.adapters)
        self._publish(replica)

    def _take_versions(self, replica: Replica, adapters) -> None:
        """What a replica's GetStatus says it serves, less every version it holds with other
        bytes than the spool's (reported digests; a conflict a refusal found stays while the
        replica holds that version and reports no digest for it), and less every version of a
        tenant's name (TENANT:NAME) the spool does not hold: a tenant's names reach replicas only
        through a proxy's spool, so such a version was pushed behind the proxies' backs (audit
        2026-12-07 S6) and is neither shown to the tenant nor routed."""
        held = {(a.name, v) for a in adapters for v in a.versions}
        reported = {(a.name, v) for a in adapters for v in a.digests}
        conflicts = {k: d for k, d in replica.conflicts.items() if k in held and k not in reported}
        for a in adapters:
            for version, digest in a.digests.items():
                spooled = self.spool.get(a.name, version)
                if spooled is not None and digest != spooled.manifest.sha256:
                    conflicts[(a.name, version)] = digest
        for (name, version), digest in conflicts.items():
            if (name, version) not in replica.conflicts:
                self._log_conflict(replica, name, version, digest)
        replica.conflicts = conflicts
        replica.versions = {}
        for a in adapters:  # a tenant's version the spool never took was put there behind the proxy: never routed
            tenants = TENANT_SEPARATOR in a.name
            replica.set_versions(
                a.name, [v for v in a.versions if not tenants or self.spool.get(a.name, v) is not None]
            )

    def note_conflict(self, replica: Replica, name: str, version: int, digest: str) -> None:
        """A refusal said the replica holds (name, version) with other bytes than the spool's."""
        if (name, version) not in replica.conflicts:
            self._log_conflict(replica, name, version, digest)
            replica.conflicts[(name, version)] = digest
        replica.set_versions(name, replica.versions.get(name, []))

    def _log_conflict(self, replica: Replica, name: str, version: int, digest: str) -> None:
        spooled = self.spool.get(name, version)
        log.error(
            "replica_digest_conflict",
            replica=replica.address,
            identity=replica.identity,
            adapter=name,
            version=version,
            holds=digest or "(refused as VERSION_CONFLICT)",
            spool=spooled.manifest.sha256 if spooled else "",
            why="one digest per version: this replica is never routed this version",
        )

    def _publish(self, replica: Replica) -> None:
        if replica.address in self.members:
            m, a = self.metrics, replica.address
            m.healthy.labels(a).set(int(replica.healthy))
            m.routable.labels(a).set(int(replica.routable()))
            m.foreign.labels(a).set(int(replica.foreign))
            m.conflicts.labels(a).set(len(replica.conflicts))
            m.in_flight.labels(a).set(replica.in_flight)
            for name in replica.versions:
                m.confirmed(a, replica.versions, name)
        self.on_change()
