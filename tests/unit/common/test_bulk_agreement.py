"""The bulk path's agreement (rollwire.common.bulk, issue 36): what an offer may carry and what
its token binds. The connections themselves are tested with real servers in
tests/integration/push (test_push_relay, test_push_safety)."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from rollwire.common.bulk import BULK_KEY, Offer, parse_offer, token
from rollwire.v1 import generator_pb2 as pb

SECRET = bytes(range(32))


def manifest(**changes) -> pb.AdapterManifest:
    fields = {"name": "policy", "version": 3, "sha256": "ab" * 32, **changes}
    return pb.AdapterManifest(**fields)


def test_an_offer_travels_as_one_metadata_entry_and_parses_back():
    offer = Offer(40123, SECRET)
    ((key, value),) = offer.metadata()
    assert key == BULK_KEY and value == f"40123 {SECRET.hex()}"
    assert parse_offer([("other", "x"), (key, value)]) == offer


@pytest.mark.parametrize(
    "value",
    ["", "40123", f"0 {SECRET.hex()}", f"65536 {SECRET.hex()}", f"x {SECRET.hex()}", "40123 zz", "40123 " + "ab" * 8],
)
def test_an_offer_that_does_not_parse_is_no_offer(value):
    assert parse_offer([(BULK_KEY, value)]) is None  # the sender sends chunks then
    assert parse_offer(None) is None and parse_offer([]) is None


def test_a_token_binds_the_secret_name_version_digest_and_stripe():
    stripe = pb.Stripe(index=1, count=2, chunk_bytes=65536)
    base = token(SECRET, manifest(), None)
    expected = hmac.new(SECRET, b"rollwire-bulk\0policy\x003\0" + b"ab" * 32 + b"\0-", hashlib.sha256).digest()
    assert base == expected and len(base) == 32
    others = [
        token(bytes(32), manifest(), None),
        token(SECRET, manifest(name="policy2"), None),
        token(SECRET, manifest(version=4), None),
        token(SECRET, manifest(sha256="cd" * 32), None),
        token(SECRET, manifest(), stripe),
        token(SECRET, manifest(), pb.Stripe(index=0, count=2, chunk_bytes=65536)),
    ]
    assert len({base, *others}) == len(others) + 1  # each changes the token: it opens only its own push
