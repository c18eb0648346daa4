"""One generator replica as the proxy sees it.

Invariants:
- a replica takes new work only while routable: it passes health checks, it serves the
  fleet's base model, it was caught up with the spool since it last (re)connected, it is not
  draining, its circuit is not open, it is vetted (a member a `register` token added passed
  its canary, canary.py) and not refused (limits under the operator's floor, a failed canary);
- a member added by a `register` token is dialled with its own member token (runtime/members.py),
  never the proxy's admin token, on every call of both its channels; with a member signing key so is
  every member (`token` set: the proxy's signature of its address);
- `versions` holds only versions the replica itself confirmed (a push reply or GetStatus),
  so version-aware routing never sends a group to a replica that lacks its version, and
  never one it holds with other bytes than the spool's (`conflicts`);
- catch-up pushes to one replica hold `push_lock`, so they reach it one at a time, oldest
  version first; a publication (publish/fanout.py) does not wait for it: a catch-up version older
  than one a publication committed is refused by the replica as already ahead, and skipped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from rollwire.common import writer
from rollwire.common.errors import RollwireError, from_rpc_error
from rollwire.proxy.fleet.breaker import Breaker
from rollwire.proxy.policies import Candidate
from rollwire.proxy.spool import SpooledAdapter
from rollwire.runtime.dialing import bearer
from rollwire.runtime.logs import REQUEST_ID_KEY
from rollwire.runtime.members import MemberToken
from rollwire.serving.dial import Dialer
from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc


@dataclass
class ReplicaCall:
    """The outcome of one PushAdapter or CommitAdapter call to one replica (the SDK's
    `PushResult` is a confirmed push, as a client sees it)."""

    replica: Replica
    code: grpc.StatusCode
    message: str = ""
    reason: str = ""
    reply: pb.PushAdapterResponse | pb.CommitAdapterResponse | None = None
    error: grpc.aio.AioRpcError | None = None

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def to_pb(self) -> pb.ReplicaPushResult:
        return pb.ReplicaPushResult(
            replica=self.replica.name,
            address=self.replica.address,
            code=self.code.name,
            message=self.message,
            reason=self.reason,
        )

    def refusal(self, retry_after_s: float) -> RollwireError:
        """The replica's refusal as an error the proxy can return to its client unchanged
        (code, sentence and reason; a retry hint where the code invites a retry)."""
        retry = self.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
        return RollwireError(
            self.message, reason=self.reason, code=self.code, retry_after_s=retry_after_s if retry else None
        )


class Attempt:
    """A group's live call on a replica, which the proxy may abandon (deregistration)."""

    def __init__(self, call) -> None:
        self.call, self.abandoned = call, ""

    def abandon(self, reason: str) -> None:
        self.abandoned = reason
        self.call.cancel()


class Replica:
    def __init__(
        self,
        address: str,
        source: str,
        breaker: Breaker,
        upstream: Dialer,
        expires_at: float | None = None,
        token: str = "",
        member: bool | None = None,
    ) -> None:
        self.address, self.source, self.breaker, self.expires_at = address, source, breaker, expires_at
        own = next((v for k, v in upstream.metadata if k == "authorization"), "")
        swap = [MemberToken(token, own)] if token else None
        self.channel = upstream.channel(address, interceptors=swap)
        self.metadata = bearer(token) if token else upstream.metadata
        """Sent on every call to the replica: its member token, else the proxy's own bearer token, if any."""
        self.member = bool(token) if member is None else member
        """Added by a `register` token: it proved its address, and is vetted by its canary before it serves."""
        self.registrant = ""
        """The identity (runtime.security.caller_identity) of the `register` token that added it: the only one
        that may refresh, drain or remove it (../admin.py); "" for a static, discovered or admin's member."""
        self.vetted = not self.member
        self.refused = ""
        """Why it is kept out of rotation although it answers (a failed canary, limits under the floor)."""
        self.generator = generator_pb2_grpc.GeneratorServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.bulk_channel = upstream.channel(address, bulk=True, interceptors=swap)
        self.bulk = generator_pb2_grpc.GeneratorServiceStub(self.bulk_channel)
        """PushAdapter streams go on their own connection (Dialer.channel), never ahead of a
        health check or a rollout; the connection opens with the first push."""
        self.identity = self.fingerprint = self.engine = ""
        self.limits: pb.Limits | None = None
        self.healthy = self.synced = self.draining = False
        self.foreign = False
        """It serves another base model than the fleet's: refused membership (replicas.py)."""
        self.detail = "not checked yet"
        self.failed_checks = 0
        self.in_flight = self.work = 0
        self.versions: dict[str, list[int]] = {}
        self.lacking = ""
        """Spooled versions it is routed without (it refused them, or catch-up gave up), in words."""
        self.conflicts: dict[tuple[str, int], str] = {}
        """(name, version) it holds with other bytes than the spool's, and its digest ("" when only
        a refusal said so): left out of `versions`, so never routed there (replicas.py)."""
        self.proofs: dict[tuple[str, int], pb.AdapterProof] = {}
        """The proxy's last re-check of each (name, version) here (publish/proof.py): its status shows them."""
        self.disproved: dict[tuple[str, int], str] = {}
        """(name, version) whose signed probe it failed, and why: left out of `versions`, so never routed there, until
        a re-check passes again."""
        self.push_lock = asyncio.Lock()
        self.attempts: set[Attempt] = set()
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.last_status = 0.0
        self.tasks: list[asyncio.Task] = []

    @property
    def name(self) -> str:
        """Identity for people: what the replica calls itself, else its address."""
        return self.identity or self.address

    def routable(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self.refused or not self.vetted:
            return False
        return self.healthy and self.synced and not self.foreign and not self.draining and self.breaker.allows(now)

    def set_versions(self, name: str, versions) -> None:
        """What the replica says it serves of `name`, less the versions it holds other bytes for or failed a signed
        probe of (publish/proof.py)."""
        self.versions[name] = [
            v for v in versions if (name, v) not in self.conflicts and (name, v) not in self.disproved
        ]

    def holds(self, name: str, version: int) -> bool:
        return version in self.versions.get(name, ())

    def newest(self, name: str) -> int:
        versions = self.versions.get(name)
        return versions[-1] if versions else 0

    def candidate(self) -> Candidate:
        return Candidate(self.address, self.in_flight, self.work)

    def state(self, now: float | None = None) -> str:
        """Why the replica does or does not take work, for status and error sentences."""
        now = time.monotonic() if now is None else now
        if self.foreign:
            return self.detail
        if self.refused:
            return f"refused: {self.refused}"
        if not self.healthy:
            return f"unhealthy: {self.detail}"
        if self.draining:
            return "draining"
        if not self.synced:
            return f"catching up: {self.detail}"
        if not self.breaker.allows(now):
            return f"ejected for {self.breaker.open_until - now:.1f}s after consecutive failures"
        return ""

    def status(self) -> pb.ReplicaStatus:
        return pb.ReplicaStatus(
            address=self.address,
            replica=self.identity,
            healthy=self.routable(),
            draining=self.draining,
            in_flight=self.in_flight,
            adapters=self._adapters_status(),
            detail=self.state() or self.lacking,
        )

    def _adapters_status(self) -> list[pb.LoadedAdapter]:
        """Its routed versions per name, with the last re-check of those and of the versions it failed."""
        names = sorted({*self.versions, *(n for n, _ in self.disproved)})
        out = []
        for n in names:
            versions = self.versions.get(n, [])
            shown = {*versions, *(v for m, v in self.disproved if m == n)}
            proofs = {v: p for (m, v), p in self.proofs.items() if m == n and v in shown}
            out.append(pb.LoadedAdapter(name=n, versions=versions, proofs=proofs))
        return out

    def abandon_all(self, reason: str) -> int:
        """Cut every live group off this replica; their runs restart them elsewhere."""
        attempts = list(self.attempts)
        for attempt in attempts:
            attempt.abandon(reason)
        return len(attempts)

    async def push(
        self, adapter: SpooledAdapter, payload: bytes, timeout: float, request_id: str, connect_within: float
    ) -> ReplicaCall:
        """Upload one spooled version (catch-up); the caller holds `push_lock`. It first waits up
        to `connect_within` for its connection to open: the replica has just answered a health
        check on its other connection, and its push connection may still be in gRPC's reconnect
        backoff after a partition healed. Failing at once there spent every catch-up attempt
        within a second (health rounds of 0.2 s), and a healthy replica was routed without the
        version until it reconnected. The wait is bounded apart from the push's own deadline
        (minutes), so a replica gone since its health check holds its monitor no longer than a
        reconnect takes; a connection still not open then fails the push at once, an attempt."""
        try:
            await asyncio.wait_for(self.bulk_channel.channel_ready(), min(connect_within, timeout))
        except TimeoutError:
            pass
        messages = writer.messages(adapter.manifest, payload)
        return await self._adapter_call(self.bulk.PushAdapter, messages, timeout, request_id)

    async def commit(self, manifest: pb.AdapterManifest, timeout: float, request_id: str) -> ReplicaCall:
        """Serve a version this replica staged (CommitAdapter with the version's digests: a replica
        staged it under its BLAKE3 when its client left the sha256 to the proxy)."""
        request = pb.CommitAdapterRequest(
            name=manifest.name, version=manifest.version, sha256=manifest.sha256, blake3=manifest.blake3
        )
        return await self._adapter_call(self.generator.CommitAdapter, request, timeout, request_id)

    async def _adapter_call(self, rpc: Any, request: Any, timeout: float, request_id: str) -> ReplicaCall:
        """PushAdapter or CommitAdapter: the reply's loaded versions are what this replica holds now."""
        try:
            metadata = ((REQUEST_ID_KEY, request_id), *self.metadata)
            reply = await rpc(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            return ReplicaCall(self, exc.code(), err.message, err.reason, error=exc)
        self.set_versions(reply.name, reply.loaded_versions)
        return ReplicaCall(self, grpc.StatusCode.OK, reply=reply)
