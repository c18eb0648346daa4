"""GeneratorService at the proxy: the same contract as a replica, spread over many.

Invariants: the proxy answers every accepted request exactly once, complete or with an
error status, within its deadline (failover.py); a refusal decided by a replica reaches the
client unchanged (relay.py); the request id travels to the replicas as `x-request-id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import structlog

from rollwire.common.errors import FailedPrecondition, ResourceExhausted, RollwireError, to_status
from rollwire.common.reasons import Reason
from rollwire.proxy.accounting import RequestRecord
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.publish.fanout import FanOut
from rollwire.proxy.publish.peers import Peers
from rollwire.proxy.routing.coalesce import Coalescer
from rollwire.proxy.routing.dispatch import Dispatcher
from rollwire.proxy.routing.failover import GroupRun
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.routing.sessions import SessionTurns
from rollwire.proxy.spool import Spool
from rollwire.runtime.logs import get_logger, request_id_from
from rollwire.runtime.security import ADMIN, TokenAuth, caller_identity, caller_role, require_peer, require_stage_only
from rollwire.serving import __version__
from rollwire.serving.sessions import SessionStore
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

if TYPE_CHECKING:
    from rollwire.proxy.fleet.replicas import ReplicaSet
    from rollwire.proxy.metrics import ProxyMetrics

log = get_logger(__name__)


@dataclass(frozen=True)
class ProxyState:
    """What the proxy's servicer works with, built once by start_proxy (app.py)."""

    config: ProxyConfig
    proxy_id: str
    replicas: ReplicaSet
    metrics: ProxyMetrics
    dispatcher: Dispatcher
    """Generate goes through it."""
    fanout: FanOut
    """Pushes go through it."""
    peers: Peers | None = None
    """Pushes from peer proxies go to it; None = no peering."""
    auth: TokenAuth | None = None

    @property
    def spool(self) -> Spool:
        """The proxy's committed versions (the fan-out's)."""
        return self.fanout.spool


class ProxyServicer(generator_pb2_grpc.GeneratorServiceServicer):
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        config, dispatcher = state.config, state.dispatcher
        self.config, self.dispatcher, self.fanout, self.proxy_id = config, dispatcher, state.fanout, state.proxy_id
        self.replicas, self.metrics, self.peers, self.auth = state.replicas, state.metrics, state.peers, state.auth
        self.sessions = SessionTurns(SessionStore(config.sessions, self.metrics.sessions), dispatcher)
        routing = config.routing
        self.coalescer = Coalescer(
            routing.coalesce_window_ms / 1000,
            lambda: min([routing.coalesce_max_n] + [r.limits.max_n for r in self.replicas.routable() if r.limits]),
            lambda: {r.engine for r in self.replicas.routable()},
            self.metrics.coalesced.inc,
        )
        """Single-sample requests for one prompt served as one group (coalesce.py)."""
        """Session turns: their histories and sticky routing (sessions.py)."""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Admitted under the client's limits (dispatch.py), run by failover.py; messages are
        written with `context.write` bounded by `fairness.slow_reader_timeout_s`, so a client
        that stops reading loses its request (RESOURCE_EXHAUSTED, SLOW_READER) and frees its
        slots instead of holding them until its deadline."""
        metadata = context.invocation_metadata()
        rid = request_id_from(metadata, request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid)
        remaining = context.time_remaining()
        limit = self.config.routing.request_timeout_s
        timeout = limit if remaining is None else min(remaining, limit)
        auth = self.config.auth
        name = caller_identity(metadata, context.peer(), auth.enabled())
        try:
            with self.account() as record:  # counted, timed and classified (accounting.py)
                try:
                    events = self.group_events(request, rid, name, record.start + timeout)
                    async with contextlib.aclosing(events):  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
                        async for message in events:
                            await self._write(context, message, name)
                except RollwireError as err:
                    record.close(err)
                    log.info("generate_failed", code=err.code.name, reason=err.reason, error=err.message)
                    aborting = context.abort_with_status(to_status(err))  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time
                    await self._finish(context, aborting, err.reason == Reason.SLOW_READER)
                except PassThrough as relay:
                    record.close(relay)
                    log.info("generate_refused_by_replica", code=relay.code.name, error=relay.details)
                    await self._finish(context, relay.abort(context))
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    def account(self, *, edge: bool = False) -> RequestRecord:
        """A generation request's record in the core metrics, whichever door it came by: the
        HTTP door opens one per request as gRPC's Generate does (accounting.py)."""
        return RequestRecord(self.metrics, edge=edge)

    async def group_events(
        self, request: pb.GenerateRequest, rid: str, client: str, deadline: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One group through the core, whichever door it came by: admitted under `client`'s
        limits (dispatch.py), "latest" settled with peer proxies, run by failover.py. Raises
        RollwireError or PassThrough; closing the iterator frees the client's slot and the lease."""
        if self.peers is not None and request.adapter.name and not request.adapter.version:
            await self.peers.settled(request.adapter.name, max(0.0, deadline - time.monotonic()))
        with self.dispatcher.admit(client) as admitted:  # exits (frees the client's slot) before any abort
            request.request_id = rid
            if request.HasField("session"):
                source = self.sessions.events(request, rid, client, deadline, admitted)
            elif self.coalescer.accepts(request):

                def run(group: pb.GenerateRequest, until: float) -> AsyncIterator[pb.GenerateResponse]:
                    return GroupRun(group, group.request_id, until, self.dispatcher, admitted).events()

                source = self.coalescer.events(request, deadline, run)
            else:
                source = GroupRun(request, rid, deadline, self.dispatcher, admitted).events()
            async with contextlib.aclosing(source) as events:  # closing it releases the lease  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
                async for message in events:
                    yield message

    async def _write(self, context: grpc.aio.ServicerContext, message: pb.GenerateResponse, client: str) -> None:
        """Send one message; the write waits while the client's flow-control window is full."""
        patience = self.config.fairness.slow_reader_timeout_s
        try:
            async with asyncio.timeout(patience):
                await context.write(message)
        except TimeoutError:
            self.metrics.client_limited.labels("slow_reader").inc()
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
            async with asyncio.timeout(0.1 if slow_reader else self.config.fairness.slow_reader_timeout_s):
                await aborting
        except TimeoutError:
            raise asyncio.CancelledError from None

    async def PushAdapter(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PushAdapterResponse:
        """Receive (bounded, idle-timed, checked as a replica would), relay as it arrives, then
        stage everywhere and commit (fanout.py). Until the upload is complete every exit,
        cancellation included, leaves nothing behind."""
        rid = request_id_from(context.invocation_metadata())
        structlog.contextvars.bind_contextvars(request_id=rid)
        try:
            origin = Peers.origin(context.invocation_metadata())
            if origin and self.peers is not None:  # a peer proxy's copy: spool it, no fan-out (peers.py)
                require_peer(self.auth, context)
                return await self.peers.receive(request_iterator, origin, rid)
            require_stage_only(caller_role(self.auth, context), False)  # a relay or peer token publishes nothing
            return await self.fanout.push(request_iterator, rid)
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
        """Each replica's address and state (the fleet's topology) only for an admin token."""
        full = self.status()
        if caller_role(self.auth, context) != ADMIN:
            del full.replicas[:]
        return full

    def status(self) -> pb.GetStatusResponse:
        """The proxy as one big replica: what some routable replica serves, the strictest
        limits of the routable replicas that serve the fleet's base model (a client keeping to
        them is served by every one; replicas.fleet_limits), and each replica's own state."""
        members = self.replicas.all()
        routable = self.replicas.routable()
        adapters: dict[str, set[int]] = {}
        for replica in routable:
            for name, versions in replica.versions.items():
                adapters.setdefault(name, set()).update(versions)
        for name in adapters:  # unloaded versions are not served (lineages.py); internal names are shown
            adapters[name] -= self.state.spool.lineages.unloaded(name)
        return pb.GetStatusResponse(
            role="proxy",
            replica=self.proxy_id,
            instance=self.peers.instance if self.peers is not None else "",
            model_fingerprint=self.replicas.fingerprint,
            engine=",".join(sorted({r.engine for r in members if r.engine})),
            adapters=[pb.LoadedAdapter(name=n, versions=sorted(v)) for n, v in sorted(adapters.items()) if v],
            in_flight=sum(r.in_flight for r in members),
            queue_depth=self.dispatcher.queued(),
            limits=self._limits(self.replicas.fleet_limits()),
            replicas=[r.status() for r in members],
            server_version=__version__,
        )

    def _limits(self, limits: list[pb.Limits]) -> pb.Limits:
        spool_max = self.config.spool.max_adapter_bytes
        if not limits:
            return pb.Limits(max_adapter_bytes=spool_max)
        return pb.Limits(
            max_n=min(x.max_n for x in limits),
            max_new_tokens=min(x.max_new_tokens for x in limits),
            max_prompt_tokens=min(x.max_prompt_tokens for x in limits),
            max_adapter_bytes=min([spool_max] + [x.max_adapter_bytes for x in limits]),
            adapter_window=min(x.adapter_window for x in limits),
            adapter_keep=min(x.adapter_keep or x.adapter_window for x in limits),
            max_context=min((x.max_context for x in limits if x.max_context), default=0),
        )
