"""Which rollouts the learner requests, keeps and trains on: pure functions of a few numbers.

The three gates, in the order a group meets them:
1. `may_request`: a request starts only if the version it will be served with can still be
   trained on when its batch comes; in the synchronous mode (max_staleness 0) that means only
   once the previous step's push is served.
2. `buffer_refusal`: a scored group enters the buffer unless every sample has the same reward
   (its group-relative advantages are all zero: it would cost a step's share and teach nothing).
3. `split_stale`: a buffered group reaches the loss only if its oldest token is at most
   `max_staleness` versions behind the version the batch is trained at.

Gate 3 is the guarantee (the buffer applies it when a batch is taken); gate 1 only keeps the
producer from generating groups that gate 3 would throw away.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollwire.learner.rollouts.groups import ScoredGroup


def staleness(group: ScoredGroup, version: int) -> int:
    """How many versions behind `version` the group's oldest token is."""
    return version - group.min_version


def split_stale(
    groups: Sequence[ScoredGroup], version: int, max_staleness: int
) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
    """(fresh, stale) for training at `version`; order is kept."""
    fresh = [g for g in groups if staleness(g, version) <= max_staleness]
    stale = [g for g in groups if staleness(g, version) > max_staleness]
    return fresh, stale


def buffer_refusal(group: ScoredGroup, keep_zero_variance: bool) -> str | None:
    """The ledger's drop reason for a scored group kept out of the buffer, or None to keep it."""
    if group.zero_variance and not keep_zero_variance:
        return "zero_variance"
    return None


def may_request(
    *, served: int, next_train_version: int, pending: int, groups_per_step: int, max_staleness: int
) -> bool:
    """Whether a new request may start now.

    The groups ahead of it are `pending` (requested, not yet trained or dropped) and the buffer
    is first in, first out, so the new group lands in the batch trained at about
    `next_train_version + pending // groups_per_step`. It is sampled at `served` or newer, so
    it will be fresh enough for that batch when `served` is at most `max_staleness` behind.
    Drops ahead of it only move it to an earlier batch, where it is fresher.
    """
    lands_at = next_train_version + pending // groups_per_step
    return served >= lands_at - max_staleness
