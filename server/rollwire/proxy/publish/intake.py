"""The proxy's intake of a client's upload: its bytes checked, spooled and relayed as they arrive.

By either path of the bytes (push/README.md, "The bytes' path"), the gate's two rules hold
(header_gate.py): nothing is forwarded before the payload's header passed `check_header`, and
the piece that completes the payload is `held` until the proxy's digests and full check passed
(the publication then sends it: `Forwarder.send_last`), so no replica ever holds a complete
payload the proxy refused.

- gRPC chunks: each chunk through the reader's sink worker (both digests, the inspector, the
  spool file), then the `HeaderGate`, then `send` on the event loop; the chunks are kept as
  received (`bytes`, never joined).
- the bulk path (`Intake._direct`): ONE reading thread (`PushReader.read_direct`) receives each
  piece into the payload's one buffer, hashes it with both digests, inspects it, writes it to
  the spool's upload file from that buffer, and sends it straight to every child whose bulk
  lane is up (`ChildLink.feed`) before it reads the next. The event loop hears of the end, of a
  failure, once to open the relay (when the header passed), and of a piece only for a child
  that fell back to gRPC chunks. A striped publication's chunks are dealt by the same thread,
  each a view of its place in the buffer, to its stripe's lanes (`StripedForwarder.feed`). The header rule is the inspector's own header check, made once,
  when the header is complete (the same `check_header`, and the same rule for when it is
  judged, as `HeaderGate`): never a check per piece. The pieces kept for healing are views of
  the buffer (1 MiB each, no copy); a gRPC-chunk child converts each to `bytes` as its message
  is built (`ChildLink`).

Either way, once `abort`ed (the upload failed, or the client went away) no relay opens and the
one that did is cancelled: a partial upload stages nothing on any replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from rollwire.common.errors import Cancelled
from rollwire.common.reasons import Reason
from rollwire.proxy.publish.header_gate import HeaderGate
from rollwire.push.checks import PayloadInspector
from rollwire.push.forward import ChildLink, Forwarder
from rollwire.push.reader import PushReader
from rollwire.push.striped import StripedForwarder

Relay = Forwarder | StripedForwarder
Piece = bytes | memoryview


class Intake:
    """One client's upload at the proxy: `take` it (its pieces, kept for healing), then the
    publication sends `held` and ends `forward`; `abort` on every failure before that.
    `open_relay()` plans the relay and opens the proxy's streams (on the event loop)."""

    def __init__(
        self, reader: PushReader, gate: HeaderGate, inspector: PayloadInspector, open_relay: Callable[[], Relay]
    ):
        self.reader, self.gate, self.inspector, self.open_relay = reader, gate, inspector, open_relay
        self.forward: Relay | None = None
        self.held: Piece | None = None
        """The piece that completes the payload: sent only once the whole passed the proxy's checks."""
        self.aborted = False
        # the bulk path's reading thread
        self.kept: list[Piece] = []
        self.seen = 0
        self.lanes: list[ChildLink] = []
        self.chunked = False
        """Some child takes gRPC chunks (or the relay is striped): pieces go through the event loop."""
        self.loop = asyncio.get_running_loop()

    async def take(self, store: Path) -> list[Piece]:
        """Every byte of the upload, checked (digests, tensors) and written to `store` (not yet
        fsynced: the publication syncs it off the critical path); the pieces as kept."""
        if self.reader.path == "bulk":
            return await self._direct(store)
        async for chunk in self.reader.chunks(store=store, inspector=self.inspector):
            for piece in await self.gate.feed(chunk):
                self.forward = self.forward or self.open_relay()
                await self.forward.send(piece)
        payload = await self.reader.finish_chunks(sync=False)
        self.held = self.gate.held
        return payload  # pyright: ignore[reportReturnType]  # list is invariant: bytes are pieces

    async def _direct(self, store: Path) -> list[Piece]:
        self.reader.keep_chunks = False  # the payload is the buffer its pieces were received into
        await self.reader.read_direct(self.inspector, store, self._piece)
        await self.reader.finish(sync=False)  # the digests and the full check: `held` may go now
        return self.kept

    def _piece(self, piece: memoryview) -> None:
        """On the reading thread, after the piece was hashed, inspected and written: the gate's
        rules, then the piece to the children."""
        self.seen += len(piece)
        self.kept.append(piece)
        if self.forward is None:
            if not self.inspector.header_passed:
                return
            self._on_loop(self._open(), self.reader.idle_s + 1)
            ready = list(self.kept)  # everything so far: the header passed
        else:
            ready = [piece]
        if self.seen == self.reader.manifest.byte_length:  # pyright: ignore[reportOptionalMemberAccess]
            self.held = ready.pop()
        if isinstance(self.forward, StripedForwarder):  # the chunks so far, from the one buffer, but the last
            self.forward.feed(memoryview(piece.obj), self.seen)  # pyright: ignore[reportArgumentType]  # the buffer
        for p in ready:
            for link in self.lanes:
                link.feed(p)
            if self.chunked:
                assert self.forward is not None
                self._on_loop(self.forward.send(p), self.reader.idle_s)

    async def _open(self) -> None:
        """On the event loop, once the header passed: the relay, and which children the reading
        thread feeds itself (their bulk lanes are up, each decided within the idle timeout)."""
        if self.aborted:  # the upload already failed: no child stream may open now
            raise Cancelled("the upload ended before its relay opened", reason=Reason.RELAY_ABORTED)
        forward = self.forward = self.open_relay()
        lanes = await forward.direct(self.reader.idle_s)
        if isinstance(forward, Forwarder):
            self.lanes = lanes  # a striped relay's lanes are fed chunk by chunk (`StripedForwarder.feed`)
        self.chunked = len(lanes) < len(forward.links)

    def _on_loop(self, work: Coroutine[Any, Any, None], timeout: float) -> None:
        """Run `work` on the event loop and wait for it here (the reading thread), within `timeout`."""
        future = asyncio.run_coroutine_threadsafe(work, self.loop)
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def abort(self, why: str) -> None:
        """The upload failed: no relay opens now, and every child stream opened is cancelled."""
        self.aborted = True
        if self.forward is not None:
            self.forward.abort(why)
