"""Per-tenant LoRA slots on a replica (issue 35, item 3: "eviction of a tenant's adapters follows
its quota, not another tenant's traffic"): the registry over an engine that records every load
and unload and refuses a load beyond its slots, as a served engine does.

The checks read only what the engine was asked and what the test holds (its own leases), never
the policy's bookkeeping: which handles are loaded, whose they are, which are free to go."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwire.common.errors import ResourceExhausted
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest
from rollwire.common.reasons import Reason
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.eviction import TenantSlotsSection, tenant_of
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.proxy.routing import faults

PAYLOAD = b"\0" * 64


class SlotEngine:
    """Loaded handles and their adapter names; a load beyond `slots` is refused (0 = no limit)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.names: dict[str, str] = {}  # handle -> adapter name, while loaded
        self.peak = 0

    async def load(self, handle: str, m: Manifest, payload: bytes) -> None:
        if self.slots and len(self.names) >= self.slots:
            raise ResourceExhausted("engine full", reason=Reason.ADAPTER_SLOTS_FULL)
        self.names[handle] = m.name
        self.peak = max(self.peak, len(self.names))

    async def unload(self, handle: str) -> None:
        del self.names[handle]

    def count(self, tenant: str) -> int:
        return sum(tenant_of(n) == tenant for n in self.names.values())


def manifest(name: str, version: int) -> Manifest:
    return Manifest(
        name, version, "fp", LoraShape(4, 8.0, ("q_proj",)), len(PAYLOAD), hashlib.sha256(PAYLOAD).hexdigest()
    )


def registry(engine: SlotEngine, window: int, slots: TenantSlotsSection, decisions: list[str] | None = None):
    seen = decisions if decisions is not None else []
    return AdapterRegistry(
        engine.load, engine.unload, window, keep=window + 3, max_loaded=engine.slots, tenant_slots=slots,
        on_decision=seen.append,
    )  # fmt: skip


async def test_a_tenant_beyond_its_slots_unloads_its_own_oldest_never_anothers():
    engine, decisions = SlotEngine(slots=0), []  # the transformers engine: no global limit, the quota still holds
    reg = registry(engine, 2, TenantSlotsSection(default=2), decisions)
    await reg.push(manifest("b:policy", 1), PAYLOAD)
    b1 = reg.acquire("b:policy", 1)
    reg.release(b1)  # free to go, and the least recently used of all
    for name in ("a:x", "a:y", "a:z"):
        await reg.push(manifest(name, 1), PAYLOAD)
    assert sorted(engine.names.values()) == ["a:y", "a:z", "b:policy"]  # a:x, a's oldest, went; b's stays
    assert reg.loaded() == {"b:policy": [1], "a:x": [1], "a:y": [1], "a:z": [1]}  # a:x kept as bytes
    assert decisions.count("quota_own") == 1 and "full_other" not in decisions
    for i in range(3):  # names of no tenant are not limited by it
        await reg.push(manifest(f"shared{i}", 1), PAYLOAD)
    assert engine.count("") == 3 and engine.count("a") == 2


async def test_a_tenant_whose_every_version_serves_a_request_is_refused_with_the_setting_named():
    engine, decisions = SlotEngine(slots=8), []
    reg = registry(engine, 2, TenantSlotsSection(default=1, tenants={"a": 2}), decisions)
    await reg.push(manifest("a:x", 1), PAYLOAD)
    await reg.push(manifest("a:y", 1), PAYLOAD)
    held = [await reg.take("a:x", 1), await reg.take("a:y", 1)]
    with pytest.raises(ResourceExhausted) as refused:
        await reg.push(manifest("a:z", 1), PAYLOAD)
    assert refused.value.reason == Reason.TENANT_SLOTS_FULL and refused.value.retry_after_s
    assert "tenant_slots.tenants['a'] = 2" in refused.value.message and "'z'" in refused.value.message
    assert sorted(engine.names.values()) == ["a:x", "a:y"] and decisions[-1] == "quota_refused"
    await reg.push(manifest("b:w", 1), PAYLOAD)  # another tenant (default 1) is not held back by a's
    reg.release(held[0])
    await reg.push(manifest("a:z", 1), PAYLOAD)  # a:x is free now: it goes, the push passes
    assert sorted(engine.names.values()) == ["a:y", "a:z", "b:w"]
    reg.release(held[1])


async def test_a_full_engine_takes_unowned_names_first_then_the_loaders_own_then_the_least_recently_used():
    engine, decisions = SlotEngine(slots=4), []
    reg = registry(engine, 1, TenantSlotsSection(default=3), decisions)
    for name in ("b:p", "shared", "a:p", "c:p"):
        await reg.push(manifest(name, 1), PAYLOAD)
    await reg.push(manifest("a:q", 1), PAYLOAD)  # full: the shared name goes though b:p is older
    assert "shared" not in engine.names.values() and decisions[-2:] == ["full_unowned", "room"]
    await reg.push(manifest("a:r", 1), PAYLOAD)  # full, nothing unowned: a's own oldest, not b's older one
    assert sorted(engine.names.values()) == ["a:q", "a:r", "b:p", "c:p"] and decisions[-2] == "full_own"
    held = [await reg.take("a:q", 1), await reg.take("a:r", 1)]
    await reg.push(manifest("d:p", 1), PAYLOAD)  # d has nothing: the least recently used of anyone, b's
    assert sorted(engine.names.values()) == ["a:q", "a:r", "c:p", "d:p"] and decisions[-2] == "full_other"
    for sel in held:
        reg.release(sel)


async def test_the_replica_counts_each_decision_by_outcome():
    metrics = GeneratorMetrics()
    engine = SlotEngine(slots=0)
    reg = AdapterRegistry(
        engine.load, engine.unload, 1, tenant_slots=TenantSlotsSection(default=1),
        on_decision=lambda o: metrics.adapter_slot_decisions.labels(o).inc(),
    )  # fmt: skip
    await reg.push(manifest("a:x", 1), PAYLOAD)
    await reg.push(manifest("a:y", 1), PAYLOAD)

    def value(outcome: str) -> float | None:
        return metrics.registry.get_sample_value(
            "rollwire_generator_adapter_slot_decisions_total", {"outcome": outcome}
        )

    assert (value("room"), value("quota_own"), value("quota_refused")) == (2.0, 1.0, 0.0)


TENANTS = ("a", "b", "c", "")  # "" : the fleet's names, which no tenant quota limits
OPS = st.lists(
    st.tuples(st.sampled_from(("push", "take", "take", "release")), st.sampled_from(TENANTS), st.integers(0, 2)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(
    ops=OPS,
    slots=st.sampled_from((0, 2, 3, 4, 6)),
    window=st.integers(1, 3),
    default=st.integers(0, 3),
    overrides=st.dictionaries(st.sampled_from(TENANTS[:3]), st.integers(0, 4), max_size=3),
)
def test_generated_loads_never_break_the_slots_nor_take_from_a_tenant_while_the_loader_could_give(
    ops, slots, window, default, overrides
):
    """Many tenants pushing, taking (holding) and releasing: the engine never holds more than its
    slots, no held version is unloaded, no tenant holds more than its quota, a refusal comes only
    when the tenant is at its quota with every version in use, and another tenant's version goes
    for a load only when neither the unowned names nor the loader had one free."""
    asyncio.run(_run(ops, slots, window, TenantSlotsSection(default=default, tenants=overrides)))


@settings(max_examples=100, deadline=None)
@given(ops=OPS, window=st.integers(1, 3), quotas=st.tuples(*(st.integers(1, 3) for _ in range(3))))
def test_with_quotas_that_fit_the_slots_no_load_ever_unloads_another_tenants_version(ops, window, quotas):
    tenants: dict[str, int] = dict(zip(TENANTS[:3], quotas, strict=True))
    ops = [(kind, tenant or "a", i) for kind, tenant, i in ops]  # no unowned names: the quotas are all there is
    asyncio.run(_run(ops, sum(quotas), window, TenantSlotsSection(default=9, tenants=tenants), strict=True))


async def _run(ops, slots: int, window: int, quotas: TenantSlotsSection, strict: bool = False) -> None:
    engine = SlotEngine(slots)
    reg = registry(engine, window, quotas)
    versions: dict[str, int] = {}
    held: list = []
    for kind, tenant, i in ops:
        name = f"{tenant}:n{i}" if tenant else f"fleet{i}"
        if kind == "release":
            if held:
                reg.release(held.pop(i % len(held)))
            await reg.settle()
            continue
        before = dict(engine.names)
        holding = {sel.handle for sel in held}
        free = {h for h in before if h not in holding}  # kept bytes: every version stays servable here
        quota = quotas.quota(tenant) if tenant else 0
        own_free = any(tenant_of(before[h]) == tenant for h in free)
        try:
            if kind == "push":
                await reg.push(manifest(name, versions.get(name, 0) + 1), PAYLOAD)
                versions[name] = versions.get(name, 0) + 1
            elif name in reg.loaded():
                servable = reg.loaded()[name]
                held.append(await reg.take(name, servable[i % len(servable)]))
        except ResourceExhausted as exc:
            if exc.reason == Reason.TENANT_SLOTS_FULL:
                assert quota and engine.count(tenant) >= quota and not own_free
            else:  # the engine's: every loaded version is held
                assert exc.reason == Reason.ADAPTER_SLOTS_FULL and not free
        await reg.settle()
        assert not holding - set(engine.names), "a version a request holds was unloaded"
        assert not slots or engine.peak <= slots
        for t in TENANTS[:3]:
            assert not quotas.quota(t) or engine.count(t) <= quotas.quota(t)
        others = {tenant_of(before[h]) for h in set(before) - set(engine.names)} - {tenant, ""}
        if others:
            assert not strict, f"{name}'s load unloaded a version of {others} with quotas that fit"
            assert not own_free and not any(tenant_of(before[h]) == "" for h in free)
    for sel in held:
        reg.release(sel)
    await reg.settle()


def test_a_proxy_moves_a_request_refused_for_its_tenants_slots_to_another_replica():
    """Another replica may have a version of that tenant's free to give up: busy, not sick."""
    verdict = faults.classify(
        grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.TENANT_SLOTS_FULL, group_deadline_passed=False, version_pinned=False
    )
    assert verdict is faults.BUSY and verdict.retry and not verdict.counts
