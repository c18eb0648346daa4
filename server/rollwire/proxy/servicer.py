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
from collections.abc import AsyncIterator

import grpc
import structlog

from rollwire.common.errors import FailedPrecondition, ResourceExhausted, RollwireError, to_status
from rollwire.common.reasons import Reason
from rollwire.proxy.core import ProxyCore
from rollwire.proxy.publish.peers import Peers
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.routing.shares import check_spool_quota
from rollwire.proxy.tenants import Scope, audit
from rollwire.runtime.logs import get_logger, request_id_from
from rollwire.runtime.security import ADMIN, caller_identity, require_peer, require_stage_only
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
        """Receive (bounded, idle-timed, checked as a replica would), relay as it arrives, then
        stage everywhere and commit (publish/fanout.py). Until the upload is complete every exit,
        cancellation included, leaves nothing behind."""
        rid = request_id_from(context.invocation_metadata())
        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            origin = Peers.origin(context.invocation_metadata())
            if origin and self.state.peers is not None:  # a peer proxy's copy: spool it, no fan-out (publish/peers.py)
                require_peer(self.state.auth, context)
                return await self.state.peers.receive(request_iterator, origin, rid)
            role, scope = self.core.caller(context.invocation_metadata())
            require_stage_only(role, False)  # a relay or peer token publishes nothing
            named = _Named(request_iterator, scope, self.core)
            try:
                reply = await self.state.fanout.push(named.each(), rid, send_metadata=context.send_initial_metadata)
            except RollwireError as err:
                if named.name:  # refused once its name was known: audited
                    audit(self.state.metrics.tenant_publishes, scope, role, "push", named.name, named.version, err)
                err.message = scope.scrub(err.message)
                raise
            audit(self.state.metrics.tenant_publishes, scope, role, "push", reply.name, reply.version, None)
            return _reply_shown(reply, scope)
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


class _Named:
    """A push's messages, its manifest's name qualified for the caller's tenant (a name a
    tenant may not give, or a version over its spool quotas, is refused by the reader's first
    read, before any byte is taken)."""

    def __init__(self, messages: AsyncIterator[pb.PushAdapterRequest], scope: Scope, core: ProxyCore) -> None:
        self.messages, self.scope, self.core = messages, scope, core
        self.name, self.version = "", 0
        """The fleet's name and the version of the push, once its manifest was read."""

    async def each(self) -> AsyncIterator[pb.PushAdapterRequest]:
        first = True
        async for message in self.messages:
            if first and message.WhichOneof("part") == "manifest":
                message.manifest.name = self.scope.own(message.manifest.name)
                self.name, self.version = message.manifest.name, message.manifest.version
                state = self.core.state
                check_spool_quota(
                    state.dispatcher.shares, state.spool, state.config.spool.keep_versions, message.manifest
                )
            first = False
            yield message


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


def _reply_shown(reply: pb.PushAdapterResponse, scope: Scope) -> pb.PushAdapterResponse:
    if scope.tenant:
        reply.name = scope.shown(reply.name) or ""
        for result in reply.replicas:
            result.message, result.address = scope.scrub(result.message), ""
    return reply
