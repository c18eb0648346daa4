"""A push dealt over several relay trees, one `Forwarder` per stripe (push.plan.striped_layout)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from rollwire.common.reasons import Reason
from rollwire.push.forward import ChildLink, Forwarder
from rollwire.push.results import result
from rollwire.v1 import generator_pb2 as pb


class StripedForwarder:
    """Deals a push over one Forwarder per stripe: the payload is cut into chunks of exactly
    `chunk_bytes` (received pieces of that size pass through as they are, others are cut and
    joined) and chunk j goes down stripe j mod S's tree. Same calls as a Forwarder.

    `results()` merges the stripes' reports into one outcome per replica: its verdict (from
    the stream that completed its payload) when one came, else its own failure in any stripe,
    else, when a stripe never reached it, "not reached" naming the stripes it missed and why
    (so the caller heals it as any replica the relay missed).

    Children whose bulk lanes are up (`direct`) are fed by the holder's reading thread
    (`feed`): each whole chunk of the payload's one buffer, a view of its place in it (no copy,
    no event loop), to its stripe's lanes; `send` on the event loop then serves only the
    others (gRPC chunks), as `Forwarder.send` does."""

    def __init__(self, forwarders: Sequence[Forwarder], byte_length: int, chunk_bytes: int) -> None:
        self.stripes, self.byte_length, self.chunk_bytes = list(forwarders), byte_length, chunk_bytes
        self.seen = 0
        self.dealt = 0
        self.partial = bytearray()
        self.lanes: list[list[ChildLink]] = [[] for _ in self.stripes]
        """Per stripe, its children fed by the reading thread (`direct`)."""
        self.fed = 0
        """Chunks dealt to the lanes so far (chunk j to stripe j mod S), by `feed`."""
        self.payload: memoryview | None = None
        self.chunks = -(-byte_length // chunk_bytes)

    @property
    def links(self) -> list[ChildLink]:
        return [link for f in self.stripes for link in f.links]

    async def direct(self, timeout: float) -> list[ChildLink]:
        """Every stripe's children whose bulk lanes are up (`Forwarder.direct`, each decided
        within `timeout`): from now on the caller's reading thread deals them their chunks (`feed`)."""
        self.lanes = list(await asyncio.gather(*(f.direct(timeout) for f in self.stripes)))
        return [link for lanes in self.lanes for link in lanes]

    def feed(self, payload: memoryview, upto: int) -> None:
        """On the reading thread: every chunk of `payload` (the payload's one buffer) that lies
        whole below `upto` and was not dealt yet, a view of its place, to its stripe's lanes; never
        the payload's last chunk, which completes it: `send_last` deals that one, once the holder
        checked the whole (the proxy's gate). Chunks end on multiples of `chunk_bytes`, not on the
        reader's pieces, so a chunk may span two of them."""
        assert len(payload) == self.byte_length, "feed takes the payload's whole buffer"
        self.payload = payload
        self._feed_lanes(upto, self.chunks - 1)

    def _feed_lanes(self, upto: int, below: int) -> None:
        """Deal chunks fed..below-1 to the lanes, as far as `upto` holds them whole."""
        while self.fed < below:
            start = self.fed * self.chunk_bytes
            end = min(start + self.chunk_bytes, self.byte_length)
            if end > upto:
                return
            chunk = self.payload[start:end]  # pyright: ignore[reportOptionalSubscript]  # set by feed
            for link in self.lanes[self.fed % len(self.stripes)]:
                link.feed(chunk)
            self.fed += 1

    async def send(self, piece: bytes | memoryview) -> None:
        self.seen += len(piece)
        if not self.partial and len(piece) == self.chunk_bytes:
            await self._deal(piece)
        else:
            self.partial += piece
            while len(self.partial) >= self.chunk_bytes:
                chunk = bytes(self.partial[: self.chunk_bytes])
                del self.partial[: self.chunk_bytes]
                await self._deal(chunk)
        if self.seen >= self.byte_length and self.partial:  # the payload's last, shorter chunk
            chunk, self.partial = bytes(self.partial), bytearray()
            await self._deal(chunk)

    async def send_last(self, piece: bytes | memoryview) -> None:
        """As `Forwarder.send_last`: the chunks `feed` has not dealt (the last one, and any the
        reading thread had not reached) to the lanes, off the event loop, and `piece` to the others."""
        if self.payload is not None and any(self.lanes):
            await asyncio.to_thread(self._feed_lanes, self.byte_length, self.chunks)
        if any(not link.direct for link in self.links):
            await self.send(piece)

    async def _deal(self, chunk: bytes | memoryview) -> None:
        stripe = self.stripes[self.dealt % len(self.stripes)]
        self.dealt += 1
        await stripe.send(chunk)

    def end(self) -> None:
        for f in self.stripes:
            f.end()

    def abort(self, why: str) -> None:
        for f in self.stripes:
            f.abort(why)

    async def results(self) -> list[pb.ReplicaPushResult]:
        reports = await asyncio.gather(*(f.results() for f in self.stripes))
        by_address: dict[str, list[tuple[int, pb.ReplicaPushResult]]] = {}
        for s, report in enumerate(reports):
            for r in report:
                by_address.setdefault(r.address, []).append((s, r))
        return [merge_stripes(rows, len(self.stripes)) for rows in by_address.values()]


def merge_stripes(rows: Sequence[tuple[int, pb.ReplicaPushResult]], count: int) -> pb.ReplicaPushResult:
    """One replica's outcome from its (stripe, report) rows (see StripedForwarder)."""

    def rank(r: pb.ReplicaPushResult) -> int:
        if r.code == "OK":
            return 0 if r.stripe_pending else 3
        return 1 if r.reason in (Reason.RELAY_NOT_REACHED, Reason.RELAY_ABORTED) else 2

    best = max((r for _, r in rows), key=rank)
    if rank(best) >= 2:
        return best
    took = sorted(s for s, r in rows if r.code == "OK")
    missed = [f"stripe {s}: {r.message[:160]}" for s, r in rows if r.code != "OK"]
    missed += [f"stripe {s}: no report" for s in range(count) if s not in {s for s, _ in rows}]
    return result(
        best.address,
        best.replica,
        grpc.StatusCode.UNAVAILABLE,
        f"not reached: it took stripes {took} of {count}; " + "; ".join(missed),
        Reason.RELAY_NOT_REACHED,
    )
