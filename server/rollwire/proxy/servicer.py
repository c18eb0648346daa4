"""GeneratorService at the proxy: the same contract as a replica, spread over many; the gRPC
door, a thin edge over the proxy's core (core.py), as the HTTP door (http/) is another.

Invariants: the proxy answers every accepted request exactly once, complete or with an
error status, within its deadline (routing/failover.py); a refusal decided by a replica reaches
the client unchanged (routing/passthrough.py); the request id travels to the replicas as
`x-request-id`; a tenant's call (proxy/tenants.py) names its own adapters, qualified here
before the core sees them, and reads its own names back (`started`, GetStatus, push replies,
error sentences).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import structlog

from rollwire.common.errors import FailedPrecondition, ResourceExhausted, RollwireError, to_status
from rollwire.common.reasons import Reason
from rollwire.proxy.core import ProxyCore
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.tenants import Scope
from rollwire.runtime.logs import get_logger, request_id_from
from rollwire.runtime.security import ADMIN, caller_identity
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

log = get_logger(__name__)


class ProxyServicer(generator_pb2_grpc.GeneratorServiceServicer):
    def __init__(self, core: ProxyCore) -> None:
        self.core, self.state = core, core.state

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Admitted under the client's limits (routing/dispatch.py), run by routing/failover.py; messages are
        written with `context.write` bounded by `fairness.slow_reader_timeout_s`, so a client
        that stops reading loses its request (RESOURCE_EXHAUSTED, SLOW_READER) and frees its
        slots instead of holding them until its deadline."""
        metadata = context.invocation_metadata()
        rid = request_id_from(metadata, request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid)
        remaining = context.time_remaining()
        limit = self.state.config.routing.request_timeout_s
        timeout = limit if remaining is None else min(remaining, limit)
        auth = self.state.config.auth
        name = caller_identity(metadata, context.peer(), auth.enabled())
        role, scope = self.core.caller(metadata)
        try:
            with self.core.account() as record:  # counted, timed and classified (accounting.py)
                record.tenant = scope.label
                try:
                    if request.adapter.name:
                        request.adapter.name = scope.read(request.adapter.name, self.core.has_adapter)
                    events = self.core.group_events(request, rid, name, record.start + timeout, scope.label)
                    async with contextlib.aclosing(events):  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
                        async for message in events:
                            await self._write(context, _shown(message, scope, role), name)
                except RollwireError as err:
                    record.close(err)
                    err.message = scope.scrub(err.message)
                    log.info("generate_failed", code=err.code.name, reason=err.reason, error=err.message)
                    aborting = context.abort_with_status(to_status(err))  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
                    await self._finish(context, aborting, err.reason == Reason.SLOW_READER)
                except PassThrough as relay:
                    record.close(relay)
                    relay.scoped(scope.scrub)
                    log.info("generate_refused_by_replica", code=relay.code.name, error=relay.details)
                    await self._finish(context, relay.abort(context))
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        """Routed by version like Generate, under the client's slot and the proxy's limits, and
        counted in the Score metrics (ProxyCore.score)."""
        metadata = context.invocation_metadata()
        rid = request_id_from(metadata, request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid)
        remaining, limit = context.time_remaining(), self.state.config.routing.request_timeout_s
        client = caller_identity(metadata, context.peer(), self.state.config.auth.enabled())
        _role, scope = self.core.caller(metadata)
        try:
            deadline = time.monotonic() + (limit if remaining is None else min(remaining, limit))
            if request.adapter.name:
                request.adapter.name = scope.read(request.adapter.name, self.core.has_adapter)
            return await self.core.score(request, rid, client, deadline, scope.label)
        except RollwireError as err:
            err.message = scope.scrub(err.message)
            log.info("score_failed", code=err.code.name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
            raise AssertionError("unreachable: abort_with_status raises") from err
        except PassThrough as relay:
            relay.scoped(scope.scrub)
            log.info("score_refused_by_replica", code=relay.code.name, error=relay.details)
            await relay.abort(context)
            raise AssertionError("unreachable: abort raises") from relay
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def _write(self, context: grpc.aio.ServicerContext, message: pb.GenerateResponse, client: str) -> None:
        """Send one message; the write waits while the client's flow-control window is full."""
        patience = self.state.config.fairness.slow_reader_timeout_s
        try:
            async with asyncio.timeout(patience):
                await context.write(message)
        except TimeoutError:
            self.state.metrics.client_limited.labels("slow_reader").inc()
            log.warning("slow_reader_cut_off", client=client, seconds=patience)
            raise ResourceExhausted(
                f"the client did not read this stream for {patience:g}s, so the proxy ended the request and freed its "
                "slot; read responses as they come (or ask for fewer tokens per request)",
                reason=Reason.SLOW_READER,
            ) from None

    async def _finish(self, context: grpc.aio.ServicerContext, aborting, slow_reader: bool = False) -> None:
        """Send the final status. A client that does not read may not take it for long (it
        waits behind unread messages): the status stays queued for it, and the handler ends
        after a bounded wait instead of holding on until the deadline."""
        try:
            async with asyncio.timeout(0.1 if slow_reader else self.state.config.fairness.slow_reader_timeout_s):
                await aborting
        except TimeoutError:
            raise asyncio.CancelledError from None

    async def PushAdapter(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PushAdapterResponse:
        """The core's push (core.py): received, relayed as it arrives, staged everywhere and
        committed (publish/fanout.py). Until the upload is complete every exit, cancellation
        included, leaves nothing behind."""
        metadata = context.invocation_metadata()
        rid = request_id_from(metadata)
        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            caller = self.core.caller(metadata)
            return await self.core.push(caller, request_iterator, rid, metadata, context.send_initial_metadata)
        except RollwireError as err:
            log.info("adapter_push_refused", code=err.code.name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
            raise AssertionError("unreachable: abort_with_status raises") from err
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def CommitAdapter(self, request: pb.CommitAdapterRequest, context) -> pb.CommitAdapterResponse:
        """A proxy commits by itself, on every replica that staged a version it publishes."""
        err = FailedPrecondition(
            "a proxy stages and commits pushed versions by itself; push the adapter through it with PushAdapter "
            "(CommitAdapter is for replicas that staged a version)",
            reason=Reason.PROXY_PUBLISHES,
        )
        await context.abort_with_status(to_status(err))
        raise AssertionError("abort_with_status returned")  # pragma: no cover

    async def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.GetStatusResponse:
        """Each replica's address and state (the fleet's topology) only for an admin token; a
        tenant's token sees its own adapters and the shared ones (tenants.py)."""
        role, scope = self.core.caller(context.invocation_metadata())
        full = self.core.status(scope)
        if role != ADMIN:
            del full.replicas[:]
        return full


def _shown(message: pb.GenerateResponse, scope: Scope, role: str) -> pb.GenerateResponse:
    """`message` as the caller sees it: its `started` names the adapter by the caller's name; the
    replica's address (HOST:PORT, the fleet's topology: GetStatus's rule) only to an admin, its
    name (`replica_id`) to the fleet's callers too, and neither to a tenant; a copy, since a
    coalesced group's messages are shared by its requests."""
    if not message.HasField("started") or (role == ADMIN and not scope.tenant):
        return message
    shown = pb.GenerateResponse()
    shown.CopyFrom(message)
    if scope.tenant or ":" in shown.started.replica:
        shown.started.replica = ""
    if scope.tenant and message.started.adapter.name:
        shown.started.adapter.name = scope.shown(message.started.adapter.name) or ""
    return shown
