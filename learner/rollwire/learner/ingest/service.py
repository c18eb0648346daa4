"""LearnerService over gRPC: the wire edge of ingest/intake.py.

Messages become `ingest.Trajectory` here and nowhere else; each request of the stream is
answered, in order, with its own TrajectoryStatus, so one refusal never ends the stream. The
server is a rollwire server like the others: bearer-token roles (security.METHOD_ROLES: the
admin role, because a trajectory steers the weights the learner publishes), TLS and mutual
TLS by configuration, keepalive, and a message size limit checked by gRPC before any work.

Each trajectory is judged as its producer's: the caller's identity (security.caller_identity,
the bearer token's hash with auth on, else the peer's host) is what ingest.producer_share
counts. A stream yields to the event loop after each trajectory, so one producer's stream
cannot hold the loop while others wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from rollwire.common.errors import RollwireError
from rollwire.common.keepalive import DEFAULT as DEFAULT_KEEPALIVE
from rollwire.learner.config import IngestSection
from rollwire.learner.ingest.check import BehaviourCheck
from rollwire.learner.ingest.intake import Ingest, Trajectory, bad_trajectory, check_shape
from rollwire.learner.ingest.receipts import ReceiptCheck
from rollwire.runtime.logs import get_logger
from rollwire.runtime.security import TokenAuth, add_port, caller_identity, interceptors, warn_if_exposed
from rollwire.v1 import learner_pb2 as lpb
from rollwire.v1 import learner_pb2_grpc

log = get_logger(__name__)
OK = lpb.TrajectoryStatus()


def trajectory(message: lpb.Trajectory) -> Trajectory:
    """The wire message as ingest/intake.py judges it."""
    return Trajectory(
        group_id=message.group_id,
        group_size=message.group_size,
        prompt_token_ids=list(message.prompt_token_ids),
        token_ids=list(message.token_ids),
        loss_mask=list(message.loss_mask),
        logprobs=list(message.logprobs),
        token_versions=list(message.token_versions),
        reward=message.reward,
        correct=message.correct,
        trajectory_id=message.trajectory_id,
    )


def status(err: RollwireError) -> lpb.TrajectoryStatus:
    retry_ms = round(err.retry_after_s * 1000) if err.retry_after_s is not None else 0
    return lpb.TrajectoryStatus(
        code=err.code.value[0], reason=err.reason or err.code.name, message=err.message, retry_after_ms=retry_ms
    )


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    """Answers every trajectory with its status; the judging is Ingest's."""

    def __init__(
        self,
        ingest: Ingest,
        adapter_name: str,
        fingerprint: str,
        check: BehaviourCheck | None = None,
        receipts: ReceiptCheck | None = None,
    ) -> None:
        self.ingest, self.adapter_name, self.fingerprint = ingest, adapter_name, fingerprint
        self.check = check
        """ingest.max_logprob_gap's check (ingest/check.py), run after the shape check; None: off."""
        self.receipts = receipts
        """ingest.receipt_keys_file's check (ingest/receipts.py), run after the shape check; None: off."""

    async def SubmitTrajectories(
        self, request_iterator: AsyncIterator[lpb.SubmitTrajectoriesRequest], context
    ) -> AsyncIterator[lpb.SubmitTrajectoriesResponse]:
        index = 0
        producer = caller_identity(context.invocation_metadata(), context.peer(), self.ingest.cfg.auth.enabled())
        async for request in request_iterator:
            t = request.trajectory
            complete, result = False, OK
            try:
                if not request.HasField("trajectory"):
                    bad_trajectory("the request carries no trajectory")
                taken = trajectory(t)
                claims = await self._verify(taken, t) if self.check or self.receipts else []
                complete = self._submit(taken, producer, claims)
            except RollwireError as err:
                result = status(err)
                log.info(
                    "trajectory_refused",
                    producer=producer,
                    group_id=t.group_id[:64],
                    reason=result.reason,
                    message=err.message,
                )
            yield lpb.SubmitTrajectoriesResponse(
                index=index,
                trajectory_id=t.trajectory_id,
                group_id=t.group_id,
                status=result,
                group_complete=complete,
                newest_version=self.ingest.newest(),
                oldest_version=self.ingest.oldest,
            )
            index += 1
            await asyncio.sleep(0)  # the other producers' streams and the learner's loop get their turn

    async def _verify(self, t: Trajectory, message: lpb.Trajectory) -> list[str]:
        """The provenance check, then the behaviour check, on a well-formed trajectory only (limits
        before work; the cheap check before the one that scores); a refusal is counted as Ingest
        counts its own. Returns the receipts' sample ids, to claim when it is taken."""
        try:
            check_shape(t, self.ingest.cfg, self.ingest.vocab_size)
            claims = []
            if self.receipts is not None:  # up to 256 Ed25519 verifies and a pass of hashing: off the loop
                claims = await asyncio.to_thread(self.receipts.verify, message)
            if self.check is not None:
                await self.check.verify(t.prompt_token_ids, t.token_ids, t.logprobs, t.token_versions, t.loss_mask)
        except RollwireError as err:
            self.ingest.counts[err.reason] += 1
            self.ingest.on_outcome(err.reason, None)
            raise
        return claims

    def _submit(self, t: Trajectory, producer: str, claims: list[str]) -> bool:
        """Into the buffer, its receipts claimed at once (no await between: two streams cannot
        both take one receipt) and given back if the buffer refuses it (a producer may resend)."""
        if self.receipts is None:
            return self.ingest.submit(t, producer)
        self.receipts.claim(claims)
        try:
            return self.ingest.submit(t, producer)
        except BaseException:
            self.receipts.release(claims)
            raise

    async def GetIngestStatus(self, request: lpb.GetIngestStatusRequest, context) -> lpb.GetIngestStatusResponse:
        self.ingest.expire()
        return lpb.GetIngestStatusResponse(
            newest_version=self.ingest.newest(),
            oldest_version=self.ingest.oldest,
            pending_groups=self.ingest.pending(),
            max_pending_groups=self.ingest.cfg.max_pending_groups,
            adapter_name=self.adapter_name,
            model_fingerprint=self.fingerprint,
            vocab_size=self.ingest.vocab_size,
        )


async def serve_ingest(cfg: IngestSection, servicer: LearnerServicer) -> tuple[grpc.aio.Server, int]:
    """Start LearnerService on ingest.host:ingest.port; returns the server and its bound port."""
    options = [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", 1 << 20),
        ("grpc.so_reuseport", 0),
        *DEFAULT_KEEPALIVE.server_options(),
    ]
    server = grpc.aio.server(options=options, interceptors=interceptors(TokenAuth.from_config(cfg.auth)))
    learner_pb2_grpc.add_LearnerServiceServicer_to_server(servicer, server)
    port = add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls)
    if port == 0:
        raise SystemExit(f"cannot listen on {cfg.host}:{cfg.port} (ingest.port); is the port in use?")
    warn_if_exposed("learner ingest", cfg.host, port, cfg.auth, cfg.tls)
    await server.start()
    log.info("ingest_serving", host=cfg.host, port=port)
    return server, port
