"""AdminService: which generator replicas the proxy routes to.

Invariants: registering an address twice refreshes it (a heartbeat) and never duplicates
it; a heartbeat of a replica refused membership (another base model, replicas.py) removes it
and is refused with FAILED_PRECONDITION (BASE_MODEL_MISMATCH) naming it; a new replica takes work only after the catch-up (replicas.py); deregistering cuts
its live groups off, and their runs restart them elsewhere; draining stops new work and
returns only when the replica has no group left, so a drain loses nothing.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from rollwire.common.errors import FailedPrecondition, InvalidArgument, NotFound, RollwireError, to_status
from rollwire.common.logs import get_logger
from rollwire.common.reasons import Reason
from rollwire.proxy.config import check_address
from rollwire.proxy.replica import Replica
from rollwire.proxy.replicas import ReplicaSet
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc

log = get_logger(__name__)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    async def RegisterGenerator(self, request: apb.RegisterGeneratorRequest, context) -> apb.RegisterGeneratorResponse:
        try:
            check_address(request.address)
        except ValueError as exc:
            return await _abort(context, InvalidArgument(f"address: {exc}", reason=Reason.BAD_ADDRESS))
        known = self.replicas.get(request.address)
        if known is not None and known.foreign:  # refused membership: its heartbeat is told why, by name
            await self.replicas.remove(request.address, known.detail)
            return await _abort(context, FailedPrecondition(known.detail, reason=Reason.BASE_MODEL_MISMATCH))
        replica, created = self.replicas.add(request.address, "registered", request.ttl_seconds or None)
        return apb.RegisterGeneratorResponse(replica=replica.status(), created=created)

    async def DeregisterGenerator(
        self, request: apb.DeregisterGeneratorRequest, context
    ) -> apb.DeregisterGeneratorResponse:
        if self._find(request.address) is None:
            return await _abort(context, self._unknown(request.address))
        restarted = await self.replicas.remove(request.address, "deregistered by an admin")
        return apb.DeregisterGeneratorResponse(restarted=restarted)

    async def ListGenerators(self, request: apb.ListGeneratorsRequest, context) -> apb.ListGeneratorsResponse:
        return apb.ListGeneratorsResponse(replicas=[r.status() for r in self.replicas.all()])

    async def DrainGenerator(self, request: apb.DrainGeneratorRequest, context) -> apb.DrainGeneratorResponse:
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
