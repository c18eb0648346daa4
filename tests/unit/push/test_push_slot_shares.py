"""What a receiver's push slot is held by (audit 2026-12-07 S3): a tenant's pushes hold at most
all but one of them (push.assembly.PushSlots by owner), and a push that trickles holds its slot
until its total deadline, no longer. Pure; a real replica behind a proxy in
tests/integration/proxy/test_tenant_resources.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from support.wire import manifest_for

from rollwire.common.errors import DeadlineExceeded, ResourceExhausted
from rollwire.common.writer import opening
from rollwire.push.assembly import PushSlots, slot_owner
from rollwire.push.reader import PushReader, total_deadline
from rollwire.v1 import generator_pb2 as pb


def slots(limit: int) -> tuple[PushSlots, list[int]]:
    counts: list[int] = []
    return PushSlots(limit, 1.0, counts.append), counts


def refused(call) -> str:
    with pytest.raises(ResourceExhausted) as info:
        call()
    assert info.value.reason == "TOO_MANY_PUSHES"
    return info.value.message


def test_the_owner_of_a_push_is_its_names_tenant_or_the_fleet():
    assert (slot_owner("team-a:policy"), slot_owner("policy"), slot_owner("")) == ("team-a", "", "")


def test_one_tenant_takes_all_but_one_slot_and_another_tenant_still_finds_one():
    s, counts = slots(3)
    s.admit("a:x")
    s.admit("a:y")
    message = refused(lambda: s.admit("a:z"))
    assert "tenant a's adapters" in message and "at most 2 of its 3 push slots" in message
    s.admit("b:x")  # the slot a could not take
    assert refused(lambda: s.admit("c:x")).startswith("this replica is receiving 3 pushes already")
    s.free("a:x")
    s.admit("a:z")  # a's share again
    assert counts[-1] == 3 and dict(s.by_owner) == {"a": 2, "b": 1}
    for name in ("a:y", "a:z", "b:x"):
        s.free(name)
    assert (s.active, dict(s.by_owner)) == (0, {})


def test_the_fleets_own_pushes_are_bounded_by_the_limit_alone():
    s, _ = slots(2)
    s.admit("x")
    s.admit("y")
    refused(lambda: s.admit("a:x"))  # full: the fleet's are no tenant's share


def test_a_receiver_of_one_slot_gives_it_to_whoever_comes_first():
    s, _ = slots(1)
    s.admit("a:x")
    refused(lambda: s.admit("b:x"))
    s.free("a:x")
    s.admit("b:x")


async def test_a_trickling_sender_is_cut_off_at_its_total_deadline_though_never_idle():
    """The same receiver, its slot's other bound: a push never idle (a byte every 20 ms, idle
    deadline 1 s) still ends at its total deadline (push.reader.total_deadline), PUSH_TOO_SLOW."""

    async def trickle():
        yield opening(manifest_for(b"x" * 1000))
        for _ in range(1000):
            await asyncio.sleep(0.02)
            yield pb.PushAdapterRequest(chunk=b"x")

    reader = PushReader(trickle(), 1.0, "replica")
    await reader.open()
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        async with total_deadline(reader, 0.3):
            async for _ in reader.chunks():
                pass
    reader.close()
    assert info.value.reason == "PUSH_TOO_SLOW" and time.monotonic() - start < 1.0
    assert 0 < reader.received < 1000 and f"sent {reader.received} of its 1000 bytes" in info.value.message
