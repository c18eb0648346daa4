"""Routing policies, one module each behind the `Policy` protocol (see base.py)."""

from __future__ import annotations

from rollwire.proxy.policies.affinity import Affinity
from rollwire.proxy.policies.base import Candidate, Policy, routing_key
from rollwire.proxy.policies.least_loaded import LeastLoaded
from rollwire.proxy.policies.round_robin import RoundRobin

POLICY_NAMES = ("least-loaded", "round-robin", "affinity")


def make_policy(name: str, *, affinity_load_factor: float = 1.25, affinity_min_gap: int = 4) -> Policy:
    """The policy called `name` (one of POLICY_NAMES)."""
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    if name == "affinity":
        return Affinity(load_factor=affinity_load_factor, min_gap=affinity_min_gap)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = ["POLICY_NAMES", "Affinity", "Candidate", "LeastLoaded", "Policy", "RoundRobin", "make_policy", "routing_key"]
