"""Running one GRPO group through the proxy: placement, relay, invisible retry, restart.

Invariants (the proxy answers every accepted request exactly once, complete or with an error):
- a group runs whole on one replica per attempt, so all samples the client keeps come from
  one replica, one adapter version and one attempt;
- nothing of an attempt reaches the client before its first token or `finished` event (the
  `started` is held back), so an attempt that fails earlier is retried elsewhere invisibly;
- once an attempt has shown anything, its failure is followed by `restarted` and then by a
  fresh `started` from a later attempt, or by an error status;
- at most `max_attempts` attempts, all inside the request's deadline; then UNAVAILABLE naming
  each failure, or DEADLINE_EXCEEDED;
- the lease is released and the upstream call cancelled on every exit path, the client
  going away included, so a replica stops work nobody will read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from rollwire.common.errors import DeadlineExceeded, Unavailable, from_rpc_error
from rollwire.common.logs import REQUEST_ID_KEY, get_logger
from rollwire.server.proxy.config import RoutingSection
from rollwire.server.proxy.dispatch import Dispatcher, Lease, Need
from rollwire.server.proxy.metrics import ProxyMetrics
from rollwire.server.proxy.policies import routing_key
from rollwire.server.proxy.relay import Relay
from rollwire.server.proxy.replica import Attempt, Replica
from rollwire.server.proxy.replicas import ReplicaSet
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
# A replica failing with these is at fault (died, crashed, shut down): try another one.
REPLICA_FAULTS = {
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED,
}
# A replica refusing a version the proxy believed it held: the proxy's view is stale.
STALE_VIEW = {"ADAPTER_NOT_FOUND", "ADAPTER_VERSION_NOT_FOUND", "ADAPTER_VERSION_EVICTED"}


@dataclass
class AttemptFailed(Exception):
    """An attempt that another replica may redo."""

    replica: Replica
    code: str
    message: str
    visible: bool
    """True when the client already saw part of this attempt (so it needs `restarted`)."""
    kind: str
    """"replica" (counts towards ejection), "busy", "stale" or "abandoned"."""


def resolve(request: pb.GenerateRequest, replicas: ReplicaSet) -> Need:
    """The replica requirement of a request; pins "latest" to a concrete version in place,
    so every attempt of the group, on whichever replica, uses the same version."""
    name = request.adapter.name
    if not name:
        return Need()
    version = request.adapter.version or replicas.latest(name)
    if version and any(r.holds(name, version) for r in replicas.routable()):
        request.adapter.version = version
        return Need(name, version)
    return Need(any_replica=True)


class GroupRun:
    def __init__(self, request: pb.GenerateRequest, request_id: str, deadline: float, dispatcher: Dispatcher,
                 replicas: ReplicaSet, routing: RoutingSection, metrics: ProxyMetrics) -> None:
        self.request, self.request_id, self.deadline = request, request_id, deadline
        self.dispatcher, self.replicas, self.routing, self.metrics = dispatcher, replicas, routing, metrics
        request.request_id = request_id
        self.need = resolve(request, replicas)
        kind = request.WhichOneof("prompt")
        self.key = routing_key(
            request.group_key,
            request.text if kind == "text" else None,
            request.token_ids.ids if kind == "token_ids" else None,
            routing.affinity_prefix,
        )
        self.work = max(1, request.n) * max(1, request.sampling.max_new_tokens)

    async def events(self) -> AsyncIterator[pb.GenerateResponse]:
        """The client's stream: one complete group, or an exception (RollwireError / Relay)."""
        if self.need.any_replica and not self.replicas.routable():
            await self.dispatcher.wait_for_replica(self.deadline)  # so "latest" resolves to a version
            self.need = resolve(self.request, self.replicas)
        failures: list[AttemptFailed] = []
        for number in range(1, self.routing.max_attempts + 1):
            tried = frozenset(f.replica.address for f in failures)
            lease = await self.dispatcher.acquire(self.need, self.key, self.work, tried, self.deadline)
            failure = None
            try:
                async with contextlib.aclosing(self._attempt(lease)) as stream:
                    async for message in stream:
                        yield message
            except AttemptFailed as exc:
                failure = exc
            finally:
                lease.release()
            if failure is None:
                return
            failures.append(failure)
            self._count(failure)
            if number == self.routing.max_attempts:
                break
            if time.monotonic() >= self.deadline:
                raise self._deadline_error()
            if failure.visible:
                yield pb.GenerateResponse(restarted=pb.GroupRestarted(attempt=number + 1, reason=_sentence(failure)))
        raise Unavailable(
            f"the group failed on {len(failures)} attempts and was not completed: "
            f"{'; '.join(_sentence(f) for f in failures)}; retry the request",
            reason="ATTEMPTS_EXHAUSTED",
            retry_after_s=self.routing.retry_after_s,
        )

    async def _attempt(self, lease: Lease) -> AsyncIterator[pb.GenerateResponse]:
        replica = lease.replica
        call = replica.generator.Generate(
            self.request,
            timeout=max(0.001, self.deadline - time.monotonic()),
            metadata=((REQUEST_ID_KEY, self.request_id), *replica.metadata),
        )
        attempt = Attempt(call)
        replica.attempts.add(attempt)
        held, visible = None, False
        try:
            async for message in call:
                if not visible and message.HasField("started") and not (message.tokens or message.finished):
                    held = message
                    continue
                if not visible:
                    visible = True
                    if held is not None:
                        yield held
                yield message
            if not visible and held is not None:
                yield held
            replica.breaker.record_success()
            self.metrics.attempts.labels(replica.address, "OK").inc()
        except grpc.aio.AioRpcError as exc:
            raise self._classify(replica, exc, visible) from None
        except asyncio.CancelledError:
            if attempt.abandoned and not asyncio.current_task().cancelling():
                raise AttemptFailed(replica, "ABANDONED", attempt.abandoned, visible, "abandoned") from None
            raise
        finally:
            replica.attempts.discard(attempt)
            call.cancel()

    def _classify(self, replica: Replica, exc: grpc.aio.AioRpcError, visible: bool) -> Exception:
        """What a replica's error means: redo the group elsewhere, or tell the client."""
        code = exc.code()
        self.metrics.attempts.labels(replica.address, code.name).inc()
        err = from_rpc_error(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= self.deadline - 0.01:
            return self._deadline_error()
        if code in REPLICA_FAULTS or code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return AttemptFailed(replica, code.name, err.message, visible, "replica")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "QUEUE_FULL":
            return AttemptFailed(replica, code.name, err.message, visible, "busy")
        if err.reason in STALE_VIEW and not self.need.any_replica:
            return AttemptFailed(replica, code.name, err.message, visible, "stale")
        replica.breaker.record_success()  # it answered: the refusal is about the request
        return Relay(exc)

    def _count(self, failure: AttemptFailed) -> None:
        replica, now = failure.replica, time.monotonic()
        (self.metrics.restarts if failure.visible else self.metrics.retries).labels(replica.address).inc()
        log.info("attempt_failed", replica=replica.address, code=failure.code, kind=failure.kind,
                 visible=failure.visible, error=failure.message)
        if failure.kind == "stale":
            self.replicas.mark_unsynced(replica, f"it refused {self.need}, which it was believed to hold")
        elif failure.kind == "replica" and replica.breaker.record_failure(now):
            self.metrics.ejections.labels(replica.address).inc()
            log.warning("replica_ejected", replica=replica.address, seconds=round(replica.breaker.open_until - now, 2))
            self.dispatcher.wake()

    def _deadline_error(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            "the group did not finish before its deadline; give the request a longer deadline or ask for fewer tokens",
            reason="DEADLINE",
        )


def _sentence(failure: AttemptFailed) -> str:
    return f"replica {failure.replica.address} failed with {failure.code}: {failure.message}"
