"""The policy losses a run can select with `train.loss`, named once in LOSSES, and the types of
the seam every loss plugs into.

A loss is one function with one signature:

    loss(batch: LossBatch, cfg: LossSettings) -> LossTerms

`LossBatch` holds one micro-batch's per-token tensors, all [B, T] and aligned with the shifted
targets: the current policy's logprobs (with grad), the behaviour logprobs the replicas
reported when sampling, each sample's advantage repeated on its tokens, the mask of
completion tokens, the reference (base model) logprobs when `train.kl_coef > 0` (else None),
and the step's completion-token count as `normaliser`. The loss must be a sum over masked
tokens divided by `normaliser`, so micro-batches accumulate to the full step's loss; it reads
its own knobs from `cfg` (the run's `train` section, which LossSettings describes) and returns
the LossTerms the trainer reports.

This module imports no torch and nothing of the learner's: the config validates `train.loss`
against LOSSES, and the trainer imports the function (`LOSSES.load`) when it is built. Adding
a loss: a function with this signature, one `LOSSES.register` line here, and any new knob in
both TrainSection (config.py) and LossSettings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rollwire.runtime.registry import Registry

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LossBatch:
    """One micro-batch as every loss sees it: [B, T] tensors aligned with the shifted targets."""

    logp: torch.Tensor
    """Current-policy logprobs of the sampled tokens, with grad."""
    behaviour_logp: torch.Tensor
    """Logprobs the replicas reported when they sampled these tokens."""
    advantages: torch.Tensor
    """Each sample's advantage repeated on its tokens."""
    mask: torch.Tensor
    """1 on completion tokens, 0 on prompt and padding."""
    ref_logp: torch.Tensor | None
    """Base-model logprobs (adapter disabled) when train.kl_coef > 0, else None."""
    normaliser: float
    """Completion tokens in the whole step: the loss is a sum divided by it."""


@dataclass
class LossTerms:
    """The loss to backpropagate and what to report about it (floats are detached)."""

    loss: torch.Tensor
    tokens: int
    ratio_sum: float
    ratio_min: float
    ratio_max: float
    clipped: int
    """Tokens whose gradient the PPO clip removed."""
    truncated: int
    """Tokens whose importance weight hit ratio_cap."""
    kl_sum: float


class LossSettings(Protocol):
    """The `train` keys a loss reads (TrainSection has them all; config.py documents each)."""

    clip_low: float
    clip_high: float
    ratio_cap: float
    kl_coef: float


Loss = Callable[[LossBatch, LossSettings], LossTerms]

LOSSES: Registry[Loss] = Registry("loss")
LOSSES.register(
    "clipped",
    "rollwire.learner.train.grpo:clipped_loss",
    "PPO's clipped surrogate (clip_low/clip_high), truncated at ratio_cap for negative advantages, "
    "+ kl_coef x k3 KL to the base model; per-token mean over the step",
)

__all__ = ["LOSSES", "Loss", "LossBatch", "LossSettings", "LossTerms"]
