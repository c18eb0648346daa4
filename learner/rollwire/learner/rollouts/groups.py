"""The scored group: what the producer and the ingest service hand the buffer, and the trainer
and the loss read. A types module with no logic beyond derived properties, so the buffer, its
admission rules, the trainer and the reports can all import it without importing each other.

Invariants: a ScoredSample's token sequences are parallel (lists from the learner's producer,
compact arrays from ingestion: ingest.room.compact_sample); a group's min_version is the oldest
adapter version among its trained tokens (environment tokens carry none), else the version the
request was served with.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollwire.learner.tasks.task import Example


@dataclass
class ScoredSample:
    """One completion with what the loss needs; token sequences are parallel."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    """Behaviour logprobs, as the generator sampled them."""
    token_versions: Sequence[int]
    """Adapter version that produced each token."""
    text: str
    finish_reason: str
    reward: float
    correct: bool
    kept_tokens: list[list[int]] = field(default_factory=list)
    """When sampled with top-k/top-p and asked for: each token's kept set (empty: the whole
    vocabulary), so the loss computes its logprob over the same truncated distribution."""
    loss_mask: Sequence[int] = field(default_factory=list)
    """Parallel to token_ids, truthy where trained: False (0) for an environment or tool token of a multi-turn sample
    (ingested), which never reaches the loss and whose logprob and version mean nothing;
    empty: every token was sampled by the model and is trained."""
    ref_logprobs: Sequence[float] = ()
    """Parallel to token_ids when train.kl_reference is "replicas": the base model's logprob of each token, scored
    by the replicas (Score) before the step; empty: the trainer computes it itself."""

    @property
    def trained_mask(self) -> Sequence[int]:
        """Which tokens the loss sees (loss_mask, or all of them)."""
        return self.loss_mask or [True] * len(self.token_ids)

    @property
    def trained_versions(self) -> Sequence[int]:
        """Versions of the tokens the model sampled (environment tokens have none)."""
        if not self.loss_mask:
            return self.token_versions
        return [v for v, m in zip(self.token_versions, self.loss_mask, strict=True) if m]


@dataclass
class ScoredGroup:
    """A complete, scored GRPO group."""

    example: Example
    prompt_ids: Sequence[int]
    samples: list[ScoredSample]
    adapter_version: int
    """Version the request was served with ("latest" resolved); used when a sample has no tokens."""
    replica: str = ""
    source: str = "producer"
    """Who made it: "producer" (the learner's own) or "ingest" (an external producer, ingest/intake.py)."""
    producer: str = ""
    """For an ingested group, the external producer that sent it (security.caller_identity); logs name it."""
    created_at: float = field(default_factory=time.monotonic)

    @property
    def min_version(self) -> int:
        versions = [v for s in self.samples for v in s.trained_versions]
        return min(versions) if versions else self.adapter_version

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def zero_variance(self) -> bool:
        rewards = self.rewards
        return max(rewards) - min(rewards) < 1e-12
