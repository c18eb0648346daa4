"""The digests a receiver computes of a pushed payload as it arrives, and their verdict.

Invariants (docs/protocol.md, "Digests"):
- sha256 is a version's identity everywhere it is shown (commits, spool, replies, grants);
- a manifest may carry the payload's BLAKE3 beside it (`AdapterManifest.blake3`), set by the
  origin that computes the sha256 (SDK, learner, a proxy's HTTP upload) from the same bytes;
- a hop verifies the BLAKE3 when it is set (about twice sha256's speed), else the sha256; the
  proxy that takes a client's upload verifies both (`both`), so from there on the two name the
  same bytes, and relay grants and signatures cover the BLAKE3 with the sha256, so no hop
  can swap it together with the bytes;
- a digest that does not match refuses the payload with DIGEST_MISMATCH, before anything may
  use it, whichever digest it is.
"""

from __future__ import annotations

import hashlib

from blake3 import blake3

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb


class Digests:
    """The digests of one payload this receiver verifies: `update` with every byte in order
    (on one thread), then `check`."""

    def __init__(self, manifest: pb.AdapterManifest, *, both: bool = False) -> None:
        self.expected: list[tuple[str, str, object]] = []
        if manifest.blake3:
            self.expected.append(("BLAKE3", manifest.blake3, blake3()))
        if both or not manifest.blake3:
            self.expected.append(("sha256", manifest.sha256, hashlib.sha256()))

    def update(self, data: bytes | memoryview) -> None:
        for _, _, hasher in self.expected:
            hasher.update(data)  # pyright: ignore[reportAttributeAccessIssue]  # sha256 or blake3: both update

    def check(self) -> None:
        """INVALID_ARGUMENT (DIGEST_MISMATCH) unless every digest matches the manifest's."""
        for name, want, hasher in self.expected:
            got = hasher.hexdigest()  # pyright: ignore[reportAttributeAccessIssue]
            if got != want:
                field = name.lower()
                raise InvalidArgument(
                    f"payload {field} is {got} but the manifest declared {want}; the bytes were corrupted or the "
                    "manifest is stale",
                    reason=Reason.DIGEST_MISMATCH,
                )
