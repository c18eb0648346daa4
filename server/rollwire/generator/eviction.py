"""Who gives up an engine LoRA slot when a replica loads an adapter version (issue 35).

Two limits meet here, and one function (`decide`) applies both, one step at a time:
- the engine's slots (`max_loaded`, over all names; a served engine's LoRA slots; 0 = no limit);
- each tenant's slots (`TenantSlotsSection`, the replica's `[tenant_slots]`): how many versions
  of one tenant's names (`TENANT:NAME`, rollwire.common.manifest.QUALIFIED_RE) the engine holds
  at once, staged ones included. Names of no tenant (the fleet's and shared adapters) are not
  limited by it. It applies to every engine, the unbounded transformers engine too.

Invariants:
- only an evictable version is ever unloaded: servable, held by no request, its bytes kept, so
  it is loaded again when a request names it; a lease is never broken;
- a tenant at its quota gives up its OWN least recently used evictable version; when it has none
  (each of its loaded versions serves a request or is staged) the load is refused (RESOURCE_EXHAUSTED
  `TENANT_SLOTS_FULL`), never paid for by another tenant. So no load ever takes a tenant beyond its
  quota, and "a tenant over its quota" needs no tier of its own below;
- when the engine's slots are full, the victim is the least recently used evictable version of, in
  order: a name of no tenant, the loader's own tenant, anyone. So a load takes a slot from another
  tenant (within its quota, by the rule above) only when neither the unowned names nor the loader
  have one to give; with quotas that fit the slots (the quotas plus the unowned names' versions at
  most `max_loaded`) the engine is never full while the loader is within its quota, and that never
  happens: eviction of a tenant's adapters follows its own quota, not another tenant's traffic;
- when every loaded version is held, nothing is evicted and the engine decides (a served engine
  refuses with `ADAPTER_SLOTS_FULL`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pydantic import Field, field_validator

from rollwire.common.errors import ResourceExhausted
from rollwire.common.manifest import NAME_RE, NAME_RULE, TENANT_SEPARATOR
from rollwire.common.reasons import Reason
from rollwire.push.buffers import Payload
from rollwire.runtime.config import Section

ROOM, QUOTA_REFUSED, FULL_HELD = "room", "quota_refused", "full_held"
QUOTA_OWN, FULL_UNOWNED, FULL_OWN, FULL_OTHER = "quota_own", "full_unowned", "full_own", "full_other"
OUTCOMES = (ROOM, QUOTA_OWN, FULL_UNOWNED, FULL_OWN, FULL_OTHER, QUOTA_REFUSED, FULL_HELD)
"""Each step of `decide`, the label of rollwire_generator_adapter_slot_decisions_total (docs/metrics.md)."""


class TenantSlotsSection(Section):
    """LoRA slots one tenant's adapters may hold in this replica's engine at once (docs/deploy.md, "Tenants"):
    a tenant loading beyond them unloads its own least recently used version no request holds (its bytes kept),
    and is refused (RESOURCE_EXHAUSTED, TENANT_SLOTS_FULL) when each of its versions serves a request. Names of no
    tenant (the fleet's and shared adapters) are not limited."""

    default: int = Field(default=0, ge=0)
    """Versions each tenant may have loaded at once, all its names together; 0 = no per-tenant limit."""
    tenants: dict[str, int] = Field(default_factory=dict)
    """Per-tenant overrides of `default`, by the proxy's tenant names ({"team-a" = 4}); 0 = no limit for that one."""

    @field_validator("tenants")
    @classmethod
    def _tenants(cls, value: dict[str, int]) -> dict[str, int]:
        for tenant, slots in value.items():
            if not NAME_RE.fullmatch(tenant):
                raise ValueError(f"tenant {tenant!r}: a tenant's name is {NAME_RULE}")
            if slots < 0:
                raise ValueError(f"tenant {tenant!r}: slots must be >= 0 (0 = no limit), not {slots}")
        return value

    def quota(self, tenant: str) -> int:
        """The slots of `tenant` (0: no limit)."""
        return self.tenants.get(tenant, self.default)

    def setting(self, tenant: str) -> str:
        """The key that sets `tenant`'s slots, for a sentence."""
        return f"tenant_slots.tenants[{tenant!r}]" if tenant in self.tenants else "tenant_slots.default"


def tenant_of(name: str) -> str:
    """The tenant of an adapter name as the fleet holds it ('' for the fleet's and shared names)."""
    tenant, sep, _ = name.partition(TENANT_SEPARATOR)
    return tenant if sep else ""


class Slot(Protocol):
    """What the policy reads of a loaded version (adapters._Version)."""

    version: int
    used: int
    leases: int
    servable: bool
    payload: Payload | None


V = TypeVar("V", bound=Slot)


@dataclass(frozen=True)
class Decision(Generic[V]):
    """One step of making room: unload `victim` and ask again, or load (`victim` None), or refuse."""

    outcome: str
    victim: V | None = None
    tenant: str = ""
    count: int = 0
    """The loader's tenant and the versions it has loaded now (staged included): the refusal's numbers."""


def evictable(v: Slot) -> bool:
    return v.leases == 0 and v.servable and v.payload is not None


def lru(versions: Iterable[V]) -> V | None:
    return min(versions, key=lambda v: (v.used, v.version), default=None)


def decide(
    name: str, loaded: Sequence[tuple[str, V]], staged: Iterable[str], slots: TenantSlotsSection, max_loaded: int
) -> Decision[V]:
    """The next step before loading a version of `name`, given the loaded versions (name, version) and the
    staged names; the caller unloads the victim and asks again until the outcome is ROOM or FULL_HELD."""
    staged = list(staged)
    tenant = tenant_of(name)
    quota = slots.quota(tenant) if tenant else 0
    if quota:
        mine = [v for n, v in loaded if tenant_of(n) == tenant]
        count = len(mine) + sum(tenant_of(n) == tenant for n in staged)
        if count >= quota:
            victim = lru(v for v in mine if evictable(v))
            if victim is None:
                return Decision(QUOTA_REFUSED, tenant=tenant, count=count)
            return Decision(QUOTA_OWN, victim, tenant, count)
    if not max_loaded or len(loaded) + len(staged) < max_loaded:
        return Decision(ROOM)
    free = [(tenant_of(n), v) for n, v in loaded if evictable(v)]
    for outcome, owner in ((FULL_UNOWNED, ""), (FULL_OWN, tenant)):
        victim = lru(v for t, v in free if t == owner)
        if victim is not None:
            return Decision(outcome, victim)
    victim = lru(v for _, v in free)
    return Decision(FULL_OTHER, victim) if victim is not None else Decision(FULL_HELD)


def quota_refusal(name: str, decision: Decision, slots: TenantSlotsSection) -> ResourceExhausted:
    """The refusal of a load of `name` whose tenant is at its slots with every version in use."""
    tenant = decision.tenant
    return ResourceExhausted(
        f"tenant {tenant!r} already has {decision.count} adapter versions loaded on this replica, its "
        f"{slots.setting(tenant)} = {slots.quota(tenant)}, and every one serves in-flight requests (or is staged), so "
        f"{name.partition(TENANT_SEPARATOR)[2]!r} cannot be loaded; retry when they finish, name fewer versions at "
        f"once, or raise the replicas' {slots.setting(tenant)}",
        reason=Reason.TENANT_SLOTS_FULL,
        retry_after_s=1.0,
    )
