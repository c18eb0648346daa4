"""The bulk listener's book of offers (rollwire.push.offers): a hello's token opens its push
once and only before the offer expires. The connections themselves: tests/integration/push."""

from __future__ import annotations

import asyncio

from rollwire.common import bulk as wire
from rollwire.push.offers import Offers

PROOF = bytes(range(32))


class Clock:
    """A monotonic clock the test moves by hand, so expiry is reached without waiting for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_token_opens_its_push_once_and_only_before_its_offer_expires():
    clock = Clock()
    offers = Offers(ttl_s=3.0, clock=clock)
    loop = asyncio.get_running_loop()
    live = offers.issue(PROOF, loop)
    assert live.expires == 1003.0
    clock.now = 1003.0  # the last moment the offer is open
    assert offers.claim(wire.MAGIC + PROOF) is live
    assert offers.claim(wire.MAGIC + PROOF) is None  # once

    late = offers.issue(PROOF, loop)
    clock.now = late.expires + 0.001  # expired, not yet pruned: the token must still be refused
    assert offers.claim(wire.MAGIC + PROOF) is None
    clock.now += 1.0
    offers.issue(PROOF, loop)
    assert offers.claim(b"XXXX" + PROOF) is None  # the right token behind the wrong magic opens nothing
    assert offers.claim(wire.MAGIC + PROOF) is None  # ... and used its one chance


async def test_a_withdrawn_offer_or_another_token_claims_nothing():
    offers = Offers(ttl_s=3.0, clock=Clock())
    loop = asyncio.get_running_loop()
    withdrawn = offers.issue(PROOF, loop)
    other = offers.issue(bytes(32), loop)
    offers.withdraw(withdrawn)
    assert offers.claim(wire.MAGIC + PROOF) is None
    assert offers.claim(wire.MAGIC + bytes(31) + b"\x01") is None
    assert offers.claim(wire.MAGIC + bytes(32)) is other


async def test_issuing_drops_the_offers_that_expired_or_were_settled():
    clock = Clock()
    offers = Offers(ttl_s=3.0, clock=clock)
    loop = asyncio.get_running_loop()
    settled = offers.issue(b"a" * 32, loop)
    settled.conn.cancel()
    offers.issue(b"b" * 32, loop)
    clock.now += 3.5
    offers.issue(b"c" * 32, loop)
    assert set(offers._expected) == {b"c" * 32}  # the book does not grow with offers nobody took
