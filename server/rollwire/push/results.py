"""The outcomes of a relayed push: one `pb.ReplicaPushResult` per replica of a subtree.

Invariant: a relaying replica reports its subtree's outcomes whether it succeeded (in its
reply's `replicas`) or refused (as a PushAdapterResponse detail beside the ErrorInfo of its
status), so a parent always learns every outcome below it.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from rollwire.common.errors import RollwireError, status_detail, to_status
from rollwire.v1 import generator_pb2 as pb


def result(
    address: str,
    name: str,
    code: grpc.StatusCode,
    message: str = "",
    reason: str = "",
    staged: bool = False,
    stripe_pending: bool = False,
) -> pb.ReplicaPushResult:
    """One replica's outcome, as PushAdapterResponse.replicas lists it."""
    return pb.ReplicaPushResult(
        replica=name or address,
        address=address,
        code=code.name,
        message=message,
        reason=reason,
        staged=staged,
        stripe_pending=stripe_pending,
    )


def status_with_results(err: RollwireError, results: Sequence[pb.ReplicaPushResult]) -> grpc.Status:
    """The refusal of a relaying replica, carrying its subtree's outcomes as a
    PushAdapterResponse detail beside the ErrorInfo, so the parent learns them anyway."""
    return to_status(err, pb.PushAdapterResponse(replicas=list(results))) if results else to_status(err)


def results_from_error(exc: grpc.RpcError) -> list[pb.ReplicaPushResult] | None:
    """The subtree outcomes a relaying replica attached to its refusal, if any."""
    reply = status_detail(exc, pb.PushAdapterResponse)
    return list(reply.replicas) if reply is not None else None
