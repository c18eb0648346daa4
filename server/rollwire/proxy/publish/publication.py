"""One publication's state (publish/fanout.py): the version on its way and where each target stands."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from rollwire.common.errors import FailedPrecondition
from rollwire.common.reasons import Reason
from rollwire.proxy.fleet.replica import Replica, ReplicaCall
from rollwire.proxy.spool import Spool, SpooledAdapter
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


@dataclass
class Outcome:
    """Where one target stands in a publication."""

    replica: Replica
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    message: str = "not pushed: the relay did not reach it"
    reason: str = Reason.RELAY_NOT_REACHED
    direct: bool = False
    """Its last copy came straight from the proxy (a refusal of those bytes is its own verdict)."""
    healed: bool = False

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def retry_worthwhile(self) -> bool:
        """Might another copy of the same bytes succeed? Not for a version conflict or a
        base-model mismatch, a size over the replica's limit, or bytes it refused that it got
        from the proxy directly; yes for a failure of the path (a dead or stalled parent, bytes
        altered on the way, a full replica, an unreachable one, one that does not relay: it is
        planned as a leaf then)."""
        if self.ok:
            return False
        if self.code == grpc.StatusCode.FAILED_PRECONDITION:
            return self.reason == Reason.RELAY_DISABLED  # it takes the bytes as a leaf
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.reason == Reason.ADAPTER_TOO_LARGE:
            return False
        return not (self.code == grpc.StatusCode.INVALID_ARGUMENT and self.direct)


@dataclass
class Publication:
    """One version on its way: its manifest, targets, deadline and request id."""

    manifest: pb.AdapterManifest
    targets: dict[str, Replica]
    deadline: float
    request_id: str
    base_shapes: dict[str, tuple[int, int]]
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    answered: bool = False
    """The caller was answered once the version was spooled: the spool copy stays whatever the replicas say."""
    bulk: bool = False
    """Its client asked for the bulk path: so do the proxy's streams to the replicas."""


def publication_reply(
    adapter: SpooledAdapter, results: list[ReplicaCall], pushed: list[str], everyone: Iterable[Replica]
) -> pb.PushAdapterResponse:
    """The reply of a publication that committed somewhere: every target's outcome (`results`),
    and each replica not `pushed` now with why (it is caught up before it serves again)."""
    accepted = [r.reply for r in results if r.ok and r.reply is not None]
    loaded = set.intersection(*(set(reply.loaded_versions) for reply in accepted)) if accepted else set()
    per_replica = [r.to_pb() for r in results]
    per_replica += [
        pb.ReplicaPushResult(
            replica=r.name,
            address=r.address,
            code="UNAVAILABLE",
            message=f"not pushed now ({r.state()}); it is caught up before it serves again",
        )
        for r in everyone
        if r.address not in pushed
    ]
    return pb.PushAdapterResponse(
        name=adapter.name,
        version=adapter.version,
        already_loaded=all(reply.already_loaded for reply in accepted),
        loaded_versions=sorted(loaded),
        replicas=per_replica,
        sha256=adapter.manifest.sha256,
    )


def fence_conflicts(spool: Spool, adapter: SpooledAdapter, created: bool, peers: list[pb.PeerPushResult]) -> None:
    """A peer proxy holding other bytes under this version is two truths for one version:
    nothing is committed (the replicas' staged copies expire), a copy this push spooled is
    quarantined (so no catch-up serves it), and the push fails naming the peers."""
    conflicts = [r.address for r in peers if r.reason == Reason.PEER_VERSION_CONFLICT]
    if not conflicts:
        return
    why = f"peer proxies {', '.join(conflicts)} hold this version with another digest"
    if created:
        spool.quarantine(adapter, why)
    log.error("adapter_version_fenced", adapter=adapter.name, version=adapter.version, peers=conflicts)
    raise FailedPrecondition(
        f"{adapter.name!r} v{adapter.version} was not published: {why} (two pushes gave it different bytes); "
        "versions are immutable fleet-wide, so push the next version, and find which learner pushed the other",
        reason=Reason.PEER_VERSION_CONFLICT,
    )
