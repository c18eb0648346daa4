"""Reading one PushAdapter stream: every receiver (proxy, replica, relaying replica) uses this.

Invariants:
- the opening is read but not judged (`Opening`): the caller checks the manifest against
  its own base model, limits and versions before it asks for the chunks;
- each message is checked as it arrives, with the same codes and reasons wherever it runs:
  chunks of at most MAX_CHUNK bytes, never more bytes in all than the manifest's
  `byte_length`, fields of the opening only on the opening;
- a stream that sends nothing for `idle_s` ends with DEADLINE_EXCEEDED (PUSH_IDLE), so a
  stalled sender cannot hold an upload slot, and one whose bytes are not all in within its
  total deadline (`total_deadline`: PushLimits.upload_deadline_s) with DEADLINE_EXCEEDED
  (PUSH_TOO_SLOW), so a trickle cannot either;
- the payload is hashed once, incrementally, by the push's `Sink` while it arrives; length
  and digest are checked when the stream ends, before anything may use the payload;
- `PushReader.chunks()` hands each chunk on as the very `bytes` object received, before the
  upload ends, so a relay forwards it at once;
- a stripe's stream (`stripe_chunks`) carries exactly the chunks `stripe_layout` gives it,
  each of exactly its size; an `Assembly` (push.assembly) hashes and checks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rollwire.common import bulk as wire
from rollwire.common.errors import DeadlineExceeded, InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.common.writer import MAX_CHUNK, stripe_layout
from rollwire.push.buffers import Payload
from rollwire.push.bulk import BulkListener, BulkSource
from rollwire.push.digests import Digests
from rollwire.push.offers import Accepted
from rollwire.push.sink import Inspector, Sink, verdict

if TYPE_CHECKING:
    from rollwire.push.assembly import Assembly
    from rollwire.push.forward import Forwarder
from rollwire.v1 import generator_pb2 as pb

DIRECT_PIECE = 4 * MAX_CHUNK
"""A bulk push's piece when every child takes bytes over its bulk lane (a chunked child takes
gRPC chunks of MAX_CHUNK): a quarter of the per-piece calls (read, hash, scan, send)."""


@dataclass(frozen=True)
class Opening:
    """The first message of a push, read but not judged: the caller checks the manifest
    against its own base model, limits and versions before it asks for the chunks."""

    manifest: pb.AdapterManifest
    relay: pb.RelayPlan
    stage_only: bool
    stripe: pb.Stripe | None = None
    granted: pb.RelayNode | None = None
    """The receiver's own node as its proxy planned it (sent inside relay trees)."""
    bulk: bool = False
    """The sender can send the bytes over this receiver's bulk endpoint (`PushReader.agree`)."""


async def idle_bounded(messages: AsyncIterable, idle_s: float, holder: str):
    """The messages of a push stream; DEADLINE_EXCEEDED when none arrives for `idle_s`, so a
    stalled sender cannot hold an upload slot (and its buffered bytes) until its deadline."""
    it = aiter(messages)
    while True:
        try:
            async with asyncio.timeout(idle_s):  # not wait_for: see rollwire.runtime.waits
                msg = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"the push sent no message for {idle_s:g} s, so this {holder} cancelled it; send the chunks without "
                "pausing and push again",
                reason=Reason.PUSH_IDLE,
            ) from None
        yield msg


def too_slow(m: pb.AdapterManifest, received: int, seconds: float, holder: str) -> DeadlineExceeded:
    """The refusal of a push whose bytes were not all in within its total deadline."""
    return DeadlineExceeded(
        f"the push of adapter {m.name!r} v{m.version} sent {received} of its {m.byte_length} bytes in {seconds:.0f} s, "
        f"its deadline (upload_timeout_s + its size at min_upload_bytes_per_s), so this {holder} cancelled it and freed "
        "what it held; push it again at a steady rate",
        reason=Reason.PUSH_TOO_SLOW,
    )


@contextlib.asynccontextmanager
async def total_deadline(reader: PushReader, seconds: float) -> AsyncIterator[None]:
    """The block (the push's bytes) within `seconds`: DEADLINE_EXCEEDED PUSH_TOO_SLOW past it."""
    budget = asyncio.timeout(seconds)
    try:
        async with budget:
            yield
    except TimeoutError:
        if not budget.expired():
            raise
        assert reader.manifest is not None  # the deadline is set once the manifest was read
        raise too_slow(reader.manifest, reader.received, seconds, reader.holder) from None


@dataclass(eq=False)
class PushReader:
    """Reads one PushAdapter stream: `open()`, then `chunks()` (or, over the bulk path, `take`
    or `read_direct`: every byte on one reading thread), then `finish()` (the payload as one
    `bytes`, or the bulk path's buffer) or `finish_chunks()` (the chunks as received, nothing
    copied: for a holder that only forwards them); `close()` on every exit. The payload is hashed, copied
    into one buffer (unless `keep_chunks`) and written to `store` (if given) by one worker
    thread, at most `backlog_bytes` behind the network."""

    messages: AsyncIterable[pb.PushAdapterRequest]
    idle_s: float
    holder: str
    keep_chunks: bool = False
    backlog_bytes: int = 8 * MAX_CHUNK
    received: int = 0
    manifest: pb.AdapterManifest | None = None
    both_digests: bool = False
    """Verify the sha256 beside a manifest's BLAKE3 (a proxy taking a client's upload: push.digests).
    A manifest that left its sha256 empty gets it computed here unless the push only stages
    (`open` sets this then: whoever serves or spools a version names its sha256)."""
    path: str = "grpc"
    """How the bytes came: "grpc" (chunks on the stream) or "bulk" (`agree`)."""
    _raw: AsyncIterator | None = field(default=None, repr=False)
    _stream: AsyncIterator | None = field(default=None, repr=False)
    _sink: Sink | None = field(default=None, repr=False)
    _bulk: BulkSource | None = field(default=None, repr=False)
    _tail: asyncio.Future | None = field(default=None, repr=False)
    """Over the bulk path: the stream's next message, which must be its end."""

    async def agree(
        self,
        opening: Opening,
        listener: BulkListener | None,
        send_metadata: Callable[[tuple], Awaitable[None]],
        into: bytearray | mmap.mmap | None = None,
    ) -> bool:
        """Once the opening was admitted: when the sender asked for the bulk path, answer it
        (`send_metadata`: the call's initial metadata, with this push's offer when `listener`),
        and take the bytes from whichever comes first: the connection that proves the offer's
        token, or a chunk on the stream (the sender fell back). Without an ask, nothing.
        `into`: the buffer the bytes land in (a stripe's: its assembly's, `take_stripe`), else
        one from the listener's pool. Returns whether the sender asked (a relaying receiver asks
        its own children then)."""
        if not opening.bulk:
            return False
        if listener is None:
            await send_metadata(())
            return True
        assert self._raw is not None, "open() first"
        m, stripe = opening.manifest, opening.stripe
        size = sum(s for _, s in stripe_layout(m.byte_length, stripe)) if stripe is not None else m.byte_length
        # the buffer first, off the loop, before the offer: a sender never waits on it mid-stream (it
        # waits for the offer, within its connect timeout, and falls back to chunks past it)
        buffer = into if into is not None else await asyncio.to_thread(listener.pool.take, size)
        offer, expected = listener.expect(m, stripe)
        await send_metadata(offer.metadata())
        came = asyncio.ensure_future(listener.connection(expected, listener.section.connect_timeout_s))
        first = asyncio.ensure_future(anext(self._raw))
        await asyncio.wait({came, first}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done() or isinstance(first.exception(), StopAsyncIteration):
            accepted = await came  # the stream ended with no chunk: the bytes may still be on their way
        else:
            came.cancel()  # a chunk came first: the sender fell back to the stream
            listener.withdraw(expected)
            accepted = None
        if accepted is not None and not await _acknowledged(accepted):
            accepted = None  # closed unacknowledged: its sender sends chunks on the stream instead
        if accepted is not None:
            self.path, self._bulk, self._tail = "bulk", BulkSource(accepted, self.idle_s, buffer), first
        else:
            self._stream = aiter(idle_bounded(_resumed(first, self._raw), self.idle_s, self.holder))
        return True

    async def _pieces(self, sizes: list[int]) -> AsyncIterator[bytes]:
        """The bulk path's pieces of `sizes`, then the stream's end (a chunk there is one too many)."""
        assert self._bulk is not None
        async for piece in self._bulk.pieces(sizes, sum(sizes)):
            yield piece  # pyright: ignore[reportReturnType]  # a view: hashed, kept and sent as bytes are
        await self._stream_end()

    async def _stream_end(self) -> None:
        """After the bulk bytes: the stream must end (within `idle_s`) with no chunk."""
        assert self._bulk is not None and self._tail is not None and self.manifest is not None
        self._bulk.close()  # every byte is in: the sender may close now
        try:
            async with asyncio.timeout(self.idle_s):
                await self._tail
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise DeadlineExceeded(
                f"the push's stream did not end within {self.idle_s:g} s of its bulk bytes; end it after them",
                reason=Reason.PUSH_IDLE,
            ) from None
        raise InvalidArgument(
            f"received more than the {self.manifest.byte_length} bytes the manifest declared: a chunk on the stream "
            "after the bulk connection's bytes",
            reason=Reason.LENGTH_MISMATCH,
        )

    async def take(self, inspector: Inspector, forward: Forwarder | None, count: Callable[[int], None]) -> None:
        """A plain push's every byte received, checked and forwarded to `forward`'s children
        (then `finish`); `count(n)` as bytes arrive. Over gRPC chunks: `chunks`, each sent on
        from the event loop. Over the bulk path: one reading thread receives each piece into the
        payload's buffer, hashes and inspects it, and sends it to every child whose bulk lane is
        up (`Forwarder.direct`), before it reads the next; the event loop hears only of the end
        (or a failure), and of a piece only for a child that fell back to gRPC chunks."""
        if self._bulk is None or self.keep_chunks:
            async for chunk in self.chunks(inspector=inspector):
                count(len(chunk))
                if forward is not None:
                    await forward.send(chunk)
            return
        lanes = await forward.direct(self._bulk.idle_s) if forward is not None else []
        chunked = forward is not None and len(lanes) < len(forward.links)
        loop = asyncio.get_running_loop()

        def then(piece: memoryview) -> None:
            count(len(piece))
            for link in lanes:
                link.feed(piece)
            if chunked:
                assert forward is not None
                asyncio.run_coroutine_threadsafe(forward.send(piece), loop).result(self.idle_s)  # pyright: ignore[reportArgumentType]

        await self.read_direct(inspector, None, then, MAX_CHUNK if chunked else DIRECT_PIECE)

    async def read_direct(
        self, inspector: Inspector, store: Path | None, then: Callable[[memoryview], None], step: int = MAX_CHUNK
    ) -> None:
        """Over the bulk path (then `finish`): one reading thread receives each piece (`step`
        bytes, the last shorter) into the payload's buffer, hashes it (`Digests`), inspects it,
        writes it to `store` when given (from the same buffer), then calls `then(piece)` (sending
        it on) before it reads the next: no hand-off per piece. A piece the inspector refused
        goes no further (`then` is not called); a failed write of `store` is DISK_FULL or
        STORE_FAILED, not a broken connection. The event loop hears only of the end, or of a
        failure."""
        assert self._bulk is not None and self.manifest is not None and not self.keep_chunks, "agree() first"
        declared = self.manifest.byte_length
        digests = Digests(self.manifest, both=self.both_digests)
        sink = self._sink = Sink(
            declared, store, self.backlog_bytes, inspector, False, self._bulk.take_buffer, digests=digests
        )

        def on_piece(piece: memoryview) -> None:
            try:
                sink.write([piece])
            except OSError as exc:  # the store's disk: not the connection's failure
                raise sink.store_error(exc) from None
            sink.raise_inspection()  # refused bytes go no further
            then(piece)

        sizes = [min(step, declared - start) for start in range(0, declared, step)]
        await self._bulk.read_all(sizes, declared, on_piece)
        self.received = declared
        await self._stream_end()

    async def open(self) -> Opening:
        self._raw = aiter(self.messages)
        self._stream = aiter(idle_bounded(self._raw, self.idle_s, self.holder))
        try:
            first = await anext(self._stream)
        except StopAsyncIteration:
            raise InvalidArgument(
                "the upload was empty: send a manifest, then the chunks", reason=Reason.NO_MANIFEST
            ) from None
        if first.WhichOneof("part") != "manifest":
            raise InvalidArgument("the first PushAdapter message must be the manifest", reason=Reason.NO_MANIFEST)
        self.manifest = first.manifest
        if not first.manifest.sha256 and not first.stage_only:
            self.both_digests = True  # this receiver names the sha256 (push.digests.Digests.named)
        return Opening(
            first.manifest,
            first.relay,
            first.stage_only,
            first.stripe if first.HasField("stripe") else None,
            first.granted if first.HasField("granted") else None,
            first.bulk,
        )

    async def chunks(self, store: Path | None = None, inspector: Inspector | None = None) -> AsyncIterator[bytes]:
        """Each chunk as received, after its checks; call once the manifest was accepted.
        `store`: a file the payload is written to as well; `inspector`: more checks of the
        payload's content, run on the worker as it arrives (a failure ends the upload)."""
        assert self._stream is not None and self.manifest is not None, "open() first"
        declared = self.manifest.byte_length
        in_place = self._bulk.take_buffer if self._bulk is not None and not self.keep_chunks else None
        digests = Digests(self.manifest, both=self.both_digests)
        self._sink = Sink(declared, store, self.backlog_bytes, inspector, self.keep_chunks, in_place, digests=digests)
        async for chunk in self._chunks(declared):
            self.received += len(chunk)
            if self.received > declared:
                raise InvalidArgument(
                    f"received more than the {declared} bytes the manifest declared", reason=Reason.LENGTH_MISMATCH
                )
            await self._sink.absorb(chunk)
            self._sink.raise_inspection()
            yield chunk

    def _chunks(self, declared: int) -> AsyncIterator[bytes]:
        if self._bulk is not None:
            return self._pieces([min(MAX_CHUNK, declared - start) for start in range(0, declared, MAX_CHUNK)])
        assert self._stream is not None
        return (_chunk_of(msg) async for msg in self._stream)

    async def stripe_chunks(self, stripe: pb.Stripe) -> AsyncIterator[tuple[int, bytes]]:
        """(j, chunk j of the payload) for each chunk of a striped stream (`check_stripe`
        first), each of exactly the size its place in the payload gives it; the stream must
        end after the stripe's last chunk. Nothing is hashed or kept here: an `Assembly`
        puts the stripes back together."""
        assert self._stream is not None and self.manifest is not None, "open() first"
        layout = stripe_layout(self.manifest.byte_length, stripe)
        expected = iter(layout)
        pieces = self._pieces([size for _, size in layout]) if self._bulk is not None else None
        async for chunk in pieces or (_chunk_of(msg) async for msg in self._stream):
            j, size = next(expected, (-1, 0))
            if len(chunk) != size:
                raise InvalidArgument(
                    f"stripe {stripe.index} of {stripe.count} carries chunk {j} of {size} bytes, got {len(chunk)}"
                    if j >= 0
                    else f"stripe {stripe.index} of {stripe.count} sent more chunks than the payload has for it",
                    reason=Reason.BAD_STRIPE,
                )
            self.received += size
            yield j, chunk
        if (j := next(expected, (-1, 0))[0]) >= 0:
            raise InvalidArgument(
                f"stripe {stripe.index} of {stripe.count} ended before chunk {j}; the upload was truncated",
                reason=Reason.LENGTH_MISMATCH,
            )

    async def take_stripe(
        self, stripe: pb.Stripe, assembly: Assembly, forward: Forwarder | None, count: Callable[[int], None]
    ) -> None:
        """A stripe's every chunk received into its place in `assembly`'s buffer, checked in
        payload order there, and forwarded to `forward`'s children (the stripe's tree); `count(n)`
        as bytes arrive. Over gRPC chunks: `stripe_chunks`, each copied in by the assembly
        (`Assembly.add`) and sent on from the event loop. Over the bulk path (`agree` given the
        assembly's buffer): one reading thread receives chunk after chunk straight into its
        place (`recv_into`: no copy), lands it (the frontier hashes and inspects what is now in
        order), and sends it to every child whose bulk lane is up (`Forwarder.direct`) before it
        reads the next; the event loop hears only of the end (or a failure), and of a chunk
        only for a child that fell back to gRPC chunks."""
        if self._bulk is None:
            async for j, chunk in self.stripe_chunks(stripe):
                count(len(chunk))
                await assembly.add(j, chunk)
                if forward is not None:
                    await forward.send(chunk)
            await assembly.settle()
            return
        assert self.manifest is not None and self._bulk.buffer is not None
        layout, buffer = stripe_layout(self.manifest.byte_length, stripe), self._bulk.buffer
        loop, idle_s = asyncio.get_running_loop(), self._bulk.idle_s
        lanes = await forward.direct(idle_s) if forward is not None else []
        chunked = forward is not None and len(lanes) < len(forward.links)

        def on_chunk(k: int, chunk: memoryview) -> None:
            assembly.landed(layout[k][0], buffer)  # refused bytes go no further
            count(len(chunk))
            for link in lanes:
                link.feed(chunk)
            if chunked:
                assert forward is not None
                asyncio.run_coroutine_threadsafe(forward.send(chunk), loop).result(idle_s)  # pyright: ignore[reportArgumentType]

        await self._bulk.read_at([(j * stripe.chunk_bytes, size) for j, size in layout], on_chunk)
        self.received = sum(size for _, size in layout)
        await self._stream_end()

    async def finish(self, sync: bool = True) -> Payload:
        """The payload once the stream ended: length, digest, then the inspector's checks;
        the store is flushed (and fsynced unless `sync` is false: then the caller syncs it
        before relying on it, e.g. off the critical path). Over the bulk path it is the buffer
        its bytes were received into (`BulkSource.buffer`), else `bytes`."""
        assert not self.keep_chunks, "finish_chunks() keeps the chunks"
        payload = await self._finish(sync)
        assert not isinstance(payload, list)
        return payload

    async def finish_chunks(self, sync: bool = True) -> list[bytes]:
        """As `finish`, but the payload is the list of chunks as received."""
        assert self.keep_chunks, "finish() buffers the payload"
        payload = await self._finish(sync)
        assert isinstance(payload, list)
        return payload

    async def _finish(self, sync: bool) -> Payload | list[bytes]:
        assert self.manifest is not None and self._sink is not None, "chunks() first"
        m = self.manifest
        if self.received != m.byte_length:
            raise InvalidArgument(
                f"upload ended after {self.received} of the {m.byte_length} bytes the manifest declared; "
                "the upload was truncated or the manifest is wrong",
                reason=Reason.LENGTH_MISMATCH,
            )
        return await verdict(m, self._sink, sync)

    def close(self) -> None:
        """Stop the worker and close the store (and a bulk connection); idempotent, safe on every exit."""
        if self._sink is not None:
            self._sink.close()
        if self._bulk is not None:
            self._bulk.close()
            self._bulk.buffer = None  # the payload's holder keeps it; unused, its pool may hand it out again
        if self._tail is not None and not self._tail.done():
            self._tail.cancel()


async def _acknowledged(accepted: Accepted) -> bool:
    """Tell the sender its connection was taken (`wire.ACK`); False (closed) when that fails."""
    try:
        await asyncio.to_thread(wire.acknowledge, accepted.sock)
        return True
    except OSError:
        accepted.sock.close()
        accepted.release()
        return False


async def _resumed(first: asyncio.Future, rest: AsyncIterator):
    """The stream again from its message `first` was reading (the race of `PushReader.agree`)."""
    try:
        yield await first
    except StopAsyncIteration:
        return
    async for msg in rest:
        yield msg


def _chunk_of(msg: pb.PushAdapterRequest) -> bytes:
    """The chunk of a message after the first, which must carry a chunk and nothing else."""
    if msg.WhichOneof("part") != "chunk":
        raise InvalidArgument("only the first PushAdapter message may be a manifest", reason=Reason.SECOND_MANIFEST)
    if msg.HasField("relay") or msg.stage_only or msg.HasField("stripe"):
        raise InvalidArgument(
            "relay, stage_only and stripe may be set on the first PushAdapter message only",
            reason=Reason.MISPLACED_FIELD,
        )
    chunk = msg.chunk
    if len(chunk) > MAX_CHUNK:
        raise InvalidArgument(
            f"a chunk of {len(chunk)} bytes exceeds the 1 MiB ({MAX_CHUNK} bytes) chunk limit; "
            "split the payload into smaller chunks",
            reason=Reason.CHUNK_TOO_LARGE,
        )
    return chunk
