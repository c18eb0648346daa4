"""What a replica's error status means: the one place the proxy decides who is at fault.

Two separate decisions per status a replica sends for one attempt of a group:
(1) `retry`: redo the group on another replica (invisibly before its first token, with
    `restarted` after); otherwise the status is relayed to the client unchanged;
(2) `counts`: count the failure against the replica, towards its ejection (breaker.py).

Rule: only a status that means the replica is sick counts; a status a client can cause
never does, so no request, however malformed, can eject a replica. A relayed status is the
client's and is counted per code in `rollwire_proxy_client_errors_total`.

| replica status                                        | retry        | counts      |
|-------------------------------------------------------|--------------|-------------|
| UNAVAILABLE (refused/reset connection, shutting down) | yes          | yes         |
| DEADLINE_EXCEEDED before the group's deadline (stall) | yes          | yes         |
| DEADLINE_EXCEEDED at the group's deadline             | no (DEADLINE_EXCEEDED to the client) | no |
| INTERNAL/UNKNOWN reason ENGINE_FAILED (whole batch)   | yes          | yes         |
| INTERNAL/UNKNOWN with no rollwire reason, or DATA_LOSS, ABORTED, UNIMPLEMENTED and codes not listed here | once ("suspect") | only if the same request then succeeds on another replica |
| INTERNAL/UNKNOWN with a per-request reason (ROW_FAILED, NON_FINITE_LOGITS, any other) | no | no |
| RESOURCE_EXHAUSTED reason QUEUE_FULL (replica busy)   | yes          | no          |
| NOT_FOUND/FAILED_PRECONDITION ADAPTER_* where the proxy believed the replica held the version (stale view) | yes (replica re-synced, not ejected) | no |
| CANCELLED (the replica cancelled: not the client, whose cancellation never reaches here) | yes | no |
| INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, OUT_OF_RANGE, ALREADY_EXISTS, PERMISSION_DENIED, UNAUTHENTICATED, other RESOURCE_EXHAUSTED | no | no |

A suspect (an unexplained INTERNAL/UNKNOWN) may be a replica bug or a request that
trips a bug on every replica: it is retried once elsewhere; if the same request succeeds
there the first replica was at fault and one failure is counted against it; if it fails
the same way again it is the request: the second status is relayed and nothing is counted.

Retries by layer: the SDK retries only UNAVAILABLE and RESOURCE_EXHAUSTED with the
server's hint (its own policy); the proxy retries per the table, at most
`routing.max_attempts` attempts within the request's deadline; a replica never retries.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

C = grpc.StatusCode
ENGINE_FAILED = "ENGINE_FAILED"
"""Reason of an INTERNAL that failed a whole forward pass: no row to blame, the replica is sick."""
STALE_VIEW = frozenset({"ADAPTER_NOT_FOUND", "ADAPTER_VERSION_NOT_FOUND", "ADAPTER_VERSION_EVICTED"})
"""A replica refusing a version the proxy believed it held: the proxy's view is stale."""
SICK = frozenset({C.UNAVAILABLE})
"""Statuses that mean the replica itself failed, whatever the request."""
UNEXPLAINED = frozenset({C.INTERNAL, C.UNKNOWN})
CLIENT = frozenset(
    {
        C.INVALID_ARGUMENT,
        C.FAILED_PRECONDITION,
        C.NOT_FOUND,
        C.OUT_OF_RANGE,
        C.ALREADY_EXISTS,
        C.PERMISSION_DENIED,
        C.UNAUTHENTICATED,
        C.RESOURCE_EXHAUSTED,
    }
)
"""Statuses a request can cause: relayed, never counted."""


@dataclass(frozen=True)
class Verdict:
    retry: bool
    """Redo the group on another replica."""
    counts: bool
    """Count the failure against the replica now (towards ejection)."""
    kind: str
    """replica | busy | stale | cancelled | suspect | deadline | client."""


REPLICA = Verdict(True, True, "replica")
BUSY = Verdict(True, False, "busy")
STALE = Verdict(True, False, "stale")
CANCELLED = Verdict(True, False, "cancelled")
SUSPECT = Verdict(True, False, "suspect")
DEADLINE = Verdict(False, False, "deadline")
CLIENT_FAULT = Verdict(False, False, "client")


def no_reason(code: grpc.StatusCode, reason: str) -> bool:
    """True when the status carries no rollwire reason (servers default it to the code's name)."""
    return not reason or reason == code.name


def classify(
    code: grpc.StatusCode,
    reason: str,
    *,
    group_deadline_passed: bool = False,
    version_pinned: bool = False,
    suspected_before: bool = False,
) -> Verdict:
    """The verdict on one failed attempt (see the module docstring's table).

    `group_deadline_passed`: the request's own deadline is reached (a DEADLINE_EXCEEDED then
    is the client's deadline, not a stall). `version_pinned`: the proxy routed the group to
    this replica because it believed the replica held the adapter version. `suspected_before`:
    an earlier attempt of this group already failed unexplained, so a second one is the request.
    """
    if code == C.DEADLINE_EXCEEDED:
        return DEADLINE if group_deadline_passed else REPLICA
    if code in SICK:
        return REPLICA
    if code == C.CANCELLED:
        return CANCELLED
    if code == C.RESOURCE_EXHAUSTED and reason == "QUEUE_FULL":
        return BUSY
    if reason in STALE_VIEW and version_pinned:
        return STALE
    if code in CLIENT:
        return CLIENT_FAULT
    if code in UNEXPLAINED and reason == ENGINE_FAILED:
        return REPLICA
    if code in UNEXPLAINED and not no_reason(code, reason):
        return CLIENT_FAULT  # a per-request failure the replica named (ROW_FAILED, NON_FINITE_LOGITS, ...)
    return CLIENT_FAULT if suspected_before else SUSPECT
