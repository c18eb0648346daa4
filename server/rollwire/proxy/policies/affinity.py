"""Group affinity: a bounded-load consistent hash of the routing key.

Each replica owns `vnodes` points on a hash ring; a key goes to the owner of the first
point at or after its hash, so repeated prompts (or one group_key) keep landing on the same
replica and reuse its prefix cache, and a replica joining or leaving moves only the keys it
owns. Bounded load (Mirrokni et al.): when the owner already runs more than `load_factor`
times the average number of groups, and at least `min_gap` groups more than the least-loaded
candidate, the key spills to that candidate, so one hot prompt cannot pile work onto one
replica. The gap matters at small loads, where the bound alone (rounded up to whole groups)
would spill a group for a difference of one or two, losing its prefix cache for nothing.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

from rollwire.proxy.policies.base import Candidate


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """Points of every replica on a 64-bit ring; rebuilt only when membership changes."""

    def __init__(self, addresses: Sequence[str], vnodes: int) -> None:
        points = sorted((_hash(f"{a}#{i}".encode()), a) for a in addresses for i in range(vnodes))
        self.hashes = [h for h, _ in points]
        self.owners = [a for _, a in points]

    def owner(self, key: bytes) -> str:
        i = bisect.bisect_left(self.hashes, _hash(key)) % len(self.hashes)
        return self.owners[i]


class Affinity:
    name = "affinity"

    def __init__(self, load_factor: float = 1.25, min_gap: int = 4, vnodes: int = 64) -> None:
        if load_factor < 1 or min_gap < 0:
            raise ValueError("load_factor must be >= 1 and min_gap >= 0")
        self.load_factor, self.min_gap, self.vnodes = load_factor, min_gap, vnodes
        self._ring: HashRing | None = None
        self._members: frozenset[str] = frozenset()

    def choose(self, candidates: Sequence[Candidate], key: bytes) -> Candidate:
        by_address = {c.address: c for c in candidates}
        owner = by_address[self._ring_for(by_address).owner(key)]
        total = sum(c.in_flight for c in candidates)
        bound = math.ceil(self.load_factor * (total + 1) / len(candidates))
        least = min(candidates, key=lambda c: (c.in_flight, c.work, c.address))
        if owner.in_flight + 1 <= bound or owner.in_flight - least.in_flight < self.min_gap:
            return owner
        return least

    def _ring_for(self, by_address: dict[str, Candidate]) -> HashRing:
        members = frozenset(by_address)
        if self._ring is None or members != self._members:
            self._ring, self._members = HashRing(sorted(members), self.vnodes), members
        return self._ring
