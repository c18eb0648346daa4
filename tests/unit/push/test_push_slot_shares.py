"""A tenant's pushes hold at most all but one of a receiver's push slots (audit 2026-12-07 S3):
push.assembly.PushSlots by owner. Pure; a real replica behind a proxy in
tests/integration/proxy/test_tenant_resources.py."""

from __future__ import annotations

import pytest

from rollwire.common.errors import ResourceExhausted
from rollwire.push.assembly import PushSlots, slot_owner


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
