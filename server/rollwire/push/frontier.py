"""The in-order checks of a payload whose chunks land out of order (a striped push's assembly).

A striped push's chunks come on several streams at once, each written straight to its place in
the one buffer of the payload; the digest and the tensor checks need the bytes in order. The
`Frontier` hashes and inspects the contiguous prefix of landed chunks as it grows, on whichever
thread's chunk extended it, so the checks keep pace with the stripes instead of waiting for the
last byte (a pass over the whole buffer at the end would add its whole hash time to the hop).

Invariants:
- chunk j of the payload lives at [j x chunk_bytes, ...) of its buffer; whoever wrote it there
  (a stripe's bulk reading thread by `recv_into`, or the assembly's worker by a copy of a gRPC
  chunk) calls `landed(j)` once it is whole, once;
- the digests and the inspector see every byte once, strictly in payload order, in spans of at
  most SPAN bytes (views of the buffer: nothing is copied);
- one thread hashes at a time (`hashing`); the lock guards only the bookkeeping (which chunks
  landed, the frontier, who hashes), never a read or a hash, so a thread whose chunk lands
  while another hashes goes straight back to its socket, and the hasher takes its chunk on;
- once every chunk landed and every `landed` call returned, the frontier is the payload's end
  (`whole`): a hasher stops only when the next chunk had not landed when it looked, under the
  lock, and a chunk that lands after that look finds no hasher and hashes itself;
- the first failed check (`error`) is raised to every later `landed`, so bytes that fail a
  check fail every stripe's stream that still delivers; `stop` ends the hashing for good (the
  assembly was given up).
"""

from __future__ import annotations

import threading

from rollwire.common.errors import RollwireError
from rollwire.push.buffers import Payload
from rollwire.push.digests import Digests
from rollwire.push.sink import Inspector

SPAN = 4 << 20
"""Most bytes hashed and inspected in one call: the inspector copies up to one span while the
header is incomplete, and a stripe's chunk that lands behind a long run waits at most this long."""


class Frontier:
    """Digests and inspector of one payload of `size` bytes cut in `chunk_bytes` chunks, fed in
    payload order as chunks land in any order (see the module's invariants)."""

    def __init__(self, size: int, chunk_bytes: int, digests: Digests, inspector: Inspector | None) -> None:
        self.size, self.chunk_bytes = size, chunk_bytes
        self.count = max(1, -(-size // chunk_bytes))
        self.digests, self.inspector = digests, inspector
        self.landed_at = bytearray(self.count)
        """1 for every chunk that is whole in the buffer."""
        self.next = 0
        """The first chunk not hashed yet: every byte before it was hashed and inspected."""
        self.hashing = False
        self.stopped = False
        self.error: RollwireError | None = None
        self._lock = threading.Lock()

    @property
    def whole(self) -> bool:
        """Every byte of the payload was hashed and inspected."""
        return self.next == self.count

    def landed(self, j: int, buffer: Payload) -> None:
        """Chunk j is whole in `buffer` (the payload's): hash and inspect up to the new frontier
        when no other thread is at it. Raises the first failed check of the bytes, if any."""
        with self._lock:
            self.landed_at[j] = 1
            start, end = self.next, self._reach()
            if self.hashing or self.stopped or self.error is not None or end == start:
                self._raise()
                return
            self.hashing = True
        view = memoryview(buffer)
        try:
            while True:
                self._check(view[start * self.chunk_bytes : min(end * self.chunk_bytes, self.size)])
                with self._lock:
                    self.next = start = end
                    end = self._reach()
                    if end == start or self.stopped or self.error is not None:
                        self.hashing = False
                        break
        except BaseException:
            with self._lock:
                self.hashing = False
            raise
        self._raise()

    def _reach(self) -> int:
        """Under the lock: the end of the run of landed chunks from `next`, at most SPAN bytes on."""
        end, most = self.next, self.next + max(1, SPAN // self.chunk_bytes)
        while end < min(self.count, most) and self.landed_at[end]:
            end += 1
        return end

    def _check(self, span: memoryview) -> None:
        """Hash and inspect the next span (on the hashing thread only: see `hashing`)."""
        self.digests.update(span)
        if self.inspector is not None:
            self.inspector.feed(span)
            if self.inspector.error is not None:
                self.error = self.inspector.error

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """No more hashing: the payload will not be used (its assembly failed or was given up)."""
        with self._lock:
            self.stopped = True
