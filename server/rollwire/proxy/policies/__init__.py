"""Routing policies, one module each behind the `Policy` protocol (base.py), named once in POLICIES.

POLICIES is the only place a policy's name is written: the proxy config's `policy` field,
the `--policy` choices, `make_policy`, the policy contract tests (tests/test_routing_policies.py)
and the docs check (tests/test_registries.py) read it. An entry names a factory
`factory(routing: RoutingSection) -> Policy` that takes its tuning from the proxy's
`[routing]` section. Adding a policy: its module, with such a factory, and one
`POLICIES.register(...)` line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rollwire.proxy.policies.affinity import Affinity
from rollwire.proxy.policies.base import Candidate, Policy, routing_key
from rollwire.proxy.policies.least_loaded import LeastLoaded
from rollwire.proxy.policies.prefix import PrefixAware
from rollwire.proxy.policies.round_robin import RoundRobin
from rollwire.runtime.registry import Registry

if TYPE_CHECKING:
    from rollwire.proxy.config import RoutingSection

PolicyFactory = Callable[["RoutingSection"], Policy]

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


def make_policy(name: str, routing: RoutingSection | None = None, **settings: object) -> Policy:
    """The policy registered as `name`, tuned by `routing` (default: the `[routing]` defaults)
    with `settings` (RoutingSection keys, e.g. affinity_min_gap=2) applied on top."""
    from rollwire.proxy.config import RoutingSection

    factory = POLICIES.load(name)
    base = routing if routing is not None else RoutingSection()
    return factory(RoutingSection.model_validate({**base.model_dump(), **settings}) if settings else base)


__all__ = [
    "POLICIES",
    "Affinity",
    "Candidate",
    "LeastLoaded",
    "Policy",
    "PolicyFactory",
    "PrefixAware",
    "RoundRobin",
    "make_policy",
    "routing_key",
]
