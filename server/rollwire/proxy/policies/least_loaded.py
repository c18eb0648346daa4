"""Least outstanding work by the power of two choices.

Two random candidates are compared and the one with less outstanding work wins (in-flight
groups break ties). Comparing two instead of scanning all keeps the choice nearly as good as
the global minimum while avoiding herding: several proxies reading the same stale loads do
not all pile onto the one least-loaded replica.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rollwire.proxy.policies.base import Candidate


class LeastLoaded:
    name = "least-loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], key: bytes) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self.rng.sample(list(candidates), 2)
        return min((a, b), key=lambda c: (c.work, c.in_flight))
