"""The policy losses a run can select with `train.loss`, named once in LOSSES.

A loss is one function with one signature:

    loss(batch: LossBatch, cfg: TrainSection) -> LossTerms

`LossBatch` (grpo.py) holds one micro-batch's per-token tensors, all [B, T] and aligned with
the shifted targets: the current policy's logprobs (with grad), the behaviour logprobs the
replicas reported when sampling, each sample's advantage repeated on its tokens, the mask of
completion tokens, the reference (base model) logprobs when `train.kl_coef > 0` (else None),
and the step's completion-token count as `normaliser`. The loss must be a sum over masked
tokens divided by `normaliser`, so micro-batches accumulate to the full step's loss; it reads
its own knobs from `cfg` and returns the LossTerms the trainer reports.

This module imports no torch: the config validates `train.loss` against LOSSES, and the
trainer imports the function (`LOSSES.load`) when it is built. Adding a loss: a function
with this signature and one `LOSSES.register` line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rollwire.runtime.registry import Registry

if TYPE_CHECKING:
    from rollwire.learner.config import TrainSection
    from rollwire.learner.grpo import LossBatch, LossTerms

Loss = Callable[["LossBatch", "TrainSection"], "LossTerms"]

LOSSES: Registry[Loss] = Registry("loss")
LOSSES.register(
    "clipped",
    "rollwire.learner.grpo:clipped_loss",
    "PPO's clipped surrogate (clip_low/clip_high), truncated at ratio_cap for negative advantages, "
    "+ kl_coef x k3 KL to the base model; per-token mean over the step",
)

__all__ = ["LOSSES", "Loss"]
