"""The store's writeback while a push arrives (rollwire.push.sink, issue 36): its bytes are sent
to disk every WRITEBACK_BYTES on a thread of their own, so the fsync a publication waits for at
its end has little left; a writeback that fails is the push's store error, never lost (the
kernel reports a writeback error once per file)."""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
from support.wire import manifest_for

from rollwire.common.errors import RollwireError
from rollwire.push import sink as sink_module
from rollwire.push.digests import Digests
from rollwire.push.sink import Sink

MiB = 1 << 20
PAYLOAD = random.Random(5).randbytes(10 * MiB + 123)


def sink_for(tmp_path, payload: bytes) -> Sink:
    return Sink(len(payload), tmp_path / "upload", 8 * MiB, None, False, digests=Digests(manifest_for(payload)))


async def test_the_store_goes_to_disk_while_the_push_arrives_and_holds_the_payload(tmp_path, monkeypatch):
    monkeypatch.setattr(sink_module, "WRITEBACK_BYTES", 2 * MiB)
    synced: list[tuple[str, int]] = []  # (thread, bytes in the file then)
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        synced.append((threading.current_thread().name, os.fstat(fd).st_size))
        real(fd)

    monkeypatch.setattr(sink_module.os, "fdatasync", fdatasync)
    sink = sink_for(tmp_path, PAYLOAD)
    view = memoryview(PAYLOAD)
    for at in range(0, len(PAYLOAD), MiB):
        sink.write([view[at : at + MiB]])
        if sink._writeback is not None:
            sink._writeback.result()  # each one done before the next chunk: every start is seen
    payload, refusal = await sink.finish(sync=True)
    assert isinstance(payload, (bytes, bytearray)) and refusal is None and payload == PAYLOAD
    assert (tmp_path / "upload").read_bytes() == PAYLOAD
    assert [n for _, n in synced] == [2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB, 10 * MiB]  # every 2 MiB, as written
    assert {t for t, _ in synced} == {"push-writeback_0"}  # never on the writing thread


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
async def test_a_writeback_that_fails_is_the_pushs_store_error(tmp_path, monkeypatch, code):
    monkeypatch.setattr(sink_module, "WRITEBACK_BYTES", 2 * MiB)

    def failing(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(sink_module.os, "fdatasync", failing)
    sink = sink_for(tmp_path, PAYLOAD)
    view = memoryview(PAYLOAD)
    with pytest.raises((OSError, RollwireError)) as err:  # at the next start, or at the seal: never lost
        for at in range(0, len(PAYLOAD), MiB):
            sink.write([view[at : at + MiB]])
        await sink.finish(sync=False)
    error = err.value if isinstance(err.value, RollwireError) else sink.store_error(err.value)  # pyright: ignore[reportArgumentType]
    assert error.reason == ("DISK_FULL" if code == errno.ENOSPC else "STORE_FAILED")
    sink.close()
