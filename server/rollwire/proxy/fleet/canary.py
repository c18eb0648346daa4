"""The check a self-registered member passes before it serves anyone: a canary it cannot pass by
echoing public facts (a fingerprint, limits), because it must compute what the base model computes.

Invariants:
- a member a `register` token added (`Replica.member`) is vetted before it is caught up or routed:
  its greedy tokens and logprobs for CANARY_PROMPT on the base model must equal a trusted
  routable replica's (configured, discovered, admin-registered, or a member that passed) within
  `registration.canary_tolerance`; until one such replica answers, the member waits, unrouted;
- a member whose answer differs is refused for as long as it stays registered: never routed, never
  pushed to, named in its status, the `member_canary_failed` log line and
  `rollwire_proxy_member_refusals_total{why="canary"}`; a call that fails is tried again at the
  next status refresh (the member is not refused for being slow);
- the trusted answer is asked once per base model and kept (the fleet's base model never changes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

if TYPE_CHECKING:
    from rollwire.proxy.config import RegistrationSection
    from rollwire.proxy.fleet.replica import Replica
    from rollwire.proxy.metrics import ProxyMetrics

log = get_logger(__name__)
CANARY_PROMPT = "rollwire canary: 1+1=2, 2+2=4, 3+3="
CANARY_TOKENS = 8


@dataclass(frozen=True)
class Answer:
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]


async def ask(replica: Replica, timeout_s: float) -> Answer:
    """The replica's greedy answer to the canary prompt on the base model (raises AioRpcError)."""
    request = pb.GenerateRequest(
        request_id="rollwire-canary",
        text=CANARY_PROMPT,
        n=1,
        sampling=pb.SamplingParams(max_new_tokens=CANARY_TOKENS, temperature=0.0, seed=0),
    )
    tokens: list[int] = []
    logprobs: list[float] = []
    async for message in replica.generator.Generate(request, timeout=timeout_s, metadata=replica.metadata):
        for chunk in message.tokens:
            if chunk.sample_index == 0:
                tokens.extend(chunk.token_ids)
                logprobs.extend(chunk.logprobs)
    return Answer(tuple(tokens), tuple(logprobs))


def difference(trusted: Answer, answer: Answer, tolerance: float) -> str:
    """Why `answer` is not `trusted`'s within `tolerance`, in words; "" when it is."""
    if answer.tokens != trusted.tokens:
        return f"its greedy tokens {list(answer.tokens)} differ from a trusted replica's {list(trusted.tokens)}"
    if len(answer.logprobs) != len(answer.tokens):
        return f"it gave {len(answer.logprobs)} logprobs for {len(answer.tokens)} tokens"
    worst = max((abs(a - b) for a, b in zip(answer.logprobs, trusted.logprobs, strict=True)), default=0.0)
    if not worst <= tolerance:  # NaN is a difference too
        return f"its logprobs differ from a trusted replica's by up to {worst:.4g} (registration.canary_tolerance is {tolerance:g})"
    return ""


class Canary:
    def __init__(self, section: RegistrationSection, metrics: ProxyMetrics) -> None:
        self.section, self.metrics = section, metrics
        self._trusted: dict[str, Answer] = {}
        """The trusted answer, by base-model fingerprint."""

    async def vet(self, member: Replica, trusted: list[Replica], fingerprint: str) -> bool:
        """Whether `member` may go on to catch-up and rotation now; sets its `vetted`, or its
        `refused` (a wrong answer) or `detail` (why it waits)."""
        if not self.section.canary:
            member.vetted = True
            return True
        reference = await self._reference(trusted, fingerprint)
        if reference is None:
            member.detail = (
                "waiting to run its canary: no trusted replica (configured, discovered, admin-registered or one "
                "that passed) is routable to compare its answer with"
            )
            return False
        try:
            answer = await ask(member, self.section.canary_timeout_s)
        except grpc.aio.AioRpcError as exc:
            member.detail = f"its canary call failed with {exc.code().name}: {exc.details()}; trying again"
            return False
        why = difference(reference, answer, self.section.canary_tolerance)
        if why:
            member.refused = f"it failed the canary: {why}"
            self.metrics.member_refusals.labels("canary").inc()
            log.error("member_canary_failed", replica=member.address, identity=member.identity, why=why)
            return False
        member.vetted = True
        log.info("member_canary_passed", replica=member.address, identity=member.identity, tokens=len(answer.tokens))
        return True

    async def _reference(self, trusted: list[Replica], fingerprint: str) -> Answer | None:
        if fingerprint in self._trusted:
            return self._trusted[fingerprint]
        for replica in trusted:
            try:
                answer = await ask(replica, self.section.canary_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning("canary_reference_failed", replica=replica.address, code=exc.code().name)
                continue
            if answer.tokens:
                self._trusted[fingerprint] = answer
                return answer
        return None
