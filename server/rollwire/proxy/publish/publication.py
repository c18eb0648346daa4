"""One publication's state (publish/fanout.py): the version on its way and where each target stands."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from rollwire.common.reasons import Reason
from rollwire.proxy.fleet.replica import Replica
from rollwire.v1 import generator_pb2 as pb


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
