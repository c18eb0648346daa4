"""The proxy's gate on a client's upload: which chunks may go on to the replicas, and when.

Invariants:
- nothing is forwarded until the payload's safetensors header passed the replicas' own
  header checks (push.checks.check_header), so a malformed payload never reaches a replica;
- the chunk that completes the payload is held back (`held`) until the proxy's digest and
  full payload check passed, so no replica ever holds a complete payload the proxy refused;
- chunks are passed on as the `bytes` objects received, never copied or joined.
"""

from __future__ import annotations

import asyncio

from rollwire.common.manifest import Manifest
from rollwire.common.safetensors_header import HeaderError, header_length
from rollwire.push.checks import MAX_HEADER_BYTES, check_header

INLINE_HEADER_BYTES = 64 << 10  # larger headers are parsed off the event loop


class HeaderGate:
    """What the proxy forwards of a client's upload, and when: nothing until the payload's
    safetensors header passed the replicas' header checks (so a malformed payload never
    reaches a replica), then each chunk as it arrives, except the one that completes the
    payload, held in `held` until the proxy's digest and full payload check passed."""

    def __init__(self, manifest: Manifest, base_shapes: dict[str, tuple[int, int]]) -> None:
        self.manifest, self.base_shapes = manifest, base_shapes
        self.prefix = bytearray()
        self.header_ok = False
        self.waiting: list[bytes] = []
        self.seen = 0
        self.held: bytes | None = None

    async def feed(self, chunk: bytes) -> list[bytes]:
        """The chunks that may be forwarded now."""
        self.seen += len(chunk)
        self.waiting.append(chunk)
        if not self.header_ok:
            self.prefix += chunk
            if not await self._header_checked():
                return []
        ready, self.waiting = self.waiting, []
        if self.seen == self.manifest.byte_length and ready:
            self.held = ready.pop()
        return ready

    async def _header_checked(self) -> bool:
        """True once the header passed; raises when it fails; False while it is incomplete."""
        if len(self.prefix) < 8:
            return self.seen >= self.manifest.byte_length and self._check(bytes(self.prefix))
        try:
            need = 8 + header_length(self.prefix)
        except HeaderError:  # pragma: no cover - 8 bytes are there
            need = 8
        if len(self.prefix) < need and need <= min(self.manifest.byte_length, 8 + MAX_HEADER_BYTES):
            return False  # the header is still arriving (what read_entries would refuse is refused then)
        data = bytes(self.prefix[: max(need, 8)])
        if len(data) > INLINE_HEADER_BYTES:
            await asyncio.to_thread(self._check, data)
        else:
            self._check(data)
        self.prefix = bytearray()
        self.header_ok = True
        return True

    def _check(self, data: bytes) -> bool:
        check_header(self.manifest, data, self.base_shapes)
        return True
