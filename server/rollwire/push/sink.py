"""The sink of one push: a worker thread that hashes, copies, stores and inspects the bytes.

Invariants:
- the event loop only queues references to received chunks; hashing (which releases the
  GIL), copying, writing the store and the `Inspector`'s checks run on one worker thread per
  push, in payload order, never on the event loop;
- `absorb` waits while the worker is more than `backlog_bytes` behind, so memory stays
  bounded when the disk is slow;
- a host holds the payload once: one buffer (or the chunks as received, or the bulk path's
  buffer they were received into: `in_place`), and a file when asked; a file that cannot be written ends the upload with RESOURCE_EXHAUSTED (DISK_FULL)
  when its disk is full, else UNAVAILABLE (STORE_FAILED) (durable.storage_error);
- `verdict` checks the digest before the inspector's refusal, and only then hands the
  payload out.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from rollwire.common.errors import RollwireError
from rollwire.push.buffers import Filled, Payload
from rollwire.push.digests import Digests
from rollwire.runtime.durable import storage_error
from rollwire.v1 import generator_pb2 as pb

_SUBMIT_BYTES = 4 << 20  # chunks are handed to the worker thread in batches of this size (a hand-off each)
WRITEBACK_BYTES = 64 << 20
"""Bytes written to the store between two starts of their writeback (an fdatasync on a thread of
its own, one at a time), so the fsync a publication waits for before its commit covers only the
last of them: 296 MiB took 0.28 s to fsync here at the end, on the push's critical path."""


class Inspector(Protocol):
    """Checks of a payload's content that can run while it arrives (push.checks.PayloadInspector)."""

    error: RollwireError | None
    """The first failure seen so far, if any."""

    def feed(self, chunk: bytes | memoryview) -> None:
        """The next chunk, in order; called on the reader's worker thread."""

    def finish(self, payload: Payload | list[bytes]) -> None:
        """After the last chunk, with the whole payload (or its chunks); raises the first failure."""


class Sink:
    """The worker thread of one push: sha256, the in-memory copy, and the optional file.

    The event loop only queues references to received chunks; hashing (which releases the
    GIL) and copying run on the worker, in order. `absorb` waits when the worker is more than
    `backlog_bytes` behind, so memory stays bounded when the disk is slow."""

    def __init__(
        self,
        size: int,
        store: Path | None,
        backlog_bytes: int,
        inspector: Inspector | None,
        keep_chunks: bool,
        in_place: Callable[[], Payload] | None = None,
        *,
        digests: Digests,
        flat: bool = False,
    ) -> None:
        """`in_place`: the chunks are views of one buffer that holds the payload already (the bulk
        path's, `BulkSource.buffer`): nothing is copied, and the payload is that buffer. `flat`:
        the payload is copied into one buffer of its size (`buffers.Filled`), not `bytes`."""
        self.size, self.backlog, self.inspector = size, backlog_bytes, inspector
        self.digests = digests
        self.in_place = in_place
        # BytesIO grows in place and getvalue() hands over its buffer without a copy, so the
        # payload costs its size once, not twice as a list of chunks plus their join would.
        self.buffer: io.BytesIO | Filled | None = None
        if not keep_chunks and not in_place:
            self.buffer = Filled(size) if flat else io.BytesIO()
        self.kept: list[bytes] | None = [] if keep_chunks else None
        self.store = store
        try:
            self.file = store.open("wb") if store is not None else None
        except OSError as exc:
            raise self.store_error(exc) from None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push-sink")
        self._unsynced = 0
        self._writeback: Future[None] | None = None
        self._flusher: ThreadPoolExecutor | None = None
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.inflight: deque[tuple[asyncio.Future, int]] = deque()
        self.inflight_bytes = 0
        self.closed = False

    async def absorb(self, chunk: bytes) -> None:
        if self.kept is not None:
            self.kept.append(chunk)
        self.pending.append(chunk)
        self.pending_bytes += len(chunk)
        if self.pending_bytes >= _SUBMIT_BYTES:
            self._submit()
        while self.inflight_bytes > self.backlog:
            await self._settle_oldest()

    def _submit(self) -> None:
        if not self.pending:
            return
        batch, size = self.pending, self.pending_bytes
        self.pending, self.pending_bytes = [], 0
        future = asyncio.get_running_loop().run_in_executor(self.pool, self.write, batch)
        self.inflight.append((future, size))
        self.inflight_bytes += size

    async def _settle_oldest(self) -> None:
        future, size = self.inflight[0]
        try:
            await future
        except OSError as exc:
            raise self.store_error(exc) from None
        self.inflight.popleft()
        self.inflight_bytes -= size

    def store_error(self, exc: OSError) -> RollwireError:
        """A failed write of the store: DISK_FULL when its disk is full, else STORE_FAILED."""
        where = f"the upload's file {self.store}" if self.store is not None else "the upload's buffer"
        return storage_error(exc, where)

    def write(self, batch: list[bytes] | list[memoryview]) -> None:
        """The worker's work on `batch`, in order: hash, keep, store, inspect. Runs on one thread
        at a time: the sink's worker, or (the bulk path's `PushReader.take`) the reading thread."""
        for chunk in batch:
            self.digests.update(chunk)
            if self.buffer is not None:
                self.buffer.write(chunk)
            if self.file is not None:
                self.file.write(chunk)
                self._unsynced += len(chunk)
                if self._unsynced >= WRITEBACK_BYTES:
                    self._start_writeback()
            if self.inspector is not None:
                self.inspector.feed(chunk)

    def _start_writeback(self) -> None:
        """On the writing thread: the store's bytes so far on their way to disk (unless a writeback
        still runs), so the final fsync has little left. Its failure is raised here or at the seal:
        the kernel reports a writeback error once per file, so it must not be lost on the flusher."""
        assert self.file is not None
        if self._writeback is not None:
            if not self._writeback.done():
                return
            self._writeback.result()  # raises the OSError a writeback met
        self.file.flush()
        self._unsynced = 0
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push-writeback")
        self._writeback = self._flusher.submit(os.fdatasync, self.file.fileno())

    def raise_inspection(self) -> None:
        if self.inspector is not None and self.inspector.error is not None:
            raise self.inspector.error

    def _seal(self, sync: bool) -> tuple[Payload | list[bytes], RollwireError | None]:
        self.digests.wait()  # a sha256 beside (push.digests) has every byte before the verdict
        if self.file is not None:
            if self._writeback is not None:
                self._writeback.result()  # done with the file, and its failure not lost
            self.file.flush()
            if sync:
                os.fsync(self.file.fileno())
            self.file.close()
            self.file = None
        payload: Payload | list[bytes]
        if self.buffer is not None:
            payload, self.buffer = self.buffer.getvalue(), None
        elif self.in_place is not None:
            payload, self.in_place = self.in_place(), None
        else:
            assert self.kept is not None
            payload, self.kept = self.kept, None
        refusal = None
        if self.inspector is not None:
            try:
                self.inspector.finish(payload)
            except RollwireError as exc:
                refusal = exc
        return payload, refusal

    async def finish(self, sync: bool) -> tuple[Payload | list[bytes], RollwireError | None]:
        self._submit()
        while self.inflight:
            await self._settle_oldest()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, self._seal, sync)
        except OSError as exc:
            raise self.store_error(exc) from None
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for future, _ in self.inflight:
            future.cancel()
        file, self.file = self.file, None
        if file is not None:
            self.pool.submit(file.close)  # after any write still running: FIFO, one worker
        self.pool.shutdown(wait=False, cancel_futures=False)
        if self._flusher is not None:  # a writeback not started yet must not sync the fd once it is closed (or reused)
            self._flusher.shutdown(wait=False, cancel_futures=True)
        self.digests.close()
        self.buffer = self.kept = self.in_place = None


async def verdict(m: pb.AdapterManifest, sink: Sink, sync: bool) -> Payload | list[bytes]:
    """The payload of a sink that took every byte: its digests (`Digests.check`: the manifest's
    BLAKE3 when set, else its sha256; both at a proxy taking a client's upload), then the
    inspector's checks. A manifest that left its sha256 to this receiver gets the one computed
    here (`Digests.named`), so whoever holds `m` knows the version by its sha256 from now on."""
    payload, refusal = await sink.finish(sync)
    sink.digests.check()
    if sink.digests.named:
        m.sha256 = sink.digests.named
    if refusal is not None:
        raise refusal
    return payload
