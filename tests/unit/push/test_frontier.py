"""The in-order checks of a payload whose chunks land out of order (rollwire.push.frontier), and a
striped assembly whose stripes come by both paths into one buffer (rollwire.push.assembly).

Threads stand in for the stripes' bulk reading threads: each writes its chunks into their
places in the payload's buffer and lands them, in its own order, while the others do; the
digests are checked against hashlib's and blake3's of the whole payload, computed here.
The integration tests over real replicas are tests/integration/push/test_push_relay.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading

import pytest
from blake3 import blake3

from rollwire.common.errors import InvalidArgument, RollwireError
from rollwire.common.reasons import Reason
from rollwire.common.writer import stripe_layout
from rollwire.push.assembly import Assembly
from rollwire.push.buffers import payload_buffer
from rollwire.push.digests import Digests
from rollwire.push.frontier import SPAN, Frontier
from rollwire.v1 import generator_pb2 as pb

KiB = 1024


def manifest_for(payload: bytes) -> pb.AdapterManifest:
    return pb.AdapterManifest(
        name="a",
        version=1,
        byte_length=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        blake3=blake3(payload).hexdigest(),
    )


class Recorder:
    """An inspector that keeps what it was fed, in order; refuses once `refuse_at` bytes passed.
    `slow`: it takes a millisecond a span, so other threads land chunks while one hashes."""

    def __init__(self, refuse_at: int = -1, slow: bool = False) -> None:
        self.slow = slow
        self.seen = bytearray()
        self.spans: list[int] = []
        self.refuse_at = refuse_at
        self.error: RollwireError | None = None

    def feed(self, chunk) -> None:
        if self.slow:
            threading.Event().wait(0.001)
        self.seen += chunk
        self.spans.append(len(chunk))
        if 0 <= self.refuse_at < len(self.seen) and self.error is None:
            self.error = InvalidArgument("refused here", reason=Reason.NON_FINITE_WEIGHTS)

    def finish(self, payload) -> None:
        if self.error is not None:
            raise self.error


def land_in_threads(payload: bytes, chunk: int, count: int, landed, seed: int) -> list[BaseException]:
    """`count` threads, one per stripe, each writing its chunks into one buffer and landing them,
    with random pauses so they interleave differently on every seed; what each raised."""
    buffer = payload_buffer(len(payload))
    errors: list[BaseException] = []

    def stripe_thread(s: int) -> None:
        rng = random.Random(seed * 31 + s)
        try:
            for j, size in stripe_layout(len(payload), pb.Stripe(index=s, count=count, chunk_bytes=chunk)):
                if rng.random() < 0.3:
                    threading.Event().wait(rng.random() / 1000)
                memoryview(buffer)[j * chunk : j * chunk + size] = payload[j * chunk : j * chunk + size]
                landed(j, buffer)
        except RollwireError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stripe_thread, args=(s,)) for s in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


@pytest.mark.parametrize("seed", range(10))
def test_chunks_landing_on_many_threads_are_hashed_and_inspected_once_in_payload_order(seed):
    rng = random.Random(seed)
    chunk = rng.choice([64 * KiB, 128 * KiB])
    payload = rng.randbytes(rng.randrange(SPAN // 2, 3 * SPAN))
    count = rng.randrange(2, 5)
    m = manifest_for(payload)
    inspector = Recorder(slow=True)
    frontier = Frontier(len(payload), chunk, Digests(m, both=True), inspector)
    assert land_in_threads(payload, chunk, count, frontier.landed, seed) == []
    assert frontier.whole and not frontier.hashing
    assert bytes(inspector.seen) == payload  # every byte once, in order
    assert max(inspector.spans) <= SPAN
    frontier.digests.check()  # both digests of the whole payload match


def test_a_chunk_that_lands_while_another_thread_hashes_is_taken_on_by_that_thread():
    """Chunk 0's thread is held inside its hash; chunk 1 (the last) lands meanwhile and its thread
    returns at once, back to its socket. Chunk 0's thread hashes chunk 1 before it returns."""
    payload = random.Random(6).randbytes(2 * 64 * KiB)
    hashing, go = threading.Event(), threading.Event()

    class Held(Recorder):
        def feed(self, chunk) -> None:
            hashing.set()
            go.wait(10)
            super().feed(chunk)

    inspector = Held()
    frontier = Frontier(len(payload), 64 * KiB, Digests(manifest_for(payload)), inspector)
    first = threading.Thread(target=frontier.landed, args=(0, payload))
    first.start()
    assert hashing.wait(10)
    frontier.landed(1, payload)  # returns although chunk 0's hash is not done
    assert frontier.next == 0 and inspector.seen == b""
    go.set()
    first.join(10)
    assert frontier.whole and bytes(inspector.seen) == payload
    frontier.digests.check()


def test_a_check_that_fails_is_raised_to_every_stripe_that_lands_later():
    """Chunks 0-5 land first (the refusal is in chunk 5: the thread that lands it hashes it and
    gets the error); then each of three stripes' threads lands one more chunk, and each is told."""
    payload = random.Random(3).randbytes(40 * 64 * KiB)
    buffer = payload_buffer(len(payload))
    memoryview(buffer)[:] = payload
    frontier = Frontier(len(payload), 64 * KiB, Digests(manifest_for(payload)), Recorder(refuse_at=5 * 64 * KiB))
    for j in range(5):
        frontier.landed(j, buffer)
    with pytest.raises(RollwireError):
        frontier.landed(5, buffer)
    errors: list[BaseException] = []

    def stripe_lands(j: int) -> None:
        try:
            frontier.landed(j, buffer)
        except RollwireError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stripe_lands, args=(j,)) for j in (6, 7, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 3 and all(getattr(e, "reason", "") == "NON_FINITE_WEIGHTS" for e in errors)
    assert frontier.next == 6 and not frontier.whole  # no byte past the refused chunk was hashed


def test_a_stopped_frontier_hashes_no_more():
    payload = random.Random(4).randbytes(8 * 64 * KiB)
    inspector = Recorder()
    frontier = Frontier(len(payload), 64 * KiB, Digests(manifest_for(payload)), inspector)
    frontier.stop()
    assert land_in_threads(payload, 64 * KiB, 2, frontier.landed, 2) == []
    assert not inspector.seen and frontier.next == 0


@pytest.mark.parametrize("altered", [False, True])
async def test_a_version_whose_stripes_come_by_bulk_and_by_chunks_assembles_in_one_buffer(altered):
    """Stripe 0 lands from a thread straight into the assembly's buffer (the bulk path), stripe 1
    is added chunk by chunk from the event loop (gRPC chunks), at the same time."""
    rng = random.Random(5)
    payload = rng.randbytes(23 * 64 * KiB + 100)
    sent = bytearray(payload)
    if altered:
        sent[3 * 64 * KiB + 7] ^= 1  # chunk 3: stripe 1's, over gRPC chunks
    assembly = Assembly(manifest_for(payload), pb.Stripe(index=0, count=2, chunk_bytes=64 * KiB), Recorder())
    try:
        buffer = await assembly.ready()

        def bulk_stripe() -> None:
            for j, size in stripe_layout(len(payload), pb.Stripe(index=0, count=2, chunk_bytes=64 * KiB)):
                memoryview(buffer)[j * 64 * KiB : j * 64 * KiB + size] = sent[j * 64 * KiB : j * 64 * KiB + size]
                assembly.landed(j, buffer)

        async def chunk_stripe() -> None:
            for j, size in stripe_layout(len(payload), pb.Stripe(index=1, count=2, chunk_bytes=64 * KiB)):
                await assembly.add(j, bytes(sent[j * 64 * KiB : j * 64 * KiB + size]))
            await assembly.settle()

        await asyncio.gather(asyncio.to_thread(bulk_stripe), chunk_stripe())
        assert assembly.end(1) is False and assembly.end(0) is True
        if altered:
            with pytest.raises(InvalidArgument) as info:
                await assembly.finish()
            assert info.value.reason == "DIGEST_MISMATCH"
        else:
            assert bytes(await assembly.finish()) == payload
    finally:
        assembly.fail(None)
