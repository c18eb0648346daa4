"""The one buffer a receiver keeps a pushed payload in, when its bytes come over the bulk path.

Invariants:
- a payload's buffer is allocated once, at its declared size, after the manifest passed its
  limits (`check_manifest`: `max_adapter_bytes`), and the bulk path's reads land in it
  (`recv_into`), so a hop copies no byte in user space;
- it is allocated off the event loop (the reading thread's first act): on Linux an anonymous
  mapping whose pages the kernel maps and zeroes in bulk instead of one page fault per 4 KiB
  page on first touch (measured here: 0.43 against 0.85-1.05 CPU s per GiB; MADV_HUGEPAGE gave
  no huge pages on this VM and did not help): in the call (MAP_POPULATE) up to EAGER_BYTES,
  above it on a thread of its own ahead of the reads (`payload_buffer`); elsewhere a bytearray;
- what holds it (the replica's registry, its engine) reads it as it would `bytes` (len, slices,
  the buffer protocol); an engine that needs `bytes` itself converts (`as_bytes`);
- a `BufferPool` hands a mapping out again for a later push of the same size only once nothing
  but the pool refers to it (no payload, view or array of it is alive: CPython's reference
  count, which every view of it holds), so a reused buffer never changes bytes anyone can
  read; it keeps at most `max_idle_bytes` of idle mappings (measured here: a reused buffer
  costs nothing to fault in, against 0.43 CPU s per GiB for a fresh populated one).
"""

from __future__ import annotations

import ctypes
import gc
import math
import mmap
import sys
import threading
import time
from collections.abc import Callable

from rollwire.runtime.logs import get_logger

log = get_logger(__name__)

Payload = bytes | bytearray | mmap.mmap
"""A verified payload as a receiver keeps it: `bytes` (gRPC chunks joined), or the bulk path's buffer."""


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)
"""Linux 5.14+: map in (and zero) a range's pages now; Python 3.11's mmap module does not name it."""
EAGER_BYTES = 64 << 20
"""Up to this size a buffer is populated in the call (milliseconds); above it, in the background."""
POPULATE_STEP = 32 << 20
FUTILE_COLLECT_S = 60.0
"""After a garbage collection that freed no buffer, `take` collects again only this much later."""


def payload_buffer(size: int) -> bytearray | mmap.mmap:
    """A writable buffer of exactly `size` bytes (call it off the event loop). Up to EAGER_BYTES
    its memory is committed in the call (MAP_POPULATE); a larger one is returned at once and
    populated from its start by a thread of its own, ahead of the reads that fill it in order:
    on this VM a fresh 1.5 GiB mapping took 0.7 to 4 s to populate, all of it before the sender
    could send a byte; now the sender starts at once and the pages are mapped while the bytes
    cross the link. A page the reads reach first is faulted in by them, as any page would be."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if size <= 0 or not populate:
        return bytearray(size)
    if size <= EAGER_BYTES or MADV_POPULATE_WRITE is None or _madvise is None:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    threading.Thread(target=_populate, args=(buffer,), name="populate", daemon=True).start()
    return buffer


def _populate(buffer: mmap.mmap) -> None:
    """Map in `buffer`'s pages from its start, POPULATE_STEP at a time (it holds a reference, so a
    pool does not hand the buffer out again meanwhile). MADV_POPULATE_WRITE leaves bytes already
    written as they are; where it is refused (an older kernel), pages fault in as they are first written.

    The calls go through ctypes, which releases the GIL for each: `mmap.madvise` holds it for the
    whole system call (measured here: 44 ms per 32 MiB step, so while a 1 GiB buffer populated the
    event loop and the reading thread ran once per step, about 30 times in 1.4 s)."""
    assert MADV_POPULATE_WRITE is not None and _madvise is not None
    pinned = ctypes.c_char.from_buffer(buffer)  # an export: the mapping cannot be closed under the calls
    try:
        base = ctypes.addressof(pinned)
        for at in range(0, len(buffer), POPULATE_STEP):
            if _madvise(base + at, min(POPULATE_STEP, len(buffer) - at), MADV_POPULATE_WRITE) != 0:
                return
    finally:
        del pinned


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(addr, length, advice), called without the GIL; None off Linux."""
    if sys.platform != "linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


def as_bytes(payload: Payload) -> bytes:
    """The payload as `bytes` (a copy unless it is already): for a reader that takes nothing else."""
    return payload if isinstance(payload, bytes) else bytes(payload)


class Filled:
    """A payload buffer of its declared size filled in order, as a BytesIO would be (`write`,
    `getvalue`) but without growing: mapped (populated) on the first write, on the writer's
    thread. For a payload whose pieces come apart (a stripe's assembly): one copy, into
    memory whose pages are mapped in one call instead of faulted in one by one."""

    def __init__(self, size: int) -> None:
        self.size, self.at = size, 0
        self.buffer: bytearray | mmap.mmap | None = None

    def write(self, data: bytes | memoryview) -> None:
        if self.buffer is None:
            self.buffer = payload_buffer(self.size)
        n = len(data)
        memoryview(self.buffer)[self.at : self.at + n] = data  # past `size`: ValueError (the reader bounds it)
        self.at += n

    def getvalue(self) -> Payload:
        return self.buffer if self.buffer is not None else b""


class BufferPool:
    """The bulk receive buffers of one server, reused for later pushes of the same size (see the
    module's invariants). `take` is called on a reading thread; at most `max_idle_bytes` of
    buffers nobody uses are kept (0: none, every push maps a fresh one)."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._held: list[mmap.mmap] = []  # every mapping it made that fits its bound, in use or idle
        self._lock = threading.Lock()
        self.reused = 0
        self._futile_at = -math.inf
        """When a collection last freed no buffer (a replica that keeps earlier versions holds theirs)."""

    def take(self, size: int) -> bytearray | mmap.mmap:
        """A buffer of exactly `size` bytes: an idle one of that size, else a fresh one. When
        every held buffer of that size is still referred to, one garbage collection runs first
        (then not again for FUTILE_COLLECT_S if it freed none: a collection holds the GIL):
        a finished push's objects often refer to each other (futures, streams, their readers),
        and only the cyclic collector frees such a cycle, at a time of its choosing, not when a
        gigabyte waits on it (measured here: a proxy held every earlier push's buffer and mapped
        a third for 1.5 GiB pushes, and a fresh mapping costs 0.8 to 3 CPU s per GiB here)."""
        with self._lock:
            waiting = any(len(m) == size and not _unused(m) for m in self._held)
            free = any(len(m) == size and _unused(m) for m in self._held)
        if waiting and not free and time.monotonic() - self._futile_at >= FUTILE_COLLECT_S:
            gc.collect()  # holds the GIL (0.2 s on a replica's heap here): at most once a while when it frees nothing
            with self._lock:
                if not any(len(m) == size and _unused(m) for m in self._held):
                    self._futile_at = time.monotonic()
        with self._lock:
            idle = [m for m in self._held if _unused(m)]
            chosen = next((m for m in idle if len(m) == size), None)
            # the other idle ones beyond the bound (a fresh one counts), oldest first, are let go
            spare = self.max_idle_bytes - (size if chosen is None else 0)
            for m in reversed(idle):
                if m is not chosen and (spare := spare - len(m)) < 0:
                    self._held.remove(m)
            if chosen is not None:
                self.reused += 1
                return chosen
        buffer = payload_buffer(size)
        if isinstance(buffer, mmap.mmap) and 0 < size <= self.max_idle_bytes:
            with self._lock:
                self._held.append(buffer)
        with self._lock:
            in_use = sum(len(m) for m in self._held if m is not buffer and not _unused(m))
        log.info("bulk_buffer_mapped", bytes=size, held_in_use_bytes=in_use, reused_before=self.reused)
        return buffer


def _unused(m: mmap.mmap) -> bool:
    """Nothing but the pool refers to `m`: its list, the caller's loop variable and this call's
    argument are the only references (every memoryview, slice or numpy array of it holds one)."""
    return sys.getrefcount(m) <= 4
