"""Routing policies, one module each behind the `Policy` protocol (base.py), named once in POLICIES.

POLICIES is the only place a policy's name is written: the proxy config's `policy` field,
the `--policy` choices, `make_policy`, the policy contract tests (tests/unit/proxy/test_routing_policies.py)
and the docs check (tests/unit/repo/test_registries.py) read it. An entry names a factory
`factory(routing: PolicyTuning) -> Policy` that takes its tuning from the proxy's
`[routing]` section (the keys PolicyTuning names). Adding a policy: its module, with such a
factory, and one `POLICIES.register(...)` line here. This package imports nothing of the
proxy's but itself, so the config can name the policies without a circle.
"""

from __future__ import annotations

from collections.abc import Callable

from rollwire.proxy.policies.affinity import Affinity
from rollwire.proxy.policies.base import Candidate, Policy, PolicyTuning, routing_key
from rollwire.proxy.policies.least_loaded import LeastLoaded
from rollwire.proxy.policies.prefix import PrefixAware
from rollwire.proxy.policies.round_robin import RoundRobin
from rollwire.runtime.registry import Registry

PolicyFactory = Callable[[PolicyTuning], Policy]

POLICIES: Registry[PolicyFactory] = Registry("routing policy")
POLICIES.register("least-loaded", lambda routing: LeastLoaded(), "least outstanding work of two random choices")
POLICIES.register("round-robin", lambda routing: RoundRobin(), "each replica in turn")
POLICIES.register(
    "affinity",
    lambda routing: Affinity(load_factor=routing.affinity_load_factor, min_gap=routing.affinity_min_gap),
    "bounded-load consistent hash of group_key or the prompt's first tokens (prefix-cache reuse)",
)
POLICIES.register(
    "prefix",
    lambda routing: PrefixAware(
        block=routing.prefix_block,
        max_entries=routing.prefix_index_entries,
        load_factor=routing.affinity_load_factor,
        min_gap=routing.affinity_min_gap,
    ),
    "where the prompt's longest recently served prefix was served (prefix-cache reuse), bounded load",
)


def make_policy(name: str, routing: PolicyTuning) -> Policy:
    """The policy registered as `name`, tuned by `routing` (the proxy's `[routing]` section)."""
    return POLICIES.load(name)(routing)


__all__ = [
    "POLICIES",
    "Affinity",
    "Candidate",
    "LeastLoaded",
    "Policy",
    "PolicyFactory",
    "PolicyTuning",
    "PrefixAware",
    "RoundRobin",
    "make_policy",
    "routing_key",
]
