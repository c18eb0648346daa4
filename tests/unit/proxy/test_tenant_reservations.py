"""Work in progress is its tenant's (audit 2026-12-07 S1, S4): the spool quota's arithmetic with
uploads in flight, a tenant's share of the spool's reservations, the room an HTTP upload may
be given before it is held, the upload's total deadline, and the door's upload budget. Pure
rules, no process; tests/integration/proxy/test_tenant_resources.py runs them on a real proxy."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import grpc
import pytest

from rollwire.common.errors import ResourceExhausted
from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.edge.uploads import UploadBudget
from rollwire.proxy.routing.shares import TENANT_UPLOAD_SHARE, Shares, upload_room
from rollwire.proxy.tenants import QuotaSection, TenantSection
from rollwire.serving.config import PushLimits

if TYPE_CHECKING:
    from rollwire.proxy.spool import Spool

KEEP = 4


def shares(**quotas) -> Shares:
    return Shares([TenantSection(name="a", quotas=QuotaSection(**quotas)), TenantSection(name="b")])


def refusal(call) -> str:
    with pytest.raises(ResourceExhausted) as info:
        call()
    assert info.value.reason == "TENANT_QUOTA"
    return info.value.message


def test_an_upload_in_flight_counts_against_the_tenants_bytes_as_a_version_it_holds():
    s = shares(max_spool_bytes=100)
    s.check_spool([], "a:x", 1, 60, KEEP)  # alone: within its quota
    message = refusal(lambda: s.check_spool([], "a:y", 1, 60, KEEP, in_flight=[("a:x", 1, 60)]))
    assert "120 bytes" in message and "max_spool_bytes is 100" in message
    s.check_spool([("a:x", 1, 30)], "a:y", 1, 40, KEEP, in_flight=[("a:z", 1, 30)])  # 30 + 30 + 40: exactly 100


def test_uploads_in_flight_count_as_versions_and_the_same_version_twice_counts_twice():
    s = shares(max_spool_versions=2)
    s.check_spool([], "a:x", 2, 1, KEEP, in_flight=[("a:x", 1, 1)])
    refusal(lambda: s.check_spool([], "a:x", 3, 1, KEEP, in_flight=[("a:x", 1, 1), ("a:y", 1, 1)]))
    # a version only in flight is no version held: opening it again cannot pass for an idempotent re-push
    refusal(lambda: s.check_spool([], "a:x", 1, 1, KEEP, in_flight=[("a:x", 1, 1), ("a:x", 1, 1)]))
    # a version spooled already is: a re-push of it takes nothing new
    s.check_spool([("a:x", 1, 1), ("a:y", 1, 1)], "a:x", 1, 1, KEEP, in_flight=[("a:z", 1, 1)])


def test_a_name_at_keep_versions_drops_its_oldest_spooled_one_not_one_in_flight():
    s = shares(max_spool_bytes=100)
    held = [("a:x", v, 25) for v in range(1, KEEP + 1)]  # 100 bytes, the name at KEEP versions
    s.check_spool(held, "a:x", KEEP + 1, 25, KEEP)  # its v1 (25) goes: 100 again
    refusal(lambda: s.check_spool(held, "a:x", KEEP + 1, 25, KEEP, in_flight=[("a:x", KEEP + 2, 25)]))


def test_a_tenant_without_quotas_reserves_at_most_its_share_of_the_spool():
    s = shares()
    room = 100
    s.check_spool([], "b:x", 1, 100, KEEP, room=room)
    message = refusal(lambda: s.check_spool([], "b:y", 1, 60, KEEP, in_flight=[("b:x", 1, 50)], room=room))
    assert "1 uploads of 50 bytes in flight" in message and "100 bytes one tenant may reserve" in message
    s.check_spool([], "c-unknown:y", 1, 10**9, KEEP, in_flight=[("b:x", 1, 50)], room=room)  # no such tenant here
    s.check_spool([], "fleet-name", 1, 10**9, KEEP, room=room)  # the fleet's own names: the spool's room alone


class FakeSpool:
    def __init__(self, max_bytes: int, in_flight: list[tuple[str, int, int]]) -> None:
        self.max_bytes, self._in_flight = max_bytes, in_flight
        self.reserved = sum(b for _, _, b in in_flight)

    def in_flight(self, prefix: str = "") -> list[tuple[str, int, int]]:
        return [h for h in self._in_flight if h[0].startswith(prefix)]


def room(s: Shares, spool: FakeSpool, tenant: str) -> int:
    return upload_room(s, cast("Spool", spool), tenant)  # what upload_room reads of a spool, no folder


def test_the_room_an_upload_may_be_given_is_the_least_of_the_spools_the_share_and_the_quota():
    spool = FakeSpool(1000, [("a:x", 1, 100), ("b:y", 1, 300)])
    assert room(shares(), spool, "") == 600  # the fleet's: the spool less every reservation
    assert room(shares(), spool, "b") == int(1000 * TENANT_UPLOAD_SHARE) - 300
    assert room(shares(max_spool_bytes=250), spool, "a") == 150
    assert room(shares(max_spool_bytes=50), spool, "a") == 0  # never negative
    assert room(shares(), FakeSpool(1000, [("b:y", 1, 990)]), "a") == 10  # the spool's own room binds
    # the tenant's uploads the door holds and has not handed to the spool yet count as its own
    assert upload_room(shares(max_spool_bytes=250), cast("Spool", spool), "a", arriving=100) == 50
    assert upload_room(shares(), cast("Spool", spool), "", arriving=100) == 500


def test_an_uploads_total_deadline_grows_with_its_size_at_the_minimum_rate():
    limits = PushLimits()  # the proxy's spool and every replica's limits alike
    assert limits.upload_deadline_s(0) == 60.0
    assert limits.upload_deadline_s(1 << 30) == 60.0 + 1024
    # a trickle of 1 byte per 20 s (audit S1) of a 64 MiB manifest is cut at 124 s, not held forever
    assert limits.upload_deadline_s(64 << 20) == pytest.approx(124.0)
    assert PushLimits(upload_timeout_s=2, min_upload_bytes_per_s=100).upload_deadline_s(300) == 5.0
    for bad in ({"upload_timeout_s": 0}, {"min_upload_bytes_per_s": 0}, {"upload_timeout_s": 86401}):
        with pytest.raises(ValueError):
            PushLimits(**bad)


def test_the_doors_upload_budget_bounds_all_uploads_and_each_tenants_half():
    budget = UploadBudget(100)
    a1, a2, b = budget.hold("a"), budget.hold("a"), budget.hold("b")
    a1.reach(40)
    a1.reach(30)  # reaching less than held takes nothing
    with pytest.raises(HttpError) as info:
        a2.grow(11)  # a's 40 + 11 > its half (50)
    assert (info.value.code, info.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "UPLOADS_FULL")
    assert "of your tenant" in info.value.message and a2.size == 0
    b.grow(50)
    with pytest.raises(HttpError) as info:
        budget.hold("c").grow(11)  # 90 held in all: 11 more would pass 100
    assert "of your tenant" not in info.value.message
    with a1:
        pass  # released on leaving, however the request ended
    a1.release()  # idempotent
    assert (budget.held, dict(budget.by_tenant)) == (50, {"b": 50})
    a2.grow(50)
    b.release()
    a2.release()
    assert (budget.held, dict(budget.by_tenant)) == (0, {})
