"""A striped publication's chunks dealt from the proxy's reading thread (`StripedForwarder.feed`).

The reading thread hands over the upload's one buffer and how much of it has arrived; the
forwarder deals each whole chunk of the stripes' cut (chunk j to stripe j mod S), a view of its
place, to that stripe's bulk lanes, and keeps the payload's last chunk for `send_last`: the proxy's
gate, so no replica holds a complete payload before the proxy's verdict. The lanes here record what
they are fed (the dealing is what is tested, not the sockets: the integration tests send it over
real ones); the stripes' forwarders are real ones with no children.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from rollwire.push.forward import Forwarder
from rollwire.push.striped import StripedForwarder
from rollwire.v1 import generator_pb2 as pb


class Lane:
    """A direct child's lane as the reading thread sees it: what it was fed, in order."""

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def feed(self, piece: memoryview) -> None:
        self.got.append(bytes(piece))


def striped(count: int, length: int, chunk: int) -> tuple[StripedForwarder, list[Lane]]:
    def childless() -> Forwarder:
        return Forwarder(
            [],
            pb.AdapterManifest(),
            stage_only=True,
            stub_for=lambda _: None,  # pyright: ignore[reportArgumentType, reportReturnType]  # never called: no child
            metadata=[],
            deadline=time.monotonic() + 60,
            queue_chunks=4,
            stall_s=3,
            settle_s=10,
        )

    forward = StripedForwarder([childless() for _ in range(count)], length, chunk)
    lanes = [Lane() for _ in range(count)]
    forward.lanes = [[lane] for lane in lanes]  # pyright: ignore[reportAttributeAccessIssue]  # as `direct` gives them
    return forward, lanes


def expected(payload: bytes, count: int, chunk: int) -> list[list[bytes]]:
    """Each stripe's chunks, computed apart from the forwarder: chunk j to stripe j mod count."""
    chunks = [payload[at : at + chunk] for at in range(0, len(payload), chunk)]
    return [chunks[s::count] for s in range(count)]


@pytest.mark.parametrize("seed", range(40))
def test_every_chunk_reaches_its_stripe_once_in_order_and_the_last_only_at_send_last(seed):
    rng = random.Random(seed)
    count, chunk = rng.randint(2, 4), rng.randint(1, 9)
    payload = rng.randbytes(rng.randint(count * chunk + 1, 40 * chunk))  # at least one chunk a stripe
    forward, lanes = striped(count, len(payload), chunk)
    view, seen = memoryview(payload), 0
    while seen < len(payload):  # the reader's pieces, of sizes that do not line up with the chunks
        seen = min(len(payload), seen + rng.randint(1, 3 * chunk))
        forward.feed(view, seen)
        dealt = sum(len(c) for lane in lanes for c in lane.got)
        assert dealt <= seen  # never a byte that has not arrived
    want = expected(payload, count, chunk)
    last = (-(-len(payload) // chunk) - 1) % count  # the stripe of the payload's last chunk
    assert [lane.got for lane in lanes] == [w[:-1] if s == last else w for s, w in enumerate(want)]
    assert sum(len(c) for lane in lanes for c in lane.got) < len(payload)  # held: no child has it whole
    asyncio.run(forward.send_last(view[seen - 1 :]))
    assert [lane.got for lane in lanes] == want


def test_a_payload_of_one_chunk_a_stripe_holds_its_last_until_send_last():
    payload = bytes(range(10))
    forward, lanes = striped(2, len(payload), 5)
    forward.feed(memoryview(payload), 10)
    assert [lane.got for lane in lanes] == [[payload[:5]], []]
    asyncio.run(forward.send_last(memoryview(payload)[8:]))
    assert [lane.got for lane in lanes] == [[payload[:5]], [payload[5:]]]
