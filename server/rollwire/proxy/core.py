"""The proxy's core, whichever door a request came by: every verb a caller has (a group
generated, a Score, a push, a load, an unload, the fleet's status: the proxy as one big
replica), each taking the caller (`Caller`: its role and its tenant's scope). The gRPC servicer
(servicer.py) and the HTTP door (http/) are two thin edges over it; neither imports the other,
neither reaches the fleet, the spool or the fan-out but through a verb here (an import
contract, and tests/unit/repo/test_doors.py for attribute reaches), and nothing here knows
which door a request came through.

Tenant scope is applied here, once for both doors (tenants.py): a publication's name is the
caller's own (`Scope.own`), its quotas asked before a byte is taken, its audit line written
however it ends, and its answer and refusals in the caller's words (`Scope.scrub`).

Invariants: the proxy answers every accepted request exactly once, complete or with an
error status, within its deadline (routing/failover.py); a refusal decided by a replica reaches
the client unchanged (routing/passthrough.py); every request is counted once (accounting.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import grpc

from rollwire.common.errors import FailedPrecondition, RollwireError
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.common.reasons import Reason
from rollwire.common.signing import SignatureFile
from rollwire.proxy.accounting import RequestRecord
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.publish.fanout import FanOut
from rollwire.proxy.publish.loads import Loaded, Loads
from rollwire.proxy.publish.peers import Peers
from rollwire.proxy.routing.coalesce import Coalescer
from rollwire.proxy.routing.dispatch import Dispatcher
from rollwire.proxy.routing.failover import GroupRun
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.routing.score import ScoreRun, check_score
from rollwire.proxy.routing.sessions import SessionTurns
from rollwire.proxy.routing.shares import check_spool_quota, upload_room
from rollwire.proxy.spool import Spool
from rollwire.proxy.tenants import FLEET, Scope, audit
from rollwire.runtime.security import ADMIN, GENERATE, TokenAuth, require_peer, require_stage_only
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


class Caller(NamedTuple):
    """Who calls a verb: its token's role and the names it sees (tenants.Scope)."""

    role: str
    scope: Scope


class ProxyCore:
    """What both doors call: `group_events` (one group admitted and run), `account` (its record
    in the metrics), `score`, `push`, `load`, `unload` and `status` (the fleet as one replica)."""

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
        self.loads = Loads(config, state.fanout, state.peers, self._admit, self._fleet_model)
        """Publishing by name: the load, lineage and unload rules (publish/loads.py)."""
        self._folder_fingerprint = ""

    def account(self, *, edge: bool = False) -> RequestRecord:
        """A generation request's record in the core metrics, whichever door it came by: the
        HTTP door opens one per request as gRPC's Generate does (accounting.py)."""
        return RequestRecord(self.state.metrics, edge=edge)

    def caller(self, metadata) -> Caller:
        """The role of a call's token and the names it sees (tenants.py): admin and the fleet's
        where auth is off, as every call is."""
        auth = self.state.auth
        grant = auth.grant(metadata) if auth is not None else None
        if grant is None:
            return Caller(ADMIN if auth is None else GENERATE, Scope())
        return Caller(grant.role, Scope(grant.tenant))

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

    # -- publishing ---------------------------------------------------------------------------
    async def push(
        self,
        caller: Caller,
        messages: AsyncIterator[pb.PushAdapterRequest],
        rid: str,
        metadata,
        send_metadata: Callable[[tuple], Awaitable[None]] | None = None,
    ) -> pb.PushAdapterResponse:
        """A version pushed: received (bounded, idle-timed, checked as a replica would), relayed
        as it arrives, staged everywhere and committed (publish/fanout.py); or, marked by a peer
        proxy (`metadata`), a peer's copy spooled with no fan-out (publish/peers.py, the peer role
        only). The caller's tenant owns the name and pays its quotas from the manifest on."""
        origin = Peers.origin(metadata)
        if origin and self.state.peers is not None:
            require_peer(self.state.auth, caller.role)
            return await self.state.peers.receive(messages, origin, rid)
        require_stage_only(caller.role, False)  # a relay or peer token publishes nothing
        named = _Named(messages, caller.scope, self._admit)
        try:
            reply = await self.state.fanout.push(named.each(), rid, send_metadata=send_metadata)
        except RollwireError as err:
            if named.name:  # refused once its name was known: audited
                self._audit(caller, "push", named.name, named.version, err)
            err.message = caller.scope.scrub(err.message)
            raise
        self._audit(caller, "push", reply.name, reply.version, None)
        return _reply_shown(reply, caller.scope)

    async def load(
        self,
        caller: Caller,
        action: str,
        asked: str,
        named: Callable[[], tuple[str, int]],
        files: Callable[[], Awaitable[tuple[LoraShape, bytes, SignatureFile | None]]],
        rid: str,
    ) -> Loaded:
        """A version published by name. The door's part: `named()`, its naming of the version
        the caller `asked` for (e.g. vLLM's NAME-vN): name and version (0: the next); `files()`,
        the adapter's LoRA shape, payload and signature, read and checked. The name is the
        caller's own, published by the load and lineage rules (publish/loads.py), audited as
        `action` however it ends (a refusal of the door's own included), answered in the caller's words."""
        held = asked
        try:
            name, version = named()
            held = caller.scope.own(name)
            lora, payload, signed = await files()
            loaded = await self.loads.load(held, version, lora, payload, rid, signed)
        except RollwireError as err:
            self._audit(caller, action, held, 0, err)
            err.message = caller.scope.scrub(err.message)
            raise
        self._audit(caller, action, loaded.lineage, loaded.version, None)
        return _loaded_shown(loaded, caller.scope)

    async def unload(self, caller: Caller, asked: str, read: Callable[[], tuple[str, int]]) -> tuple[str, list[int]]:
        """A version of the caller's name (`read()`, the door's naming of `asked`: name and version, 0
        for every version of its lineage) never served again (publish/loads.py); the versions
        unloaded (and the name as the fleet holds it), audited however it ends. NOT_FOUND ADAPTER_NOT_FOUND for what the fleet never had."""
        held = asked
        try:
            name, version = read()
            held = caller.scope.own(name)
            versions = await self.loads.unload(held, version, asked)
        except RollwireError as err:
            self._audit(caller, "unload", held, 0, err)
            err.message = caller.scope.scrub(err.message)
            raise
        self._audit(caller, "unload", held, versions, None)
        return held, versions

    def is_hidden(self, name: str, version: int) -> bool:
        """Was this version of the fleet's `name` unloaded (0: every version the fleet has)?"""
        return self.loads.is_hidden(name, version)

    def listing(self, status: pb.GetStatusResponse, scope: Scope) -> list[tuple[str, int, str]]:
        """(name as held, version, name as `scope` sees it) of every version a listing shows:
        what `status` (unscoped) serves and the loads answered at "spooled" (served once
        committed), less earlier lineages, unloaded versions and other tenants'; a tenant sees
        what passed a spool, as GetStatus shows it."""
        spool = self.state.spool
        served = {(a.name, v) for a in status.adapters for v in a.versions if not scope.tenant or spool.get(a.name, v)}
        out = []
        for name, version in sorted(served | self.state.replicas.answered):
            external = self.loads.external(name, version)
            shown = scope.shown(external) if external is not None else None
            if shown is not None:
                out.append((name, version, shown))
        return out

    def upload_room(self, scope: Scope, arriving: int) -> int:
        """The bytes of adapter weights the spool could take from `scope`'s tenant now, less
        `arriving` (its other uploads in flight at a door): routing/shares.upload_room."""
        return upload_room(self.state.dispatcher.shares, self.state.spool, scope.tenant, arriving)

    async def prove(self) -> None:
        """Re-check every replica's versions now (publish/proof.py)."""
        await self.state.fanout.proofs.prove_all()

    def fleet_health(self) -> tuple[bool, str]:
        """Is some replica routable, and what each replica is doing (for an admin's eyes)."""
        replicas = self.state.replicas
        return bool(replicas.routable()), replicas.describe()

    def _admit(self, manifest: pb.AdapterManifest) -> None:
        """A publication's tenant quotas, asked before a byte is taken (routing/shares.py)."""
        state = self.state
        check_spool_quota(state.dispatcher.shares, state.spool, state.config.spool.keep_versions, manifest)

    def _audit(self, caller: Caller, action: str, name: str, version: int | list[int], err) -> None:
        audit(self.state.metrics.tenant_publishes, caller.scope, caller.role, action, name, version, err)

    async def _fleet_model(self) -> str:
        """The base model a load (a PEFT folder, which names none we can trust) is pushed for:
        the fleet's own (fleet/basemodel.py: declared, or agreed by the spool), else the one of
        the model folder the operator gave the door (http.model_path, fingerprinted once, off the
        event loop); never one a member reports."""
        folder = self.state.config.http.model_path
        if folder and not self._folder_fingerprint:
            self._folder_fingerprint = await asyncio.to_thread(model_fingerprint, folder)
        fingerprint = self.state.replicas.base.fingerprint or self._folder_fingerprint
        if fingerprint:
            return fingerprint
        raise FailedPrecondition(
            "this proxy does not know its fleet's base model yet (nothing declared, nothing spooled), and never takes "
            "it from a replica; set base_model in the proxy's config to the fingerprint the replicas serve "
            "(`rollwire status` shows it) or http.model_path to the base model's folder, or push a first version over "
            "gRPC; nothing was applied",
            reason=Reason.BASE_MODEL_UNKNOWN,
        )

    # -- the fleet as one replica -------------------------------------------------------------
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


class _Named:
    """A push's messages, its manifest's name qualified for the caller's tenant (a name a
    tenant may not give, or a version over its spool quotas, is refused by the reader's first
    read, before any byte is taken)."""

    def __init__(
        self,
        messages: AsyncIterator[pb.PushAdapterRequest],
        scope: Scope,
        admit: Callable[[pb.AdapterManifest], None],
    ) -> None:
        self.messages, self.scope, self.admit = messages, scope, admit
        self.name, self.version = "", 0
        """The fleet's name and the version of the push, once its manifest was read."""

    async def each(self) -> AsyncIterator[pb.PushAdapterRequest]:
        first = True
        async for message in self.messages:
            if first and message.WhichOneof("part") == "manifest":
                message.manifest.name = self.scope.own(message.manifest.name)
                self.name, self.version = message.manifest.name, message.manifest.version
                self.admit(message.manifest)
            first = False
            yield message


def _reply_shown(reply: pb.PushAdapterResponse, scope: Scope) -> pb.PushAdapterResponse:
    """A push's reply in a tenant's words: its own name unqualified, no replica's address."""
    if scope.tenant:
        reply.name = scope.shown(reply.name) or ""
        for result in reply.replicas:
            result.message, result.address = scope.scrub(result.message), ""
    return reply


def _loaded_shown(loaded: Loaded, scope: Scope) -> Loaded:
    """A load's answer in a tenant's words: its own names unqualified, every other `A:B` hidden."""
    if not scope.tenant:
        return loaded
    scrub = scope.scrub
    replicas = [
        pb.ReplicaPushResult(replica=scrub(r.replica), code=r.code, message=scrub(r.message), reason=r.reason)
        for r in loaded.replicas
    ]
    return dataclasses.replace(
        loaded,
        name=scrub(loaded.name),
        lineage=scrub(loaded.lineage),
        earlier_failure=scrub(loaded.earlier_failure),
        replicas=replicas,
    )
