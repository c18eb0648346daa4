"""The proxy's core, whichever door a request came by: one group admitted, run and accounted,
and the fleet's status (the proxy as one big replica). The gRPC servicer (servicer.py) and the
HTTP door (http/) are two thin edges over it; neither imports the other, and nothing here knows
which door a request came through.

Invariants: the proxy answers every accepted request exactly once, complete or with an
error status, within its deadline (routing/failover.py); a refusal decided by a replica reaches
the client unchanged (routing/passthrough.py); every request is counted once (accounting.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from rollwire.common.errors import RollwireError
from rollwire.proxy.accounting import RequestRecord
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.publish.fanout import FanOut
from rollwire.proxy.publish.peers import Peers
from rollwire.proxy.routing.coalesce import Coalescer
from rollwire.proxy.routing.dispatch import Dispatcher
from rollwire.proxy.routing.failover import GroupRun
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.routing.score import ScoreRun, check_score
from rollwire.proxy.routing.sessions import SessionTurns
from rollwire.proxy.spool import Spool
from rollwire.proxy.tenants import FLEET, Scope
from rollwire.runtime.security import ADMIN, GENERATE, TokenAuth
from rollwire.serving import __version__
from rollwire.serving.sessions import SessionStore
from rollwire.serving.sizes import check_group_key, check_prompt_size
from rollwire.v1 import generator_pb2 as pb

if TYPE_CHECKING:
    from rollwire.proxy.fleet.replicas import ReplicaSet
    from rollwire.proxy.metrics import ProxyMetrics


@dataclass(frozen=True)
class ProxyState:
    """What the proxy's core works with, built once by start_proxy (app.py)."""

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


class ProxyCore:
    """What both doors call: `group_events` (one group admitted and run), `account` (its record
    in the metrics) and `status` (the fleet as one replica)."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        config, dispatcher = state.config, state.dispatcher
        self.sessions = SessionTurns(SessionStore(config.sessions, state.metrics.sessions), dispatcher)
        routing = config.routing
        self.coalescer = Coalescer(
            routing.coalesce_window_ms / 1000,
            lambda: min([routing.coalesce_max_n] + [r.limits.max_n for r in state.replicas.routable() if r.limits]),
            lambda: {r.engine for r in state.replicas.routable()},
            state.metrics.coalesced.inc,
        )
        """Single-sample requests for one prompt served as one group (routing/coalesce.py)."""
        """Session turns: their histories and sticky routing (routing/sessions.py)."""

    def account(self, *, edge: bool = False) -> RequestRecord:
        """A generation request's record in the core metrics, whichever door it came by: the
        HTTP door opens one per request as gRPC's Generate does (accounting.py)."""
        return RequestRecord(self.state.metrics, edge=edge)

    def caller(self, metadata) -> tuple[str, Scope]:
        """The role of a call's token and the names it sees (tenants.py): admin and the fleet's
        where auth is off, as every call is."""
        auth = self.state.auth
        grant = auth.grant(metadata) if auth is not None else None
        if grant is None:
            return (ADMIN if auth is None else GENERATE), Scope()
        return grant.role, Scope(grant.tenant)

    def has_adapter(self, name: str) -> bool:
        """Does the fleet hold adapter `name` for a tenant's read (tenants.Scope.read): a lineage or a
        spooled version. Never only because a member reports it: what a tenant reaches passed a spool
        (audit 2026-12-07 S6; the fleet's reads name what they mean and never ask this)."""
        internal = self.state.spool.lineages.internal(name)
        return internal != name or bool(self.state.spool.versions(internal))

    async def group_events(
        self, request: pb.GenerateRequest, rid: str, client: str, deadline: float, tenant: str = FLEET
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One group through the core, whichever door it came by: admitted under `client`'s
        limits (routing/dispatch.py), "latest" settled with peer proxies, run by routing/failover.py. Raises
        RollwireError or PassThrough; closing the iterator frees the client's slot and the lease.
        The tokens it streams count towards `tenant` (a label: tenants.FLEET or a configured tenant)."""
        self._check_sizes(request)
        if self.state.peers is not None and request.adapter.name and not request.adapter.version:
            await self.state.peers.settled(request.adapter.name, max(0.0, deadline - time.monotonic()))
        work = max(1, request.n) * max(1, request.sampling.max_new_tokens)
        with self.state.dispatcher.admit(client, tenant, work) as admitted:  # exits (frees the slots) before any abort
            request.request_id = rid
            if request.HasField("session"):
                source = self.sessions.events(request, rid, client, deadline, admitted)
            elif self.coalescer.accepts(request):

                def run(group: pb.GenerateRequest, until: float) -> AsyncIterator[pb.GenerateResponse]:
                    return GroupRun(group, group.request_id, until, self.state.dispatcher, admitted).events()

                source = self.coalescer.events(request, deadline, run)
            else:
                source = GroupRun(request, rid, deadline, self.state.dispatcher, admitted).events()
            tokens = self.state.metrics.tenant_tokens.labels(tenant)
            async with contextlib.aclosing(source) as events:  # closing it releases the lease  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
                async for message in events:
                    if message.tokens:
                        tokens.inc(sum(len(chunk.token_ids) for chunk in message.tokens))
                    yield message

    def _check_sizes(self, request: pb.GenerateRequest) -> None:
        """A request no routable replica would take for its size is refused here, before it is
        keyed, copied, coalesced or sent: the replicas' own rules (serving.sizes), the prompt's at
        the largest limit among them, so nothing one of them would serve is refused. Forwarded, a
        7 MiB text cost this event loop ~50 ms a request (keyed, serialised again for the replica)."""
        check_group_key(request)
        limits = self.state.replicas.fleet_limits()
        if limits:
            largest = max(x.max_prompt_tokens for x in limits)
            check_prompt_size(request, largest, "any replica of this fleet")

    async def score(
        self, request: pb.ScoreRequest, rid: str, client: str, deadline: float, tenant: str = FLEET
    ) -> pb.ScoreResponse:
        """One Score through the core, whichever door it came by: the proxy's limits, the
        client's slot, routed by version (routing/score.py), counted in the Score metrics with
        its final code. Raises RollwireError or PassThrough."""
        start, metrics, code = time.monotonic(), self.state.metrics, grpc.StatusCode.UNKNOWN
        try:
            work = check_score(request, self.state.config.score)
            if self.state.peers is not None and request.adapter.name and not request.adapter.version:
                await self.state.peers.settled(request.adapter.name, max(0.0, deadline - time.monotonic()))
            with self.state.dispatcher.admit(client, tenant, work) as admitted:  # its tokens, as a Generate's
                reply = await ScoreRun(request, rid, deadline, self.state.dispatcher, admitted, work).answer()
            code = grpc.StatusCode.OK
            metrics.scored_tokens.inc(sum(len(s.continuation_token_ids) for s in request.sequences))
            return reply
        except (RollwireError, PassThrough) as exc:
            code = exc.code
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            metrics.score_requests.labels(code.name).inc()
            metrics.score_latency.observe(time.monotonic() - start)

    def status(self, scope: Scope | None = None) -> pb.GetStatusResponse:
        """The proxy as one big replica: what some routable replica serves, the strictest
        limits of the routable replicas that serve the fleet's base model (a client keeping to
        them is served by every one; replicas.fleet_limits), and each replica's own state; a
        tenant's `scope` sees its own adapters (unqualified) and the shared ones only."""
        members = self.state.replicas.all()
        routable = self.state.replicas.routable()
        adapters: dict[str, set[int]] = {}
        for replica in routable:
            for name, versions in replica.versions.items():
                adapters.setdefault(name, set()).update(versions)
        for name in adapters:  # unloaded versions are not served (lineages.py); internal names are shown
            adapters[name] -= self.state.spool.lineages.unloaded(name)
            if scope is not None and scope.tenant:  # a tenant sees what passed a spool, never only a member's word
                adapters[name] = {v for v in adapters[name] if self.state.spool.get(name, v) is not None}
        shown = [(n, v, (scope or Scope()).shown(n)) for n, v in sorted(adapters.items()) if v]
        return pb.GetStatusResponse(
            role="proxy",
            replica=self.state.proxy_id,
            instance=self.state.peers.instance if self.state.peers is not None else "",
            model_fingerprint=self.state.replicas.fingerprint,
            engine=",".join(sorted({r.engine for r in members if r.engine})),
            adapters=[self._loaded(n, v, seen) for n, v, seen in shown if seen is not None],
            in_flight=sum(r.in_flight for r in members),
            queue_depth=self.state.dispatcher.queued(),
            limits=self._limits(self.state.replicas.fleet_limits()),
            replicas=[r.status() for r in members],
            server_version=__version__,
        )

    def _loaded(self, name: str, versions: set[int], shown: str) -> pb.LoadedAdapter:
        """One name of the proxy's summary (as the caller sees it: `shown`), with the digest and
        signer of each version it spooled."""
        spooled = [a.manifest for v in sorted(versions) if (a := self.state.spool.get(name, v)) is not None]
        return pb.LoadedAdapter(
            name=shown,
            versions=sorted(versions),
            digests={m.version: m.sha256 for m in spooled},
            signers={m.version: m.signer for m in spooled if m.signature},
        )

    def _limits(self, limits: list[pb.Limits]) -> pb.Limits:
        spool_max = self.state.config.spool.max_adapter_bytes
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
