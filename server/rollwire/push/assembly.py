"""Putting a striped push back together: the stripes of one version, from their separate streams.

Invariants:
- a striped push is always `stage_only` and its stripe fields are in range (`check_stripe`);
- chunks are fed to one `Sink` (sha256, buffer, inspector) strictly in payload order,
  whatever order the stripes deliver them in, so the payload is hashed and checked once, as
  for any push; chunks that arrive ahead wait (at most the payload's size, which the
  receiver admitted);
- each stripe joins once; the stream whose end completes the payload takes the verdict,
  exactly once; bytes that fail a check fail every stripe's stream.
"""

from __future__ import annotations

import asyncio

from rollwire.common.errors import FailedPrecondition, InvalidArgument, RollwireError
from rollwire.common.reasons import Reason
from rollwire.common.writer import MAX_CHUNK, MAX_STRIPES, MIN_STRIPE_CHUNK
from rollwire.push.sink import Inspector, Sink, verdict
from rollwire.v1 import generator_pb2 as pb


def check_stripe(stripe: pb.Stripe, *, stage_only: bool) -> None:
    """INVALID_ARGUMENT (BAD_STRIPE) unless the stripe's fields are in range; a striped push
    is always `stage_only` (its verdict comes from whichever stream completes the payload,
    so only a commit that follows every verdict may serve it)."""
    if not 2 <= stripe.count <= MAX_STRIPES or stripe.index >= stripe.count:
        raise InvalidArgument(
            f"stripe {stripe.index} of {stripe.count}: a push has 2 to {MAX_STRIPES} stripes, numbered from 0",
            reason=Reason.BAD_STRIPE,
        )
    if not MIN_STRIPE_CHUNK <= stripe.chunk_bytes <= MAX_CHUNK:
        raise InvalidArgument(
            f"stripe chunk_bytes is {stripe.chunk_bytes}; use {MIN_STRIPE_CHUNK} to {MAX_CHUNK}",
            reason=Reason.BAD_STRIPE,
        )
    if not stage_only:
        raise InvalidArgument("a striped push must be stage_only", reason=Reason.BAD_STRIPE)


class Assembly:
    """The stripes of one version, from their separate streams, put back in payload order.

    Invariants: chunks are fed to one sink (sha256, buffer, inspector) strictly in payload
    order, whatever order the stripes deliver them in; chunks that arrive ahead wait here
    (at most the payload's size in all, which the receiver admitted); each stripe joins
    once; the stream whose end completes the payload (every stripe `ended`) takes the
    verdict, exactly once. An assembly that never completes is dropped by its owner."""

    def __init__(self, manifest: pb.AdapterManifest, stripe: pb.Stripe, inspector: Inspector | None) -> None:
        self.manifest = manifest
        self.count, self.chunk_bytes = stripe.count, stripe.chunk_bytes
        self.sink = Sink(manifest.byte_length, None, 8 * MAX_CHUNK, inspector, keep_chunks=False)
        self.ahead: dict[int, bytes] = {}
        self.next = 0
        self.feeding = asyncio.Lock()
        self.joined: set[int] = set()
        self.ended: set[int] = set()
        self.closed = False
        self.completed = False
        self.error: RollwireError | None = None
        """Why its bytes were refused, if they were: every stripe's stream refuses with it."""
        self.open_streams = 0
        """Streams of its stripes open now (its owner's count: it bounds the assembly's life)."""
        self.orphaned_at = 0.0
        """When its last open stream ended (monotonic)."""
        self.linger: asyncio.TimerHandle | None = None
        """Its owner's timer that drops it while no stream is open."""

    def join(self, stripe: pb.Stripe) -> None:
        """FAILED_PRECONDITION (STRIPE_CONFLICT) for a stripe of another cut, or one that joined already."""
        if (stripe.count, stripe.chunk_bytes) != (self.count, self.chunk_bytes) or stripe.index in self.joined:
            raise FailedPrecondition(
                f"stripe {stripe.index} of {stripe.count} ({stripe.chunk_bytes}-byte chunks) does not fit the stripes "
                f"of this version being received ({sorted(self.joined)} of {self.count}, {self.chunk_bytes}-byte "
                "chunks); push again once it ended",
                reason=Reason.STRIPE_CONFLICT,
            )
        self.joined.add(stripe.index)

    async def add(self, j: int, chunk: bytes) -> None:
        """Chunk j: fed to the sink now if it is next in payload order, else when it is. Raises
        the first failed check of the bytes; does nothing once the assembly failed."""
        if self.closed:
            return
        self.ahead[j] = chunk
        async with self.feeding:
            while not self.closed and self.next in self.ahead:
                await self.sink.absorb(self.ahead.pop(self.next))
                self.next += 1
            try:
                self.sink.raise_inspection()
            except RollwireError as err:
                self.fail(err)
                raise

    def end(self, index: int) -> bool:
        """Stripe `index` delivered all its chunks; True for the one call that completes the
        payload (then `finish`). Raises the bytes' refusal if they were refused; False while a
        stripe is missing, or for good once a stripe's stream broke."""
        self.ended.add(index)
        if self.error is not None:
            raise self.error
        if self.closed or len(self.ended) < self.count:
            return False
        self.completed = True
        return True

    async def finish(self) -> bytes:
        """The verified payload (length, digest, tensors), after `end` returned True."""
        assert self.completed
        async with self.feeding:
            pass  # every chunk was fed: each add returned after its feed ran
        payload = await verdict(self.manifest, self.sink, sync=False)
        assert isinstance(payload, bytes)
        return payload

    def fail(self, err: RollwireError | None) -> None:
        """The version cannot complete here: `err` when its bytes failed a check, None when a
        stripe's stream broke or the assembly was given up. Frees what it held."""
        if self.error is None and err is not None and not self.completed:
            self.error = err
        self.closed = True
        self.ahead.clear()
        if not self.completed:
            self.sink.close()
