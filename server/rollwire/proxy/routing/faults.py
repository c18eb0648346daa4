"""What a replica's error status means: the one place the proxy decides who is at fault.

Two separate decisions per status a replica sends for one attempt of a group:
(1) `retry`: redo the group on another replica (invisibly before its first token, with
    `restarted` after); otherwise the status is relayed to the client unchanged;
(2) `counts`: count the failure against the replica, towards its ejection (fleet/breaker.py).

Rule: only a status that means the replica is sick counts; a status a client can cause
never does, so no request, however malformed, can eject a replica. A relayed status is the
client's and is counted per code in `rollwire_proxy_client_errors_total`.

The rows (which codes and reasons mean sick, busy, stale, unexplained or client-caused) are
the fleet's retry policy, stated for every layer in rollwire.common.retries (its TABLE is
the proxy's columns of docs/protocol.md); this module applies them to one attempt.

A suspect (an unexplained INTERNAL/UNKNOWN, or a code no row names) may be a replica bug or
a request that trips a bug on every replica: it is retried once elsewhere; if the same
request succeeds there the first replica was at fault and one failure is counted against it;
if it fails the same way again it is the request: the second status is relayed and nothing
is counted. The proxy retries at most `routing.max_attempts` attempts within the request's
deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from rollwire.common.retries import (
    CLIENT_CAUSED,
    REPLICA_BUSY,
    REPLICA_SICK,
    REPLICA_SICK_REASONS,
    STALE_VIEW,
    UNEXPLAINED,
)

C = grpc.StatusCode
CLIENT = CLIENT_CAUSED
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
    """The verdict on one failed attempt (the rows: rollwire.common.retries.TABLE).

    `group_deadline_passed`: the request's own deadline is reached (a DEADLINE_EXCEEDED then
    is the client's deadline, not a stall). `version_pinned`: the proxy routed the group to
    this replica because it believed the replica held the adapter version. `suspected_before`:
    an earlier attempt of this group already failed unexplained, so a second one is the request.
    """
    if code == C.DEADLINE_EXCEEDED:
        return DEADLINE if group_deadline_passed else REPLICA
    if code in REPLICA_SICK:
        return REPLICA
    if code == C.CANCELLED:
        return CANCELLED
    if code == C.RESOURCE_EXHAUSTED and reason in REPLICA_BUSY:
        return BUSY
    if reason in STALE_VIEW and version_pinned:
        return STALE
    if code in CLIENT:
        return CLIENT_FAULT
    if code in UNEXPLAINED and reason in REPLICA_SICK_REASONS:
        return REPLICA
    if code in UNEXPLAINED and not no_reason(code, reason):
        return CLIENT_FAULT  # a per-request failure the replica named (ROW_FAILED, NON_FINITE_LOGITS, ...)
    return CLIENT_FAULT if suspected_before else SUSPECT
