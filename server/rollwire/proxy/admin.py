"""AdminService: which generator replicas the proxy routes to.

Invariants: registering an address twice refreshes it (a heartbeat) and never duplicates
it; a heartbeat of a replica refused membership (another base model, replicas.py) removes it
and is refused with FAILED_PRECONDITION (BASE_MODEL_MISMATCH) naming it; a new replica takes work only after the catch-up (replicas.py); deregistering cuts
its live groups off, and their runs restart them elsewhere; draining stops new work and
returns only when the replica has no group left, so a drain loses nothing.

Who may register: a `register` token registers, drains and removes only its own address (the
host must resolve to the caller's own IP address) with a ttl in 1..registration.max_ttl_s, so
it lapses unless it keeps beating; only an admin may register for good (ttl 0) or for another
address. A registration that would take the proxy past registration.max_members is refused.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from rollwire.common.addresses import check_address, split_address
from rollwire.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RollwireError,
    to_status,
)
from rollwire.common.reasons import Reason
from rollwire.proxy.config import RegistrationSection
from rollwire.proxy.replica import Replica
from rollwire.proxy.replicas import ReplicaSet
from rollwire.runtime.hosts import peer_ip, resolve_ips
from rollwire.runtime.logs import get_logger
from rollwire.runtime.security import REGISTER, TokenAuth, caller_role
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc

log = get_logger(__name__)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self, replicas: ReplicaSet, limits: RegistrationSection | None = None, auth: TokenAuth | None = None
    ) -> None:
        self.replicas, self.limits, self.auth = replicas, limits or RegistrationSection(), auth

    async def RegisterGenerator(self, request: apb.RegisterGeneratorRequest, context) -> apb.RegisterGeneratorResponse:
        try:
            check_address(request.address)
            await self._own(request.address, context)
            self._check_ttl(request.ttl_seconds, context)
        except ValueError as exc:
            return await _abort(context, InvalidArgument(f"address: {exc}", reason=Reason.BAD_ADDRESS))
        except RollwireError as err:
            return await _abort(context, err)
        known = self.replicas.get(request.address)
        if known is not None and known.foreign:  # refused membership: its heartbeat is told why, by name
            await self.replicas.remove(request.address, known.detail)
            return await _abort(context, FailedPrecondition(known.detail, reason=Reason.BASE_MODEL_MISMATCH))
        if known is None and len(self.replicas.all()) >= self.limits.max_members:
            return await _abort(
                context,
                ResourceExhausted(
                    f"this proxy holds {len(self.replicas.all())} replicas, its limit (registration.max_members); "
                    "one must leave before another registers",
                    reason=Reason.TOO_MANY_MEMBERS,
                    retry_after_s=float(self.limits.max_ttl_s),
                ),
            )
        replica, created = self.replicas.add(request.address, "registered", request.ttl_seconds or None)
        return apb.RegisterGeneratorResponse(replica=replica.status(), created=created)

    def _check_ttl(self, ttl: int, context) -> None:
        bound = self.limits.max_ttl_s
        if ttl > bound or (ttl == 0 and caller_role(self.auth, context) == REGISTER):
            raise InvalidArgument(
                f"ttl_seconds is {ttl}; give 1 to {bound} (registration.max_ttl_s) and heartbeat within it"
                + (" (0, for good, is for an admin)" if ttl == 0 else ""),
                reason=Reason.BAD_TTL,
            )

    async def _own(self, address: str, context) -> None:
        """A `register` token acts on its own address only: the host must resolve to the
        caller's IP address (the port is its own business)."""
        if caller_role(self.auth, context) != REGISTER:
            return
        peer = peer_ip(context.peer())
        try:
            ips = await resolve_ips(split_address(address)[0])
        except ValueError:  # not HOST:PORT: no DNS lookup of a caller's junk, and not its own
            ips = set()
        if peer is None or peer not in ips:
            raise PermissionDenied(
                f"a register token may register, drain or remove only its own address; {address} is not "
                f"the address this call comes from ({context.peer()}); advertise the address the proxy sees, "
                "or use an admin token",
                reason=Reason.NOT_OWN_ADDRESS,
            )

    async def DeregisterGenerator(
        self, request: apb.DeregisterGeneratorRequest, context
    ) -> apb.DeregisterGeneratorResponse:
        try:
            await self._own(request.address, context)
        except RollwireError as err:
            return await _abort(context, err)
        if self._find(request.address) is None:
            return await _abort(context, self._unknown(request.address))
        restarted = await self.replicas.remove(request.address, "deregistered by an admin")
        return apb.DeregisterGeneratorResponse(restarted=restarted)

    async def ListGenerators(self, request: apb.ListGeneratorsRequest, context) -> apb.ListGeneratorsResponse:
        return apb.ListGeneratorsResponse(replicas=[r.status() for r in self.replicas.all()])

    async def DrainGenerator(self, request: apb.DrainGeneratorRequest, context) -> apb.DrainGeneratorResponse:
        try:
            await self._own(request.address, context)
        except RollwireError as err:
            return await _abort(context, err)
        if self._find(request.address) is None:
            return await _abort(context, self._unknown(request.address))
        replica = await self.replicas.drain(request.address)
        status = replica.status()
        if request.deregister:
            await self.replicas.remove(request.address, "drained and deregistered")
        log.info("replica_drained", replica=request.address, deregistered=request.deregister)
        return apb.DrainGeneratorResponse(replica=status)

    def _find(self, address: str) -> Replica | None:
        return self.replicas.get(address)

    def _unknown(self, address: str) -> NotFound:
        known = ", ".join(r.address for r in self.replicas.all()) or "none"
        return NotFound(
            f"no replica {address!r} is registered here (known: {known}); ListGenerators shows them",
            reason=Reason.UNKNOWN_REPLICA,
        )


async def _abort(context: grpc.aio.ServicerContext, err: RollwireError) -> NoReturn:
    await context.abort_with_status(to_status(err))  # pyright: ignore[reportAttributeAccessIssue]  # grpc.aio has it; its stubs do not
    raise AssertionError("abort_with_status returns only by raising")
