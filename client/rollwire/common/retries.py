"""Which failures each layer retries, and why: the one place that says so.

Every layer that may redo work after an error status reads its sets here; `TABLE` states the
whole policy row by row (docs/protocol.md shows it, and tests/unit/repo/test_protocol_doc.py checks each
row against the layers' real decisions, so the table and the code cannot drift apart).

- **SDK** (rollwire.client, `is_retryable`): retries a call only on `SDK_RETRIES`
  (UNAVAILABLE) and only before any response arrived: the request never ran, or the proxy
  already spent its own attempts, so a retry cannot duplicate work. It tries the other
  proxies it was given at once, then backs off, for as long as the call's one deadline allows
  (or `RetryPolicy.max_attempts`), each wait at least the server's RetryInfo hint. A failure a
  server decided (UNAVAILABLE with a reason) did work in the fleet, so its retries are
  throttled per client by a token bucket (gRPC's retry throttling, `_failover.RetryBudget`),
  and after a proxy's `FLEET_FAULTS` (it spent its own attempts, or found no replica) the
  SDK tries once more at most: a fleet fault is never multiplied by every client. One more
  case: a Generate stream whose connection broke after its first message (UNAVAILABLE with
  no server reason) is started again, announced with `Restarted` like a proxy's restart
  (client/_failover.py). RESOURCE_EXHAUSTED carries a hint too, but waiting out one's own
  overload is the caller's choice, so the SDK returns it.
- **Proxy** (rollwire.proxy.routing.faults.classify, per attempt of a group): a status that means
  the replica is sick (`REPLICA_SICK`, a stalled attempt, `REPLICA_SICK_REASONS`) moves the
  group to another replica and counts towards the replica's ejection; a busy replica
  (`REPLICA_BUSY`), a stale view of its versions (`STALE_VIEW`) or a cancellation by the
  replica moves it without counting; an unexplained failure (`UNEXPLAINED` with no reason,
  or a code no row names) is tried once more elsewhere and counts only if that attempt
  succeeds; a status a request can cause (`CLIENT_CAUSED`) is relayed unchanged and never
  counts, so no request, however malformed, can eject a replica. The proxy's own refusals
  for a client's behaviour (`CLIENT_BEHAVIOUR`) are counted as client errors.
- **Replicas** never retry.
- **Proxy catch-up** (replicas.py): a replica's refusal of a spooled version is tried again
  on the next health round unless `push_refused_for_good`; a replica already ahead
  (`VERSION_TAKEN`) needs nothing; a replica of another base model (`WRONG_RECEIVER`) is
  checked again and refused membership, and the version stays.
- **Learner publisher**: re-pushes a version on `PUSH_TRANSIENT` until it lands or a newer
  version supersedes it; any other refusal stops the run with the server's sentence. At
  start, `VERSION_TAKEN` means the replicas already hold that version (a killed run's last
  push): the learner moves its first version above theirs.
- **Learner producer**: never re-sends a group (its samples would be judged twice); a failed
  group is dropped and counted by reason, and after UNAVAILABLE, DEADLINE_EXCEEDED,
  RESOURCE_EXHAUSTED or NOT_FOUND it pauses `rollout.retry_backoff_s` before asking again
  (producer.BACK_OFF), so an outage is not hammered.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from rollwire.common.reasons import Reason

C = grpc.StatusCode

SDK_RETRIES = frozenset({C.UNAVAILABLE})
"""Codes the SDK retries, only while no response has arrived."""

REPLICA_SICK = frozenset({C.UNAVAILABLE})
"""Codes that mean the replica itself failed, whatever the request: retried, counted."""
REPLICA_SICK_REASONS = frozenset({Reason.ENGINE_FAILED})
"""With INTERNAL/UNKNOWN: a whole forward pass failed, no request to blame: retried, counted."""
UNEXPLAINED = frozenset({C.INTERNAL, C.UNKNOWN})
"""Codes that say nothing about the cause unless a reason names it."""
REPLICA_BUSY = frozenset({Reason.QUEUE_FULL, Reason.ENGINE_OOM, Reason.TENANT_SLOTS_FULL})
"""With RESOURCE_EXHAUSTED: the replica is busy (its queue, its memory for this group, or the LoRA slots of the
request's tenant there), not sick: retried elsewhere, not counted."""
STALE_VIEW = frozenset({Reason.ADAPTER_NOT_FOUND, Reason.ADAPTER_VERSION_NOT_FOUND, Reason.ADAPTER_VERSION_EVICTED})
"""A replica refusing a version the proxy believed it held: the proxy's view is stale."""
CLIENT_CAUSED = frozenset(
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
"""Codes a request can cause: relayed to the client, never counted against a replica."""
CLIENT_BEHAVIOUR = frozenset({Reason.CLIENT_LIMIT, Reason.TENANT_QUOTA, Reason.SLOW_READER})
"""The proxy's own refusals caused by how a client behaves: counted as client errors."""

REQUEST_RULES = frozenset({Reason.PROMPT_TOO_LONG, Reason.BAD_GROUP_KEY, Reason.ADAPTER_NOT_FOUND})
"""The replicas' own rules the proxy applies to a request before it forwards it (serving.sizes; a
name the fleet does not hold, routing/failover.resolve): its refusal is the one a replica would
have relayed, so it is counted as a client error too."""

FLEET_FAULTS = frozenset({Reason.ATTEMPTS_EXHAUSTED, Reason.NO_REPLICA})
"""With UNAVAILABLE from a proxy: it already tried `routing.max_attempts` replicas, or waited
for one that can serve the request; the SDK tries once more at most (another proxy first)."""

VERSION_TAKEN = frozenset({Reason.VERSION_NOT_MONOTONIC, Reason.VERSION_CONFLICT})
"""A push refused because the receiver already holds that version or a newer one."""
PUSH_TRANSIENT = frozenset({C.UNAVAILABLE, C.DEADLINE_EXCEEDED, C.RESOURCE_EXHAUSTED, C.ABORTED})
"""Codes after which the learner pushes the same version again."""
_REFUSED_FOR_GOOD = frozenset({C.INVALID_ARGUMENT, C.FAILED_PRECONDITION})


WRONG_RECEIVER = frozenset({Reason.BASE_MODEL_MISMATCH})
"""A push refused because the receiver serves another base model: a verdict on the receiver,
never on the bytes (it never counts towards quarantine)."""


def push_refused_for_good(code: grpc.StatusCode, reason: str) -> bool:
    """A replica refused these bytes for good (it will refuse them again), not for now; a
    refusal that judges the receiver (`WRONG_RECEIVER`) is not one."""
    if code == C.RESOURCE_EXHAUSTED:
        return reason == Reason.ADAPTER_TOO_LARGE
    return code in _REFUSED_FOR_GOOD and reason not in VERSION_TAKEN and reason not in WRONG_RECEIVER


@dataclass(frozen=True)
class Row:
    """One line of the policy: a status and what each layer does with it."""

    status: str
    """The status as docs/protocol.md shows it."""
    codes: tuple[grpc.StatusCode, ...]
    reason: str
    """A reason standing for the row ("" for none)."""
    sdk: bool
    """The SDK retries it (before any response)."""
    proxy: bool | None
    """The proxy redoes the group on another replica (None: once, as a suspect)."""
    counts: bool | None
    """It counts against the replica (None: only if the group then succeeds elsewhere)."""
    push: bool
    """The learner pushes the same version again."""
    pause: bool
    """The learner's producer pauses before asking again (it never re-sends the group)."""
    why: str
    deadline_passed: bool = False
    pinned: bool = False
    """The proxy routed the group there believing the replica held the version."""


TABLE = (
    Row("UNAVAILABLE", (C.UNAVAILABLE,), "", True, True, True, True, True,
        "the replica or the path failed; the request did not run to an answer"),
    Row("DEADLINE_EXCEEDED before the group's deadline", (C.DEADLINE_EXCEEDED,), "", False, True, True, True, True,
        "the replica stalled; the SDK never retries past its own deadline"),
    Row("DEADLINE_EXCEEDED at the group's deadline", (C.DEADLINE_EXCEEDED,), "", False, False, False, True, True,
        "the caller's time is up", deadline_passed=True),
    Row("INTERNAL/UNKNOWN, `ENGINE_FAILED`", (C.INTERNAL, C.UNKNOWN), Reason.ENGINE_FAILED,
        False, True, True, False, False, "a forward pass failed: no request to blame"),
    Row("INTERNAL/UNKNOWN with no reason", (C.INTERNAL, C.UNKNOWN), "", False, None, None, False, False,
        "a replica bug or a request that trips one: one more replica tells which"),
    Row("DATA_LOSS, UNIMPLEMENTED", (C.DATA_LOSS, C.UNIMPLEMENTED), "", False, None, None, False, False,
        "unexplained, as above"),
    Row("ABORTED", (C.ABORTED,), "", False, None, None, True, False, "unexplained, as above; a push may land later"),
    Row("INTERNAL/UNKNOWN with another reason", (C.INTERNAL, C.UNKNOWN), Reason.ROW_FAILED,
        False, False, False, False, False, "the replica named a failure of this request alone"),
    Row("RESOURCE_EXHAUSTED, `QUEUE_FULL`", (C.RESOURCE_EXHAUSTED,), Reason.QUEUE_FULL,
        False, True, False, True, True, "the replica is busy, not sick"),
    Row("RESOURCE_EXHAUSTED, another reason", (C.RESOURCE_EXHAUSTED,), Reason.CLIENT_LIMIT,
        False, False, False, True, True, "a limit the request or its client hit; wait for the hint"),
    Row("NOT_FOUND `ADAPTER_*`, version believed held", (C.NOT_FOUND,), Reason.ADAPTER_VERSION_NOT_FOUND,
        False, True, False, False, True, "the proxy's view was stale: it re-syncs the replica", pinned=True),
    Row("FAILED_PRECONDITION `ADAPTER_*`, version believed held", (C.FAILED_PRECONDITION,),
        Reason.ADAPTER_VERSION_EVICTED, False, True, False, False, False, "as above", pinned=True),
    Row("CANCELLED (by a replica)", (C.CANCELLED,), "", False, True, False, False, False,
        "a replica shut down mid-group; a client's own cancellation never reaches here"),
    Row("NOT_FOUND, another case", (C.NOT_FOUND,), Reason.ADAPTER_NOT_FOUND, False, False, False, False, True,
        "the adapter is not pushed yet: the learner pushes, then asks again"),
    Row("INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION", (C.INVALID_ARGUMENT, C.OUT_OF_RANGE,
        C.FAILED_PRECONDITION), Reason.BAD_TEMPERATURE, False, False, False, False, False,
        "the request must change (at the learner's start `VERSION_NOT_MONOTONIC`/`VERSION_CONFLICT` move its version up)"),
    Row("ALREADY_EXISTS, PERMISSION_DENIED, UNAUTHENTICATED", (C.ALREADY_EXISTS, C.PERMISSION_DENIED,
        C.UNAUTHENTICATED), Reason.WRONG_ROLE, False, False, False, False, False, "the setup must change"),
)  # fmt: skip
"""The policy, one row per status; tests/unit/repo/test_protocol_doc.py checks every row against the layers."""
