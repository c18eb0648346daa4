"""Ingestion's behaviour check: a producer's claimed behaviour logprobs against Score's.

With `ingest.max_logprob_gap` > 0, every trajectory whose shape passed (ingest.check_shape) is
scored on the replicas before the learner takes it: for each adapter version its trained tokens
name, one Score request (the trajectory's prompt, then all its later tokens, under
`adapter_name@version`) returns the logprob the version gives each token, and any trained token
whose claimed logprob is further than the bound from it refuses the whole trajectory with
INVALID_ARGUMENT BEHAVIOUR_MISMATCH, naming the first such token. Environment tokens (loss
mask false) are scored as context only.

What it proves and what it does not: Score's logprobs are the raw log-softmax at temperature 1,
untruncated, so the check fits producers that sample that way (the learner's own rollouts do
unless `rollout.temperature`/top-k/top-p say otherwise); a producer sampling tempered or
truncated reports other logprobs and needs a wider bound or the check off. A version the
replicas no longer hold, or a fleet that cannot answer, refuses the trajectory with Score's own
status (a producer may resend it after the hint).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason

Score = Callable[..., Awaitable[Any]]
"""AsyncClient.score: (sequences, *, adapter=...) -> a result with `.logprobs` per sequence."""


def trained_by_version(versions: Sequence[int], mask: Sequence[bool]) -> dict[int, list[int]]:
    """Positions (after the prompt) of the trained tokens, by the version each names."""
    out: dict[int, list[int]] = {}
    for j, (version, trained) in enumerate(zip(versions, mask, strict=True)):
        if trained:
            out.setdefault(version, []).append(j)
    return out


def first_gap(claimed: Sequence[float], scored: Sequence[float], positions: list[int], bound: float):
    """(position, claimed, scored) of the first trained token whose gap exceeds `bound`, or None."""
    for j in positions:
        if not abs(claimed[j] - scored[j]) <= bound:  # NaN is beyond any bound
            return j, claimed[j], scored[j]
    return None


class BehaviourCheck:
    """Checks each trajectory's behaviour logprobs with `score` (the learner's client to the
    fleet) under `adapter_name`; see the module docstring."""

    def __init__(self, bound: float, score: Score, adapter_name: str, timeout_s: float = 30.0) -> None:
        self.bound, self.score, self.adapter_name, self.timeout_s = bound, score, adapter_name, timeout_s

    async def verify(self, prompt: list[int], tokens: list[int], logprobs: list[float], versions, mask) -> None:
        """Return when every trained token is within the bound; raise the refusal otherwise."""
        for version, positions in sorted(trained_by_version(versions, mask).items()):
            result = await self.score(
                [(prompt, tokens)], adapter=f"{self.adapter_name}@{version}", timeout=self.timeout_s
            )
            gap = first_gap(logprobs, result.logprobs[0], positions, self.bound)
            if gap is not None:
                j, claimed, scored = gap
                raise InvalidArgument(
                    f"token {j} after the prompt claims behaviour logprob {claimed:.6g}, but version {version} of "
                    f"{self.adapter_name} gives it {scored:.6g} (temperature 1, untruncated): more than "
                    f"ingest.max_logprob_gap ({self.bound:g}) apart; send the logprobs the version reported",
                    reason=Reason.BEHAVIOUR_MISMATCH,
                )
