"""The replica's push intake: PushAdapter and CommitAdapter on one replica.

A push is read with the push package (rollwire.push: `PushReader`, hashed and its tensors
checked against the base model as it arrives; a stripe joins its version's `Assembly`); with
a relay plan every chunk is forwarded to the children while it is received (`Forwarder`);
this replica's own verified copy is then staged (`stage_only`) or served by the registry.

Invariants:
- nothing is served, or staged, before every check passed on this replica's own bytes;
- with trust.keys_file set, a version is admitted only with a valid signature by a trusted key
  (common.signing: checked at the opening, before a chunk is read or forwarded);
- a push takes a slot (`PushSlots`, limits.max_concurrent_pushes) before its manifest is
  judged, and gives it back on every exit; a stripe of a version being assembled shares the
  assembly's slot; what its opening asks of this replica alone (caller, grant, loop, relay
  plan's shape) is refused before it takes one, so a busy replica answers it the same; a
  tenant's pushes take at most all but one slot, and a push's bytes must all be in within
  its total deadline (limits.upload_timeout_s + its size at limits.min_upload_bytes_per_s),
  so a stalled or trickling sender frees its slot;
- the reply carries this replica's outcome and its subtree's (in `replicas`, or beside the
  refusal's ErrorInfo), whatever happened here;
- a replica relays only when relay.enabled, only to nodes its proxy granted (auth on), never
  to itself or along a path that came through it (RELAY_PATH_KEY), with a relay token, and
  within what is left of its own push's deadline;
- a stripe stream that ends before the payload is whole answers `stripe_pending`, not a
  verdict; one that fails leaves the version incomplete here (its sender reports why, and
  the proxy heals it).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import structlog

from rollwire.common.addresses import split_address
from rollwire.common.errors import FailedPrecondition, PermissionDenied, RollwireError, clip, to_status
from rollwire.common.manifest import Manifest, check_commit, check_manifest, manifest_from_pb
from rollwire.common.reasons import Reason
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.config import GeneratorConfig
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.push.assembly import Assembly, PushSlots, check_stripe
from rollwire.push.bulk import BulkDial, BulkListener
from rollwire.push.channels import ChannelPool
from rollwire.push.checks import PayloadInspector
from rollwire.push.forward import Forwarder
from rollwire.push.plan import Child, grant_key, is_granted, split_plan, unplanned
from rollwire.push.reader import Opening, PushReader, total_deadline
from rollwire.push.results import status_with_results
from rollwire.runtime.hosts import is_local_ip, resolve_ips
from rollwire.runtime.logs import REQUEST_ID_KEY, get_logger, request_id_from
from rollwire.runtime.security import RELAY, TokenAuth, caller_role, require_stage_only
from rollwire.serving.dial import Dialer
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
RELAY_PATH_KEY = "x-rollwire-relay-path"
"""Metadata of a relayed push: the instance ids of the replicas it came through, so one that a
plan leads back to (through any alias of its address) refuses it before taking a slot."""


@dataclass(eq=False)
class _Stream:
    """One PushAdapter call's state, released on every exit."""

    reader: PushReader
    start: float
    code: grpc.StatusCode = grpc.StatusCode.OK
    role: str = ""
    forward: Forwarder | None = None
    subtree: list[pb.ReplicaPushResult] = field(default_factory=list)
    admitted: bool = False
    """It holds a plain push's slot."""
    assembly: Assembly | None = None
    """The assembly its stripe feeds, until its stripe is in (then what happens spoils nothing)."""
    attached: Assembly | None = None
    """The assembly this stream keeps alive while it is open."""
    children: list[Child] = field(default_factory=list)
    """Its relay plan's children, checked at the opening (push.plan.split_plan)."""


class PushIntake:
    """PushAdapter and CommitAdapter of one replica, over its adapter registry."""

    def __init__(
        self,
        config: GeneratorConfig,
        registry: AdapterRegistry,
        metrics: GeneratorMetrics,
        *,
        fingerprint: str,
        base_shapes: dict[str, tuple[int, int]],
        auth: TokenAuth | None,
        port: int,
        check_probe: Callable[[Manifest], None] | None = None,
    ) -> None:
        self.config, self.registry, self.metrics = config, registry, metrics
        self.check_probe = check_probe
        """Refuses a probe this replica's engine could never score (proof.py), before any byte is read."""
        self.fingerprint, self.base_shapes, self.auth, self.port = fingerprint, base_shapes, auth, port
        lim = config.limits
        self.slots = PushSlots(lim.max_concurrent_pushes, lim.stripe_linger_s, metrics.push_slots.set)
        # channels to relay children and their token; a file that cannot be read fails at start
        dialer = Dialer.from_config(config.relay, "relay", config.keepalive.keepalive())
        self._channels, self._relay_token = ChannelPool(dialer), dialer.metadata
        self.instance = secrets.token_hex(8)
        """This process's id in RELAY_PATH_KEY."""
        self.trust = config.trust.trusted()
        """The signing keys a version must be signed by (none: not required); checked at every opening."""
        self.bulk = BulkListener(config.host, config.bulk, config.tls) if config.bulk.enabled else None
        """This replica's bulk endpoint (push bytes over a connection of their own), when enabled."""
        self.bulk_dial = BulkDial.from_config(config.bulk, config.relay, self._count_path)
        """How it sends its relay children their bytes over theirs (None: gRPC chunks only)."""

    async def push(self, messages, context: grpc.aio.ServicerContext) -> pb.PushAdapterResponse:
        """One PushAdapter call: admit, relay, receive, then stage or serve (or refuse)."""
        structlog.contextvars.bind_contextvars(request_id=request_id_from(context.invocation_metadata()))
        stream = _Stream(PushReader(messages, self.config.limits.push_idle_timeout_s, "replica"), time.monotonic())
        try:
            first, manifest = await self._admit(stream, context)
            async with total_deadline(stream.reader, self.config.limits.upload_deadline_s(manifest.byte_length)):
                if first.relay.nodes:
                    stream.forward = await self._relay(first, stream.children, context, stream.role)
                # a bulk stripe lands in its assembly's one buffer, ready before the offer
                into = (
                    await stream.assembly.ready() if stream.assembly is not None and first.bulk and self.bulk else None
                )
                await stream.reader.agree(first, self.bulk, context.send_initial_metadata, into)
                await self._receive(stream, first, manifest)
            if stream.assembly is not None and first.stripe is not None and not stream.assembly.end(first.stripe.index):
                stream.assembly = None  # its stripe is in: what happens to this call now spoils nothing
                return await self._stripe_received(stream, first)
            return await self._keep(stream, first, manifest)
        except RollwireError as err:
            stream.code = err.code
            await self._refuse(stream, err, context)
            raise AssertionError("unreachable: abort_with_status raises") from err
        except asyncio.CancelledError:
            stream.code = grpc.StatusCode.CANCELLED
            self._give_up(stream)
            if stream.forward is not None:
                stream.forward.abort("its parent's push was cancelled")
            raise
        finally:
            self._close(stream)

    async def _admit(self, stream: _Stream, context: grpc.aio.ServicerContext) -> tuple[Opening, Manifest]:
        """The opening, judged: caller, loop, a slot (or the assembly's), manifest, version;
        a stripe joins its version's assembly."""
        lim = self.config.limits
        first = await stream.reader.open()
        manifest = manifest_from_pb(first.manifest)
        stream.role = caller_role(self.auth, context)
        require_stage_only(stream.role, first.stage_only)
        self._require_grant(first, stream.role)
        self._refuse_loop(context)
        if first.relay.nodes:  # a malformed plan is refused as such, busy or not, before a slot is taken
            stream.children = self._plan(first)
        joining = None
        if first.stripe is not None:
            check_stripe(first.stripe, stage_only=first.stage_only)
            joining = self.slots.assembly_of(first.manifest)
        if joining is None:  # a stripe of a version being assembled shares its slot
            self.slots.admit(first.manifest.name)
            stream.admitted = True
        check_manifest(manifest, fingerprint=self.fingerprint, max_bytes=lim.max_adapter_bytes)
        self.trust.check(first.manifest)  # every route (push, relay, heal, catch-up) opens here
        if self.check_probe is not None:
            self.check_probe(manifest)
        self.registry.check_version(manifest, lim.max_version_step)
        if first.stripe is not None:
            if joining is None:
                inspector = PayloadInspector(manifest, self.base_shapes)
                pool = self.bulk.pool if self.bulk is not None else None
                joining = self.slots.assemble(first.manifest, first.stripe, inspector, pool)
                stream.admitted = False  # the assembly holds the slot now
            joining.join(first.stripe)  # a conflicting stripe is refused here, leaving the assembly alone
            stream.assembly = stream.attached = joining
            self.slots.attach(joining)
        return first, manifest

    async def _receive(self, stream: _Stream, first: Opening, manifest: Manifest) -> None:
        """Every chunk: counted, checked (or fed to the assembly) and forwarded at once."""
        forward = stream.forward
        try:
            if stream.assembly is not None and first.stripe is not None:
                # over the bulk path, one reading thread per stripe receives, lands and forwards its chunks
                await stream.reader.take_stripe(first.stripe, stream.assembly, forward, self.metrics.push_bytes.inc)
            else:  # over the bulk path, one reading thread receives, checks and forwards every piece
                inspector = PayloadInspector(manifest, self.base_shapes)
                await stream.reader.take(inspector, forward, self.metrics.push_bytes.inc)
        except BaseException as exc:
            if forward is not None:
                forward.abort(f"its parent's upload failed: {exc}"[:300])
            raise
        if forward is not None:
            forward.end()  # the children judge the bytes they got on their own

    async def _keep(self, stream: _Stream, first: Opening, manifest: Manifest) -> pb.PushAdapterResponse:
        """The verified payload staged or served; the reply with the subtree's outcomes."""
        lim, assembly = self.config.limits, stream.assembly
        # length, digest, header, finiteness: checked as the bytes came; an assembly holds its slot until staged
        payload = await assembly.finish() if assembly is not None else await stream.reader.finish()
        if first.manifest.sha256 != manifest.sha256:  # left to this replica, named by the verdict (push.digests)
            manifest = manifest_from_pb(first.manifest)
        keep = self.registry.stage if first.stage_only else self.registry.push
        outcome = await keep(manifest, payload, lim.max_version_step)
        del payload
        # this push's assembly, or a stale one of the same version (a heal's plain push replaces it)
        self.slots.release(self.slots.assembly_of(first.manifest))
        self.metrics.set_adapters(self.registry.loaded())
        if stream.forward is not None:
            stream.subtree = await stream.forward.results()
        log.info(
            "adapter_staged" if outcome.staged else "adapter_pushed",
            adapter=manifest.name,
            version=manifest.version,
            bytes=manifest.byte_length if assembly is not None else stream.reader.received,
            path=stream.reader.path,
            stripes=assembly.count if assembly is not None else 1,
            already_loaded=outcome.already_loaded,
            relayed_to=len(stream.subtree),
            seconds=round(time.monotonic() - stream.start, 4),
        )
        return pb.PushAdapterResponse(
            name=outcome.name,
            version=outcome.version,
            already_loaded=outcome.already_loaded,
            loaded_versions=outcome.loaded_versions,
            replicas=stream.subtree,
            staged=outcome.staged,
            sha256=manifest.sha256,
        )

    async def _stripe_received(self, stream: _Stream, first: Opening) -> pb.PushAdapterResponse:
        """The answer of a stripe stream that ended before the payload was whole: not a verdict."""
        subtree = await stream.forward.results() if stream.forward is not None else []
        assert first.stripe is not None
        log.info(
            "adapter_stripe_received",
            adapter=first.manifest.name,
            version=first.manifest.version,
            stripe=first.stripe.index,
            stripes=first.stripe.count,
            path=stream.reader.path,
            relayed_to=len(subtree),
            seconds=round(time.monotonic() - stream.start, 4),
        )
        return pb.PushAdapterResponse(
            name=first.manifest.name, version=first.manifest.version, replicas=subtree, stripe_pending=True
        )

    async def _refuse(self, stream: _Stream, err: RollwireError, context: grpc.aio.ServicerContext) -> None:
        """End the call with `err`, carrying the subtree's outcomes."""
        self._give_up(stream)
        if stream.forward is not None and not stream.subtree:
            stream.subtree = await stream.forward.results()
        log.info(
            "adapter_push_refused", code=err.code.name, reason=err.reason, error=err.message, path=stream.reader.path
        )
        await context.abort_with_status(status_with_results(err, stream.subtree))  # pyright: ignore[reportAttributeAccessIssue]  # grpc's stubs lack it; it exists at run time

    def _give_up(self, stream: _Stream) -> None:
        """The version cannot complete through this stream's assembly (refused bytes failed it already)."""
        if stream.assembly is not None:
            stream.assembly.fail(None)
            self.slots.release(stream.assembly)

    def _close(self, stream: _Stream) -> None:
        stream.reader.close()
        if stream.admitted:
            self.slots.free(stream.reader.manifest.name if stream.reader.manifest is not None else "")
        if stream.attached is not None:
            self.slots.detach(stream.attached)
        self.metrics.pushes.labels(stream.code.name).inc()
        self.metrics.push_latency.observe(time.monotonic() - stream.start)
        structlog.contextvars.unbind_contextvars("request_id")

    def _refuse_loop(self, context: grpc.aio.ServicerContext) -> None:
        """A push that already came through this replica (a plan that leads back to it)."""
        path = next((v for k, v in context.invocation_metadata() or () if k == RELAY_PATH_KEY), "")
        if self.instance in str(path).split(","):
            raise FailedPrecondition(
                "this push was relayed through this replica already: its relay plan leads back to it; "
                "a proxy plans each replica once, by one address",
                reason=Reason.RELAY_LOOP,
            )

    def _plan(self, first: Opening) -> list[Child]:
        """The plan's children: FAILED_PRECONDITION where this replica does not relay,
        INVALID_ARGUMENT (BAD_RELAY_PLAN) for a malformed plan (push.plan.split_plan)."""
        relay = self.config.relay
        if not relay.enabled:
            raise FailedPrecondition(
                "this replica does not relay pushes (relay.enabled is false); push to it without a relay plan",
                reason=Reason.RELAY_DISABLED,
            )
        return split_plan(first.relay, max_children=relay.max_children)

    async def _relay(
        self, first: Opening, children: list[Child], context: grpc.aio.ServicerContext, role: str
    ) -> Forwarder:
        """Open a stream to each child of the plan, once every node is one the proxy granted
        (auth on) and no child is this replica; a relay token (never an admin token) and the
        request id travel with them, and their deadline is what is left of this push's own."""
        relay = self.config.relay
        await self._check_children(first, children)
        remaining = context.time_remaining()
        return Forwarder(
            children,
            first.manifest,
            stage_only=first.stage_only,
            stub_for=self._channels.stub,
            metadata=self._relay_metadata(context, role),
            deadline=time.monotonic() + (relay.timeout_s if remaining is None else remaining),
            queue_chunks=relay.queue_chunks,
            stall_s=relay.stall_timeout_s,
            settle_s=relay.settle_timeout_s,
            stripe=first.stripe,
            bulk=self.bulk_dial if first.bulk else None,  # a hop asks only when its own sender asked
        )

    def _count_path(self, path: str, reason: str) -> None:
        self.metrics.push_paths.labels(path, reason).inc()

    def _grant_keys(self) -> list[bytes]:
        assert self.auth is not None
        return [grant_key(d) for d in self.auth.admin_digests()]

    def _require_grant(self, first: Opening, role: str) -> None:
        """A relay token's push (auth on) must carry this replica's grant for its manifest: a
        relaying parent passes on only the version (name, version, digest) the proxy planned.
        Admin callers (the proxy's own heal and catch-up) need none."""
        if self.auth is None or role != RELAY:
            return
        if first.granted is None or not is_granted(first.granted, self._grant_keys(), first.manifest):
            m = first.manifest
            raise PermissionDenied(
                f"this relayed push of {clip(m.name)} v{m.version} carries no grant of the proxy for that version "
                "and digest; a replica takes from a relay only the version its proxy planned: push through the proxy",
                reason=Reason.RELAY_NOT_PLANNED,
            )

    async def _check_children(self, first: Opening, children) -> None:
        """PERMISSION_DENIED for a node the proxy did not grant (auth on); FAILED_PRECONDITION
        for a child that is this replica."""
        if self.auth is not None:
            keys = self._grant_keys()
            if (address := unplanned(first.relay, keys, first.manifest)) is not None:
                raise PermissionDenied(
                    f"the relay plan names {address}, which this push's proxy did not plan (no valid grant); "
                    "a replica relays only to the members its proxy planned: push through the proxy",
                    reason=Reason.RELAY_NOT_PLANNED,
                )
        for child in children:
            if await self._is_self(child.address):
                raise FailedPrecondition(
                    f"the relay plan names {child.address}, which is this replica itself; "
                    "a replica never relays to itself",
                    reason=Reason.RELAY_LOOP,
                )

    def _relay_metadata(self, context: grpc.aio.ServicerContext, role: str) -> list[tuple[str, str]]:
        """The request id, the relay path with this replica on it, and (auth on: the grants were
        checked, so the children are planned members) the relay token, or a relayed caller's own."""
        incoming = context.invocation_metadata() or ()
        path = next((str(v) for k, v in incoming if k == RELAY_PATH_KEY), "")
        metadata = [(k, v) for k, v in incoming if k == REQUEST_ID_KEY and isinstance(v, str)]
        metadata.append((RELAY_PATH_KEY, f"{path},{self.instance}" if path else self.instance))
        if self.auth is not None:
            if self._relay_token:
                metadata += self._relay_token
            elif role == RELAY:
                metadata += [(k, v) for k, v in incoming if k == "authorization" and isinstance(v, str)]
        return metadata

    async def _is_self(self, address: str) -> bool:
        """Whether `address` reaches this replica: its port, on a host that resolves to an
        address of this machine (loopback, unspecified, or one it can bind)."""
        try:
            host, port = split_address(address)
        except ValueError:
            return False  # the plan's addresses were checked already; a bad one is not this replica
        return bool(self.port) and port == self.port and any(map(is_local_ip, await resolve_ips(host)))

    async def commit(self, request: pb.CommitAdapterRequest, context) -> pb.CommitAdapterResponse:
        """Serve a version a `stage_only` push staged here, if its digest is the one named."""
        try:
            check_commit(request.name, request.version, request.sha256, request.blake3)
            outcome = await self.registry.commit(request.name, request.version, request.sha256, request.blake3)
        except RollwireError as err:
            log.info("adapter_commit_refused", code=err.code.name, reason=err.reason, error=err.message)
            await context.abort_with_status(to_status(err))
            raise AssertionError("unreachable: abort_with_status raises") from err
        self.metrics.set_adapters(self.registry.loaded())
        log.info("adapter_committed", adapter=outcome.name, version=outcome.version, again=outcome.already_loaded)
        return pb.CommitAdapterResponse(
            name=outcome.name,
            version=outcome.version,
            already_loaded=outcome.already_loaded,
            loaded_versions=outcome.loaded_versions,
        )

    async def close(self) -> None:
        """Close the relay channels and the bulk listener (at shutdown)."""
        if self.bulk is not None:
            self.bulk.close()
        await self._channels.close()
