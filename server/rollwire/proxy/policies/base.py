"""The routing-policy interface: pick one replica for one GRPO group.

A policy is pure: it sees only a snapshot of candidates (replicas that are routable, hold
the adapter version the group needs and have a free slot) and the group's routing key. It
never sees a replica that cannot serve the group, so a policy cannot break version-aware
routing or backpressure; it only decides among equals. A group is never split: one request
is one choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    """One replica as a policy sees it."""

    address: str
    in_flight: int = 0
    """Groups this proxy runs on it now."""
    work: int = 0
    """Outstanding work of those groups, in sample-tokens (n * max_new_tokens each)."""


class PolicyTuning(Protocol):
    """The `[routing]` keys a policy's factory reads (the proxy config's RoutingSection has them all)."""

    affinity_load_factor: float
    affinity_min_gap: int
    prefix_block: int
    prefix_index_entries: int


class Policy(Protocol):
    """Chooses a replica for a group; `candidates` is never empty."""

    name: str

    def choose(self, candidates: Sequence[Candidate], key: bytes) -> Candidate:
        """The candidate that should run the group whose routing key is `key`."""
        ...


def routing_key(group_key: str, text: str | None, token_ids: Sequence[int] | None, prefix: int) -> bytes:
    """The bytes affinity hashes: the group key when the caller gave one, else the prompt's
    first `prefix` tokens (characters for a text prompt, which the proxy does not tokenize),
    so requests sharing a prompt prefix share a replica's prefix cache."""
    if group_key:
        return b"k:" + group_key.encode()
    if token_ids is not None:
        return b"t:" + b",".join(str(t).encode() for t in token_ids[:prefix])
    return b"s:" + (text or "")[:prefix].encode()
