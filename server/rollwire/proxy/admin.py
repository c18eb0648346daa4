"""AdminService, the proxy's third door (gRPC, beside servicer.py and http/): for operators,
registering replicas and peer proxies; which generator replicas the proxy routes to (fleet/).

Invariants: registering an address twice refreshes it (a heartbeat) and never duplicates
it; a heartbeat of a replica refused membership (another base model, fleet/replicas.py) removes it
and is refused with FAILED_PRECONDITION (BASE_MODEL_MISMATCH) naming it; a new replica takes work only after the catch-up (fleet/replicas.py); deregistering cuts
its live groups off, and their runs restart them elsewhere; draining stops new work and
returns only when the replica has no group left, so a drain loses nothing.

Who may register: a `register` token registers, drains and removes only its own address (the
host must resolve to the caller's own IP address) with a ttl in 1..registration.max_ttl_s, so
it lapses unless it keeps beating; only an admin may register for good (ttl 0) or for another
address. A `register` token acts only on the members it added itself (`Replica.registrant`, the
token's identity): never on a static, discovered or admin-registered replica, nor on one another
register token added, whatever host they share; to that role an address it did not add is
NOT_FOUND in one sentence that lists no member. A registration that would take the proxy past registration.max_members is refused.
A `register` token adds a new address only once the process listening there proved, called back,
that it holds the fleet key and advertises that very HOST:PORT (runtime/members.py): otherwise
PERMISSION_DENIED (MEMBER_UNPROVEN), counted in `member_refusals_total{why="unproven"}`. Such a
member is dialled with its own member token, never the proxy's admin token, and serves only
after its canary (fleet/canary.py).

ProveAdapters re-checks every version that has a probe on every routable replica now (publish/proof.py's
ProofBook.prove_all, handed in) and answers the replicas with their proofs; an admin's call.

ShareLineages is not about replicas: a peer proxy's lineage map, from the `peer` role only
(security.PEER_ONLY, checked before the handler), merged by publish/peers.py (`Peers.receive_lineages`, handed in by app.py
as ProofBook.prove_all is, so this door stays a thin edge).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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
from rollwire.common.manifest import NAME_RULE, QUALIFIED_RE
from rollwire.common.reasons import Reason
from rollwire.proxy.config import RegistrationSection
from rollwire.proxy.fleet.replica import Replica
from rollwire.proxy.fleet.replicas import ReplicaSet
from rollwire.runtime.dialing import bearer
from rollwire.runtime.hosts import peer_ip, resolve_ips
from rollwire.runtime.logs import get_logger
from rollwire.runtime.members import CHALLENGE_KEY, PROOF_KEY, new_challenge, proof_matches
from rollwire.runtime.security import REGISTER, TokenAuth, caller_identity, caller_role
from rollwire.v1 import admin_pb2 as apb
from rollwire.v1 import admin_pb2_grpc, generator_pb2_grpc
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
LineagesReceiver = Callable[[apb.ShareLineagesRequest, object], Awaitable[apb.ShareLineagesResponse]]
"""Merges a peer's lineage map, given the call's metadata (publish/peers.py, Peers.receive_lineages)."""
Prover = Callable[[str], Awaitable[list[Replica]]]
"""Re-checks every version with a probe on every routable replica, of one name or all (publish/proof.py,
ProofBook.prove_all); handed in: the fleet imports no publishing."""


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self,
        replicas: ReplicaSet,
        limits: RegistrationSection | None = None,
        auth: TokenAuth | None = None,
        lineages: LineagesReceiver | None = None,
        prove: Prover | None = None,
    ) -> None:
        self.replicas, self.limits, self.auth = replicas, limits or RegistrationSection(), auth
        self.lineages, self.prove = lineages, prove

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
        member = caller_role(self.auth, context) == REGISTER
        if member and known is not None and known.registrant != _identity(context):
            return await _abort(
                context,
                PermissionDenied(
                    f"{request.address} is a member this register token did not add; a register token refreshes, "
                    "drains and removes only the members it registered itself (an admin token manages the others)",
                    reason=Reason.NOT_OWN_ADDRESS,
                ),
            )
        if member and known is None:
            try:
                await self._prove(request.address)
            except RollwireError as err:
                self.replicas.metrics.member_refusals.labels("unproven").inc()
                log.warning("registration_unproven", address=request.address, why=err.message)
                return await _abort(context, err)
        replica, created = self.replicas.add(request.address, "registered", request.ttl_seconds or None, member)
        if created and member:
            replica.registrant = _identity(context)
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
        caller's IP address (and a new address's port proves itself: `_prove`)."""
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

    async def _prove(self, address: str) -> None:
        """Call `address` back with a challenge: whoever listens there must answer with the proof
        for that very address, which only a holder of the fleet key advertising it can compute."""
        key = self.replicas.member_key
        if key is None:
            raise PermissionDenied(
                "this proxy takes no registration by a register token: set upstream.member_key_file here and "
                "auth.member_key_file on the replicas to the same fleet key (docs/deploy.md, Security), or "
                "register with an admin token",
                reason=Reason.MEMBER_UNPROVEN,
            )
        nonce, answer, why = new_challenge(), "", ""
        channel = self.replicas.upstream.channel(address)
        try:
            call = generator_pb2_grpc.GeneratorServiceStub(channel).GetStatus(
                pb.GetStatusRequest(),
                timeout=self.replicas.config.health.timeout_s,
                metadata=((CHALLENGE_KEY, nonce), *bearer(self.replicas.member_token(address, registered=True))),
            )
            answer = next((str(v) for k, v in await call.initial_metadata() or () if k == PROOF_KEY), "")
            await call
        except grpc.aio.AioRpcError as exc:
            why = f"calling it back failed with {exc.code().name}"
        finally:
            await channel.close(grace=None)
        if not why and not proof_matches(key, address, nonce, answer):
            why = "what listens there did not answer the challenge with the proof for that address"
        if why:
            raise PermissionDenied(
                f"{address} did not prove it is a replica of this fleet advertising that address ({why}); a replica "
                "registers the address it listens on (registration.advertise), with auth.member_key_file set to "
                "this proxy's upstream.member_key_file",
                reason=Reason.MEMBER_UNPROVEN,
            )

    async def DeregisterGenerator(
        self, request: apb.DeregisterGeneratorRequest, context
    ) -> apb.DeregisterGeneratorResponse:
        await self._owned_member(request.address, context)
        restarted = await self.replicas.remove(request.address, "deregistered by an admin")
        return apb.DeregisterGeneratorResponse(restarted=restarted)

    async def ListGenerators(self, request: apb.ListGeneratorsRequest, context) -> apb.ListGeneratorsResponse:
        return apb.ListGeneratorsResponse(replicas=[r.status() for r in self.replicas.all()])

    async def DrainGenerator(self, request: apb.DrainGeneratorRequest, context) -> apb.DrainGeneratorResponse:
        await self._owned_member(request.address, context)
        replica = await self.replicas.drain(request.address)
        status = replica.status()
        if request.deregister:
            await self.replicas.remove(request.address, "drained and deregistered")
        log.info("replica_drained", replica=request.address, deregistered=request.deregister)
        return apb.DrainGeneratorResponse(replica=status)

    async def ShareLineages(self, request: apb.ShareLineagesRequest, context) -> apb.ShareLineagesResponse:
        try:
            if self.lineages is None:  # the role was checked: security.PEER_ONLY
                raise PermissionDenied(
                    "this server takes no lineage map from peers; ShareLineages is for routing proxies",
                    reason=Reason.NO_ROLE,
                )
            return await self.lineages(request, context.invocation_metadata())
        except RollwireError as err:
            return await _abort(context, err)

    async def ProveAdapters(self, request: apb.ProveAdaptersRequest, context) -> apb.ProveAdaptersResponse:
        """Re-check now (publish/proof.py); the replicas checked, with their proofs."""
        try:
            if request.name and not QUALIFIED_RE.fullmatch(request.name):
                raise InvalidArgument(
                    f"adapter name {request.name[:80]!r} is invalid: use {NAME_RULE} (a tenant's as TENANT:NAME)",
                    reason=Reason.BAD_ADAPTER_NAME,
                )
            checked = await self.prove(request.name) if self.prove is not None else []
        except RollwireError as err:
            return await _abort(context, err)
        return apb.ProveAdaptersResponse(replicas=[r.status() for r in checked])

    async def _owned_member(self, address: str, context) -> None:
        """Abort unless the caller may act on `address` (an admin, or its own member) and it is
        registered here: the one preamble of Deregister and Drain, so both refuse alike."""
        try:
            await self._own(address, context)
        except RollwireError as err:
            await _abort(context, err)
        found = self._find(address)
        if caller_role(self.auth, context) == REGISTER and (found is None or found.registrant != _identity(context)):
            await _abort(  # the same answer whether it is absent or another's: a register token learns no member
                context,
                NotFound(
                    f"no replica {address!r} was registered here with this register token; it drains and removes "
                    "only the members it added itself",
                    reason=Reason.UNKNOWN_REPLICA,
                ),
            )
        if found is None:
            await _abort(context, self._unknown(address))

    def _find(self, address: str) -> Replica | None:
        return self.replicas.get(address)

    def _unknown(self, address: str) -> NotFound:
        """An admin's NOT_FOUND, naming the members (ListGenerators shows them to that role anyway)."""
        known = ", ".join(r.address for r in self.replicas.all()) or "none"
        return NotFound(
            f"no replica {address!r} is registered here (known: {known}); ListGenerators shows them",
            reason=Reason.UNKNOWN_REPLICA,
        )


def _identity(context) -> str:
    """The calling token's identity (a hash prefix, never the token)."""
    return caller_identity(context.invocation_metadata(), context.peer(), True)


async def _abort(context: grpc.aio.ServicerContext, err: RollwireError) -> NoReturn:
    await context.abort_with_status(to_status(err))  # pyright: ignore[reportAttributeAccessIssue]  # grpc.aio has it; its stubs do not
    raise AssertionError("abort_with_status returns only by raising")
