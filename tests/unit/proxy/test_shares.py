"""Tenants' shares at the dispatcher (routing/shares.py): weighted fair share under
contention, a tenant alone takes the whole fleet, idle time is no credit, and each quota
refuses before any work with TENANT_QUOTA and a sentence naming it. The dispatcher runs in
process over stand-in replicas (slots only): what is tested is its queue."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from rollwire.common.errors import ResourceExhausted
from rollwire.common.reasons import Reason
from rollwire.proxy.config import FairnessSection, RoutingSection
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.policies import Candidate, make_policy
from rollwire.proxy.routing.dispatch import Dispatcher, Need
from rollwire.proxy.routing.shares import RATE_WINDOW_S, Shares
from rollwire.proxy.tenants import QuotaSection, TenantSection


@dataclass(eq=False)
class SlotReplica:
    address: str
    in_flight: int = 0
    work: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def holds(self, name, version):
        return True

    def candidate(self):
        return Candidate(self.address, self.in_flight, self.work)


class Members:
    def __init__(self, members):
        self.members = members

    def routable(self):
        return list(self.members)

    def get(self, address):
        return next((r for r in self.members if r.address == address), None)

    def describe(self):
        return "stand-ins"


def tenant(name: str, weight: float = 1.0, **quotas) -> TenantSection:
    return TenantSection(name=name, publish_tokens_file="unused", weight=weight, quotas=QuotaSection(**quotas))


def dispatcher(tenants, slots: int = 1, clock=time.monotonic) -> Dispatcher:
    routing = RoutingSection(max_in_flight_per_replica=slots, retry_after_s=0.5, max_queue=10_000)
    return Dispatcher(
        Members([SlotReplica("r")]),
        make_policy("round-robin", routing),
        routing,
        ProxyMetrics("round-robin"),
        FairnessSection(max_in_flight_per_client=10_000, max_queued_tokens_per_client=1 << 30),
        Shares(tenants, routing.retry_after_s, clock),
    )


async def grants(d: Dispatcher, queued: dict[str, int], clients_per_tenant: int = 1, work: int = 10) -> list[str]:
    """Queue `queued[t]` groups of tenant t behind one held slot, then release it: the order
    in which the tenants are granted the slot, each holding it for one loop turn."""
    deadline = time.monotonic() + 30
    order: list[str] = []
    with d.admit("holder", "holder") as holder:
        held = await d.acquire(Need(), b"", work, frozenset(), deadline, client=holder)

    async def group(name: str, client: str):
        with d.admit(client, name) as admitted:
            lease = await d.acquire(Need(), b"", work, frozenset(), deadline, client=admitted)
            order.append(name)
            await asyncio.sleep(0)
            lease.release()

    tasks = [
        asyncio.create_task(group(name, f"{name}-{i % clients_per_tenant}"))
        for name, count in queued.items()
        for i in range(count)
    ]
    await asyncio.sleep(0)
    held.release()
    await asyncio.gather(*tasks)
    return order


def test_under_contention_tenants_get_slots_in_proportion_to_their_weights():
    d = dispatcher([tenant("a", 1), tenant("b", 2), tenant("c", 1), tenant("holder")])
    order = asyncio.run(grants(d, {"a": 60, "b": 60, "c": 60}, clients_per_tenant=5))  # a has 5 clients: no help
    window = order[:80]  # while all three still wait
    counts = {t: window.count(t) for t in "abc"}
    assert counts == pytest.approx({"a": 20, "b": 40, "c": 20}, abs=2), counts  # weights 1:2:1
    assert sorted(order) == sorted(["a"] * 60 + ["b"] * 60 + ["c"] * 60)  # everyone is served in the end


def test_a_tenant_alone_takes_every_slot_and_idle_time_is_no_credit():
    async def scenario():
        d = dispatcher([tenant("a"), tenant("b"), tenant("holder")])
        alone = await grants(d, {"a": 30})  # no one else: a takes every slot (work-conserving)
        after = await grants(d, {"a": 20, "b": 20})  # b idle until now: no burst of 30 catch-up grants
        return alone, after

    alone, after = asyncio.run(scenario())
    assert alone == ["a"] * 30
    assert max(len(run) for run in "".join(after).replace("ab", "a b").replace("ba", "b a").split()) <= 2, after
    assert after[:20].count("b") == pytest.approx(10, abs=1)


def test_a_tenant_granted_the_queues_tail_is_not_held_back_when_the_others_return():
    """Found by bench/tenant_fairness.py: A's backlog drains alone at the end of a round (B had
    nothing queued), so A's virtual time runs ahead; when B queues again first, A must not wait
    for B to catch up (it took nobody's share)."""

    async def scenario():
        d = dispatcher([tenant("a"), tenant("b"), tenant("holder")])
        await grants(d, {"a": 40, "b": 4})  # A is granted the tail alone
        return await grants(d, {"b": 20, "a": 20})  # B queues first this time

    order = asyncio.run(scenario())
    assert order[:20].count("a") == pytest.approx(10, abs=1), order[:20]


def test_quotas_refuse_before_any_work_naming_the_quota_with_a_hint():
    now = [100.0]
    d = dispatcher(
        [tenant("q", max_in_flight=2, max_queued_tokens=15, max_tokens_per_s=10.0), tenant("free")],
        clock=lambda: now[0],
    )

    async def scenario():
        deadline = time.monotonic() + 30
        with d.admit("c1", "q", 10) as c1, d.admit("c2", "q", 10):
            with pytest.raises(ResourceExhausted) as info, d.admit("c3", "q", 10):
                pass
            assert info.value.reason == Reason.TENANT_QUOTA and "max_in_flight" in info.value.message
            assert "tenant q" in info.value.message and info.value.retry_after_s == 0.5
            with d.admit("other", "free", 10):  # another tenant is not refused
                pass
            held = await d.acquire(Need(), b"", 10, frozenset(), deadline, client=c1)  # the only slot
            queued = asyncio.create_task(d.acquire(Need(), b"", 10, frozenset(), deadline, client=c1))
            await asyncio.sleep(0)
            with pytest.raises(ResourceExhausted) as info:  # 10 queued + 10 > 15
                await d.acquire(Need(), b"", 10, frozenset(), deadline, client=c1)
            assert info.value.reason == Reason.TENANT_QUOTA and "max_queued_tokens" in info.value.message
            held.release()
            (await queued).release()

    asyncio.run(scenario())
    assert d.shares.get("q").in_flight == 0 and d.shares.get("q").queued_work == 0  # everything given back

    # tokens/s: a bucket of 10 x RATE_WINDOW_S tokens, refilled at 10 per second (80 used above... start over)
    shares = Shares([tenant("r", max_tokens_per_s=10.0)], 0.5, lambda: now[0])
    share = shares.get("r")
    capacity = int(10 * RATE_WINDOW_S)
    shares.open(share, capacity)  # a full bucket's worth passes
    shares.close(share)
    with pytest.raises(ResourceExhausted) as info:
        shares.open(share, 30)
    assert "max_tokens_per_s" in info.value.message and info.value.retry_after_s == pytest.approx(3.0)
    now[0] += 3.0  # refilled by 30 tokens
    shares.open(share, 30)
    shares.close(share)
    now[0] += 1000
    shares.open(share, 10 * capacity)  # larger than the bucket: passes only when it is full
    shares.close(share)
    assert share.in_flight == 0


def test_spool_quotas_count_what_the_spool_will_hold():
    shares = Shares([tenant("t", max_spool_versions=3, max_spool_bytes=1000)], 0.5)
    held = [("t:a", 1, 100), ("t:a", 2, 100), ("t:b", 1, 300)]
    with pytest.raises(ResourceExhausted) as info:
        shares.check_spool(held, "t:c", 1, 100, keep=8)  # a 4th version
    assert info.value.reason == Reason.TENANT_QUOTA and "max_spool_versions" in info.value.message
    shares.check_spool(held, "t:a", 3, 100, keep=2)  # t:a is at keep: v3 replaces v1, still 3 versions
    shares.check_spool(held, "t:a", 2, 100, keep=8)  # a version already held: an idempotent re-push
    with pytest.raises(ResourceExhausted) as info:
        shares.check_spool(held, "t:b", 2, 801, keep=1)  # replaces 300 bytes: 500 - 300 + 801 > 1000
    assert "max_spool_bytes" in info.value.message
    shares.check_spool(held, "t:b", 2, 800, keep=1)
    shares.check_spool(held * 10, "other:x", 1, 10**9, keep=1)  # a tenant without quotas
    shares.check_spool(held * 10, "shared", 1, 10**9, keep=1)  # the fleet's: the spool's own limits only
