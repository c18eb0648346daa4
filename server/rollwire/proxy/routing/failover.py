"""Running one GRPO group through the proxy: placement, relay, invisible retry, resume, restart.

Invariants (the proxy answers every accepted request exactly once, complete or with an error):
- a group runs on one replica per attempt; all samples the client keeps come from one adapter
  version (the one the group resolved; for a group that follows, versions only rise);
- nothing of a first attempt reaches the client before its first token or `finished` event
  (the `started` is held back), so an attempt that fails earlier is retried elsewhere invisibly;
- once the client has seen anything of the group, a failed attempt is RESUMED (resume.py): the
  next attempt continues each unfinished sample from the tokens the client holds, under the
  same version (a follower: the newest), and the client's stream simply goes on: no
  `restarted`, and the continuation's `started` is not forwarded (the client keeps the first
  one; each chunk names its version). Finished samples are never run again. On the
  transformers engine a seeded sample's tokens and logprobs equal its uninterrupted run's;
- the group is RESTARTED (`restarted`, then a fresh `started` from a later attempt, or an
  error status) only where it cannot be resumed, each counted by cause (resume.CAUSES):
  routing.resume off, a replica that cannot continue samples (refused RESUME_UNSUPPORTED, or
  an older one whose `started` does not count the resumed samples: it would run them all
  again, so it is cut off), a continuation refused (BAD_RESUME), or a sample over its limit.
  A continuation needs the same version as a restart would (the request pins it), so a
  version no replica can serve fails the group either way;
- at most `max_attempts` attempts, all inside the request's deadline; then UNAVAILABLE naming
  each failure, or DEADLINE_EXCEEDED;
- the lease is released and the upstream call cancelled on every exit path, the client
  going away included, so a replica stops work nobody will read;
- which failures are retried and which count against a replica is decided in faults.py
  alone: a status a client can cause never counts, so no request can eject a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from rollwire.common.errors import DeadlineExceeded, NotFound, Unavailable, from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.proxy.fleet.replica import Attempt, Replica
from rollwire.proxy.fleet.replicas import ReplicaSet
from rollwire.proxy.routing import faults
from rollwire.proxy.routing.dispatch import Client, Dispatcher, Lease, Need
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.routing.resume import Progress
from rollwire.runtime.logs import REQUEST_ID_KEY, get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


@dataclass
class AttemptFailed(Exception):
    """An attempt that another replica may redo."""

    replica: Replica
    code: str
    message: str
    visible: bool
    """True when the client already saw part of this attempt (so it needs `restarted`)."""
    kind: str
    """A faults.Verdict kind ("replica", "busy", "stale", "cancelled", "suspect") or "abandoned"."""
    counts: bool = False
    """Counts towards the replica's ejection now (faults.classify)."""
    cause: str = ""
    """Set when the attempt was a continuation the replica could not take: the restart's cause (resume.CAUSES)."""


RESUME_REFUSALS = {Reason.RESUME_UNSUPPORTED: "unsupported", Reason.BAD_RESUME: "refused"}
"""A replica's refusal of a continuation the proxy made, and the cause of the restart it leads to."""


def resolve(request: pb.GenerateRequest, replicas: ReplicaSet) -> Need:
    """The replica requirement of a request; pins "latest" to a concrete version in place,
    so every attempt of the group, on whichever replica, uses the same version. A request
    that follows the newest version is never pinned: each attempt goes to a replica holding
    the newest version known now, and starts there on its newest (a restarted group starts
    on the newest version). A version the fleet is being given (a load answered at "spooled",
    a catch-up) is waited for: never served by another version. A name means its current
    lineage (lineages.py), rewritten in place; an unloaded version is NOT_FOUND, and "latest"
    skips unloaded versions."""
    if not request.adapter.name:
        return Need()
    name = request.adapter.name = replicas.spool.lineages.internal(request.adapter.name)  # its current lineage
    if request.adapter.version in replicas.spool.lineages.unloaded(name):
        raise NotFound(
            f"adapter {name!r} v{request.adapter.version} was unloaded; load it again, or name another version",
            reason=Reason.ADAPTER_UNLOADED,
        )
    version = request.adapter.version or _newest_shown(name, replicas)
    if not version and not _known(name, replicas):  # the proxy's own answer, in the words a replica would use
        raise NotFound(
            f"no adapter named {name[:256]!r} is loaded on this replica; push it first",  # a name's length is the client's
            reason=Reason.ADAPTER_NOT_FOUND,
        )
    if version and (any(r.holds(name, version) for r in replicas.routable()) or replicas.coming(name, version)):
        if not request.adapter.follow:
            request.adapter.version = version
        return Need(name, version)
    return Need(any_replica=True)


def _known(name: str, replicas: ReplicaSet) -> bool:
    """Does the fleet hold `name` at all: a spooled version, or one some member reports?"""
    return bool(replicas.spool.versions(name)) or any(name in r.versions for r in replicas.all())


def _newest_shown(name: str, replicas: ReplicaSet) -> int:
    """What "latest" of `name` means: its newest version a routable replica serves or a load
    was answered for, less those unloaded; NOT_FOUND when every one was unloaded."""
    unloaded = replicas.spool.lineages.unloaded(name)
    if not unloaded:
        return max(replicas.latest(name), replicas.promised(name))
    held = {v for r in replicas.routable() for v in r.versions.get(name, ())} | {
        v for n, v in replicas.answered if n == name
    }
    shown = held - unloaded
    if held and not shown:
        raise NotFound(
            f"every version of adapter {name!r} was unloaded; load one again, or name another adapter",
            reason=Reason.ADAPTER_UNLOADED,
        )
    return max(shown, default=0)


class GroupRun:
    def __init__(
        self,
        request: pb.GenerateRequest,
        request_id: str,
        deadline: float,
        dispatcher: Dispatcher,
        client: Client | None = None,
        prefer: str = "",
    ) -> None:
        """Runs `request` on the dispatcher's replicas, under its routing settings and metrics;
        `prefer`: the address of a replica to keep it on when it can (a session's sticky one)."""
        self.request, self.request_id, self.deadline, self.client = request, request_id, deadline, client
        self.prefer = prefer
        self.current: Replica | None = None
        """The replica of the attempt running now (the last one once the group ended)."""
        self.failed: list[str] = []
        """Addresses of the replicas whose attempts failed, in order."""
        self.dispatcher, self.replicas = dispatcher, dispatcher.replicas
        self.routing, self.metrics = dispatcher.routing, dispatcher.metrics
        request.request_id = request_id
        self.need = resolve(request, self.replicas)
        self.key = dispatcher.key_for(request)
        self.work = max(1, request.n) * max(1, request.sampling.max_new_tokens)
        self.suspects: list[AttemptFailed] = []
        """Attempts that failed unexplained (faults.SUSPECT): counted only if the group then succeeds elsewhere."""
        self.progress = Progress(request)
        """What the client was sent, per sample (resume.py)."""
        self.resume_off = "" if self.routing.resume else "off"
        """Why this group restarts instead of resuming ("" while it may resume)."""

    async def events(self) -> AsyncIterator[pb.GenerateResponse]:
        """The client's stream: one complete group, or an exception (RollwireError / PassThrough)."""
        if self.need.any_replica and not self.replicas.routable():
            await self.dispatcher.wait_for_replica(self.deadline)  # so "latest" resolves to a version
            self.need = resolve(self.request, self.replicas)
        failures: list[AttemptFailed] = []
        sending = self.request  # the first attempt's request; later ones continue or redo the group
        for number in range(1, self.routing.max_attempts + 1):
            tried = frozenset(f.replica.address for f in failures if not f.cause)
            if number > 1 and self.request.adapter.follow:
                self.need = resolve(self.request, self.replicas)  # a resumed or restarted follower takes the newest
            lease = await self.dispatcher.acquire(
                self.need,
                self.key,
                self.work,
                tried,
                self.deadline,
                client=self.client,
                first=number == 1,
                prefer="" if self.prefer in tried else self.prefer,
            )
            failure = None
            try:
                async with contextlib.aclosing(self._attempt(lease, sending)) as stream:  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
                    async for message in stream:
                        self.progress.observe(message)
                        yield message
            except AttemptFailed as exc:
                failure = exc
            finally:
                lease.release()
            if failure is None:
                self._convict(lease.replica)
                return
            if self.progress.shown and not self.progress.unfinished():
                return  # every sample ended before its replica failed: the group is complete
            failures.append(failure)
            self.failed.append(failure.replica.address)
            self.resume_off = self.resume_off or failure.cause or ("limits" if self.progress.over_limit() else "")
            resume = failure.visible and not self.resume_off
            self._count(failure, resumed=resume)
            if number == self.routing.max_attempts:
                break
            if time.monotonic() >= self.deadline:
                raise self._deadline_error()
            sending = self.progress.continuation(self.request) if resume else self.request
            if failure.visible and not resume:
                self.progress.reset()
                self.metrics.restart_causes.labels(self.resume_off).inc()
                yield pb.GenerateResponse(restarted=pb.GroupRestarted(attempt=number + 1, reason=_sentence(failure)))
        raise Unavailable(
            f"the group failed on {len(failures)} attempts and was not completed: "
            f"{'; '.join(_sentence(f) for f in failures)}; retry the request",
            reason=Reason.ATTEMPTS_EXHAUSTED,
            retry_after_s=self.routing.retry_after_s,
        )

    async def _attempt(self, lease: Lease, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """One attempt's messages for the client. A continuation (`request.resume` set by the
        proxy) shows nothing new of itself: its `started` is checked and dropped."""
        replica = self.current = lease.replica
        call = replica.generator.Generate(
            request,
            timeout=max(0.001, self.deadline - time.monotonic()),
            metadata=((REQUEST_ID_KEY, self.request_id), *replica.metadata),
        )
        attempt = Attempt(call)
        replica.attempts.add(attempt)
        continuing = request is not self.request
        held, visible = None, self.progress.shown
        try:
            async for message in call:
                if continuing and message.HasField("started"):
                    message = self._continued(replica, request, message)
                    if not (message.tokens or message.finished):
                        continue
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
            raise self._classify(replica, exc, visible, continuing) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if attempt.abandoned and not (task and task.cancelling()):
                raise AttemptFailed(replica, "ABANDONED", attempt.abandoned, visible, "abandoned") from None
            raise
        finally:
            replica.attempts.discard(attempt)
            call.cancel()

    def _continued(self, replica: Replica, request: pb.GenerateRequest, message: pb.GenerateResponse):
        """A continuation's first message without its `started` (the client keeps the first
        attempt's), once the replica's `started` counts the samples it continues: an older
        replica ignores `resume` and would run every sample again, so it is cut off."""
        if message.started.resumed != len(request.resume):
            raise AttemptFailed(
                replica,
                "RESUME_IGNORED",
                f"it started {message.started.resumed} of the {len(request.resume)} samples the proxy asked it to "
                "continue (a replica without resume); the group is restarted",
                True,
                "unresumable",
                cause="unsupported",
            )
        out = pb.GenerateResponse()
        out.CopyFrom(message)
        out.ClearField("started")
        return out

    def _classify(self, replica: Replica, exc: grpc.aio.AioRpcError, visible: bool, continuing: bool) -> Exception:
        """What a replica's error means (faults.classify): redo the group elsewhere, or tell
        the client. A relayed refusal touches neither side of the replica's breaker: it says
        nothing about the replica's health, so a client cannot eject a replica with it, nor
        keep a failing one in rotation by interleaving bad requests. A refusal of a
        continuation the proxy made is not the client's: the group is restarted instead."""
        code = exc.code()
        self.metrics.attempts.labels(replica.address, code.name).inc()
        err = from_rpc_error(exc)
        if continuing and err.reason in RESUME_REFUSALS:
            cause = RESUME_REFUSALS[Reason(err.reason)]
            return AttemptFailed(replica, code.name, err.message, True, "unresumable", cause=cause)
        verdict = faults.classify(
            code,
            err.reason,
            group_deadline_passed=time.monotonic() >= self.deadline - 0.01,
            version_pinned=bool(self.need.adapter) and not self.need.any_replica,
            suspected_before=bool(self.suspects),
        )
        if verdict is faults.DEADLINE:
            return self._deadline_error()
        if verdict.retry:
            return AttemptFailed(replica, code.name, err.message, visible, verdict.kind, verdict.counts)
        return PassThrough(exc)

    def _count(self, failure: AttemptFailed, resumed: bool) -> None:
        replica, now = failure.replica, time.monotonic()
        metric = (
            self.metrics.retries if not failure.visible else self.metrics.resumes if resumed else self.metrics.restarts
        )
        metric.labels(replica.address).inc()
        log.info(
            "attempt_failed",
            replica=replica.address,
            code=failure.code,
            kind=failure.kind,
            visible=failure.visible,
            then="retry" if not failure.visible else "resume" if resumed else f"restart ({self.resume_off})",
            samples_left=len(self.progress.unfinished()),
            tokens_kept=self.progress.sent() if resumed else 0,
            error=failure.message,
        )
        if failure.kind == "stale":
            self.replicas.mark_unsynced(replica, f"it refused {self.need}, which it was believed to hold")
        elif failure.kind == "suspect":
            self.suspects.append(failure)  # counted only if the same request succeeds elsewhere
        elif failure.counts:
            self._fault(replica, now)

    def _convict(self, succeeded_on: Replica) -> None:
        """The group succeeded: each replica that failed it unexplained was at fault."""
        for failure in self.suspects:
            if failure.replica.address != succeeded_on.address:
                log.info(
                    "replica_fault_confirmed",
                    replica=failure.replica.address,
                    code=failure.code,
                    succeeded_on=succeeded_on.address,
                )
                self._fault(failure.replica, time.monotonic())

    def _fault(self, replica: Replica, now: float) -> None:
        if replica.breaker.record_failure(now):
            self.metrics.ejections.labels(replica.address).inc()
            log.warning("replica_ejected", replica=replica.address, seconds=round(replica.breaker.open_until - now, 2))
            self.dispatcher.wake()

    def _deadline_error(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            "the group did not finish before its deadline; give the request a longer deadline or ask for fewer tokens",
            reason=Reason.DEADLINE,
        )


def _sentence(failure: AttemptFailed) -> str:
    return f"replica {failure.replica.address} failed with {failure.code}: {failure.message}"
