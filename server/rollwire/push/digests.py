"""The digests a receiver computes of a pushed payload as it arrives, and their verdict.

Invariants (docs/protocol.md, "Digests"):
- sha256 is a version's identity everywhere it is shown (commits, spool, replies), once named (below);
- a manifest may carry the payload's BLAKE3 beside it (`AdapterManifest.blake3`), set by the
  origin that computes the sha256 (SDK, learner, a proxy's HTTP upload) from the same bytes;
- a hop verifies the BLAKE3 when it is set (about twice sha256's speed), else the sha256; the
  proxy that takes a client's upload verifies both (`both`), so from there on the two name the
  same bytes, and relay grants and signatures cover the BLAKE3 with the sha256, so no hop
  can swap it together with the bytes;
- a digest that does not match refuses the payload with DIGEST_MISMATCH, before anything may
  use it, whichever digest it is;
- a manifest that left its sha256 empty (an unsigned one with a BLAKE3) has it named by the
  receiver that computes it (`both`: a proxy, or a replica that serves what it was pushed):
  `named` is the sha256 of the bytes the BLAKE3 verified, which `verdict` writes into the
  manifest; a receiver that only stages such a version never computes it (the commit names it).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

from blake3 import blake3

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb


class Digests:
    """The digests of one payload this receiver verifies: `update` with every byte in order
    (on one thread), then `wait` (off the event loop) and `check`; `close` on every exit.

    When it verifies both (a proxy taking a client's upload), the sha256 runs on a worker thread
    of its own beside the caller's BLAKE3, fed the same pieces in order: both hash functions
    release the GIL, so the reading thread's per-byte work is the BLAKE3's alone (0.37 against
    1.06 s per GiB here) wherever a core is free. The pieces it is fed must not change until
    `wait` returned: they are `bytes`, or views of a receive buffer that is written once."""

    def __init__(self, manifest: pb.AdapterManifest, *, both: bool = False) -> None:
        self.expected: list[tuple[str, str, object]] = []
        self.named = ""
        """After `check`: the sha256 computed for a manifest that left it empty (else empty)."""
        self._beside: ThreadPoolExecutor | None = None
        if manifest.blake3:
            self.expected.append(("BLAKE3", manifest.blake3, blake3()))
        if both or not manifest.blake3:
            self.expected.append(("sha256", manifest.sha256, hashlib.sha256()))
            if manifest.blake3:
                self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")

    def update(self, data: bytes | memoryview) -> None:
        for name, _, hasher in self.expected:
            if name == "sha256" and self._beside is not None:
                self._beside.submit(hasher.update, data)  # pyright: ignore[reportAttributeAccessIssue]  # one worker: in order
            else:
                hasher.update(data)  # pyright: ignore[reportAttributeAccessIssue]  # sha256 or blake3: both update

    def wait(self) -> None:
        """Block until the sha256 beside has taken every piece (nothing to wait for without one)."""
        if self._beside is not None:
            self._beside.shutdown(wait=True)

    def close(self) -> None:
        """The payload will not be checked: the sha256 beside drops what it has not hashed yet."""
        if self._beside is not None:
            self._beside.shutdown(wait=False, cancel_futures=True)

    def check(self) -> None:
        """INVALID_ARGUMENT (DIGEST_MISMATCH) unless every digest matches the manifest's (`wait`s first:
        call `wait` off the event loop before)."""
        self.wait()
        for name, want, hasher in self.expected:
            got = hasher.hexdigest()  # pyright: ignore[reportAttributeAccessIssue]
            if not want:  # the sha256 a manifest left to this receiver: the bytes the BLAKE3 verified
                self.named = got
            elif got != want:
                field = name.lower()
                raise InvalidArgument(
                    f"payload {field} is {got} but the manifest declared {want}; the bytes were corrupted or the "
                    "manifest is stale",
                    reason=Reason.DIGEST_MISMATCH,
                )
