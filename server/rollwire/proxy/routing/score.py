"""Score through the proxy: one request routed by version like Generate, answered once.

Invariants:
- the proxy's own limits (config.score) are checked before any routing, each refusal with the
  replica's reason for the same problem; each replica checks its own limits again;
- the version is resolved as Generate's (failover.resolve: "latest" pinned once, a name's current
  lineage, an unloaded version NOT_FOUND), so every attempt scores under the same version, and a
  version no replica holds gets the status Generate would get;
- a Score is unary, so nothing reaches the client before the answer: a failed attempt is retried
  on another replica (at most routing.max_attempts, inside the deadline) by the fleet's retry
  policy (faults.classify), plus UNIMPLEMENTED (an engine that cannot score: another replica
  may), never counted against the replica; a status the request caused is relayed unchanged
  (PassThrough) and never counts;
- the lease is released on every exit, the client going away included.
"""

from __future__ import annotations

import time

import grpc

from rollwire.common.errors import DeadlineExceeded, InvalidArgument, Unavailable, from_rpc_error
from rollwire.common.manifest import check_name
from rollwire.common.reasons import Reason
from rollwire.proxy.config import ScoreSection
from rollwire.proxy.fleet.replica import Replica
from rollwire.proxy.routing import faults
from rollwire.proxy.routing.dispatch import Client, Dispatcher
from rollwire.proxy.routing.failover import resolve
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.runtime.logs import REQUEST_ID_KEY, get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


def check_score(request: pb.ScoreRequest, limits: ScoreSection) -> int:
    """The request's total tokens, or a refusal by the proxy's limits (before any routing)."""
    if request.adapter.follow:
        raise InvalidArgument(
            "a Score is computed under one version: send it without adapter.follow (version 0 scores under the newest)",
            reason=Reason.BAD_SCORE_REQUEST,
        )
    if request.adapter.name:
        check_name(request.adapter.name)
    count = len(request.sequences)
    if count == 0:
        raise InvalidArgument("the Score names no sequence; give at least one", reason=Reason.BAD_SCORE_REQUEST)
    if count > limits.max_sequences:
        raise InvalidArgument(
            f"the Score has {count} sequences; this proxy takes at most {limits.max_sequences} per request: split it",
            reason=Reason.SCORE_TOO_LARGE,
        )
    if request.top_k > limits.max_top_k:
        raise InvalidArgument(
            f"top_k is {request.top_k}; this proxy returns at most {limits.max_top_k} (0: none)",
            reason=Reason.BAD_SCORE_TOP_K,
        )
    empty = next(
        (i for i, s in enumerate(request.sequences) if not s.prompt_token_ids or not s.continuation_token_ids), None
    )
    if empty is not None:
        raise InvalidArgument(
            f"sequence {empty} has an empty prompt or continuation; each part needs at least one token id",
            reason=Reason.BAD_SCORE_REQUEST,
        )
    total = sum(len(s.prompt_token_ids) + len(s.continuation_token_ids) for s in request.sequences)
    if total > limits.max_tokens:
        raise InvalidArgument(
            f"the Score holds {total} tokens; this proxy takes at most {limits.max_tokens} per request: split it",
            reason=Reason.SCORE_TOO_LARGE,
        )
    return total


class ScoreRun:
    """One Score on the dispatcher's replicas (see the module docstring)."""

    def __init__(
        self, request: pb.ScoreRequest, rid: str, deadline: float, dispatcher: Dispatcher, client: Client, work: int
    ) -> None:
        self.request, self.rid, self.deadline, self.client, self.work = request, rid, deadline, client, work
        self.dispatcher, self.routing, self.metrics = dispatcher, dispatcher.routing, dispatcher.metrics
        request.request_id = rid
        probe = pb.GenerateRequest(adapter=request.adapter)  # resolved as Generate's, then copied back
        first = request.sequences[0].prompt_token_ids if request.sequences else []
        probe.token_ids.ids.extend(first)
        self.need = resolve(probe, dispatcher.replicas)
        request.adapter.CopyFrom(probe.adapter)
        self.key = dispatcher.key_for(probe)
        self.suspects: list[Replica] = []

    async def answer(self) -> pb.ScoreResponse:
        """The first replica's answer, or RollwireError / PassThrough."""
        if self.need.any_replica and not self.dispatcher.replicas.routable():
            await self.dispatcher.wait_for_replica(self.deadline)
        failures: list[str] = []
        tried: set[str] = set()
        for number in range(1, self.routing.max_attempts + 1):
            lease = await self.dispatcher.acquire(
                self.need, self.key, self.work, frozenset(tried), self.deadline, client=self.client, first=number == 1
            )
            replica = lease.replica
            try:
                reply = await replica.generator.Score(
                    self.request,
                    timeout=max(0.001, self.deadline - time.monotonic()),
                    metadata=((REQUEST_ID_KEY, self.rid), *replica.metadata),
                )
            except grpc.aio.AioRpcError as exc:
                self._verdict(replica, exc)  # raises what the client gets; returns when another replica may do it
                failures.append(f"replica {replica.address} failed with {exc.code().name}: {exc.details()}")
                tried.add(replica.address)
                continue
            finally:
                lease.release()
            replica.breaker.record_success()
            self.metrics.attempts.labels(replica.address, "OK").inc()
            for suspect in self.suspects:  # an unexplained failure elsewhere, now explained: that replica's fault
                if suspect is not replica and suspect.breaker.record_failure(time.monotonic()):
                    self.dispatcher.wake()
            return reply
        raise Unavailable(
            f"the Score failed on {len(failures)} attempts: {'; '.join(failures)}; retry the request",
            reason=Reason.ATTEMPTS_EXHAUSTED,
            retry_after_s=self.routing.retry_after_s,
        )

    def _verdict(self, replica: Replica, exc: grpc.aio.AioRpcError) -> None:
        """Return when another replica may answer (counting the failure where faults.py says it
        counts), else raise what the client gets."""
        code = exc.code()
        self.metrics.attempts.labels(replica.address, code.name).inc()
        reason = from_rpc_error(exc).reason
        if code == grpc.StatusCode.UNIMPLEMENTED:  # this replica's engine cannot score; another's may
            others = [r for r in self.dispatcher.replicas.routable() if r.address != replica.address]
            verdict = faults.BUSY if others else faults.CLIENT_FAULT
        else:
            verdict = faults.classify(
                code,
                reason,
                group_deadline_passed=time.monotonic() >= self.deadline - 0.01,
                version_pinned=bool(self.need.adapter) and not self.need.any_replica,
                suspected_before=bool(self.suspects),
            )
        if verdict is faults.DEADLINE:
            raise DeadlineExceeded(
                "the Score did not finish before its deadline; give it a longer deadline or send fewer tokens",
                reason=Reason.DEADLINE,
            )
        if not verdict.retry:
            raise PassThrough(exc)
        log.info("score_attempt_failed", replica=replica.address, code=code.name, kind=verdict.kind)
        if verdict.kind == "stale":
            self.dispatcher.replicas.mark_unsynced(replica, f"it refused {self.need}, which it was believed to hold")
        elif verdict.kind == "suspect":
            self.suspects.append(replica)
        elif verdict.counts and replica.breaker.record_failure(time.monotonic()):
            self.metrics.ejections.labels(replica.address).inc()
            self.dispatcher.wake()
