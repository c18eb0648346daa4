"""Round robin over the candidates, in address order.

The cursor remembers the last address served rather than an index, so replicas joining or
leaving do not make it skip or repeat the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollwire.proxy.policies.base import Candidate


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self.last = ""

    def choose(self, candidates: Sequence[Candidate], key: bytes) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.address)
        chosen = next((c for c in ordered if c.address > self.last), ordered[0])
        self.last = chosen.address
        return chosen
