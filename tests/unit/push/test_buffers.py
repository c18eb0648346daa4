"""The bulk path's receive buffers (rollwire.push.buffers, issue 36): one buffer per payload,
reused for a later push of the same size only once nothing refers to it any more."""

from __future__ import annotations

import gc

import numpy as np

from rollwire.push.buffers import BufferPool, as_bytes, payload_buffer

MiB = 1 << 20


def test_a_payload_buffer_is_writable_zeroed_and_of_the_exact_size():
    buf = payload_buffer(3 * MiB + 5)
    assert len(buf) == 3 * MiB + 5 and buf[:16] == bytes(16) and buf[-1:] == b"\0"
    memoryview(buf)[-5:] = b"abcde"
    assert as_bytes(buf)[-5:] == b"abcde" and as_bytes(b"xy") == b"xy"


def test_a_buffer_is_reused_only_once_no_payload_view_or_array_of_it_is_alive():
    pool = BufferPool(8 * MiB)
    first = pool.take(2 * MiB)
    memoryview(first)[:4] = b"v1v1"
    view = memoryview(first)[MiB:]
    array = np.frombuffer(first, dtype=np.uint8)
    del first
    busy = [pool.take(2 * MiB)]  # in use while we look: a fresh one, since a view and an array read the first
    assert pool.reused == 0 and bytes(busy[0][:4]) == bytes(4)
    del view
    gc.collect()
    busy.append(pool.take(2 * MiB))
    assert pool.reused == 0 and bytes(busy[1][:4]) == bytes(4)  # the array still reads it
    del array
    second = pool.take(2 * MiB)
    assert pool.reused == 1 and bytes(second[:4]) == b"v1v1"  # the very mapping, given again


def test_sizes_that_differ_or_exceed_the_bound_are_never_reused():
    pool = BufferPool(4 * MiB)
    a = pool.take(2 * MiB)
    a_id = id(a)
    del a
    b = pool.take(3 * MiB)  # another size: fresh (and the idle 2 MiB one is let go: 2 + 3 > 4)
    assert id(b) != a_id and pool.reused == 0
    del b
    big = pool.take(5 * MiB)  # above the bound: never kept
    del big
    pool.take(5 * MiB)
    assert pool.reused == 0
    off = BufferPool(0)
    c = off.take(MiB)
    del c
    off.take(MiB)
    assert off.reused == 0


def test_a_buffer_only_a_garbage_cycle_refers_to_is_reused_without_waiting_for_the_collector():
    """A finished push's objects often refer to each other; only the cyclic collector frees
    them. `take` collects once when every buffer of the size is still referred to, so the
    buffer a dead cycle held is reused at once instead of a fresh mapping beside it."""
    pool = BufferPool(8 * MiB)
    gc.disable()  # the collector must not run on its own in between: only `take` may run it
    try:
        first = pool.take(2 * MiB)
        memoryview(first)[:4] = b"v1v1"

        class Push:  # a reader and its stream, each referring to the other, and the payload's view
            pass

        reader, stream = Push(), Push()
        reader.stream, stream.reader, reader.view = stream, reader, memoryview(first)  # pyright: ignore[reportAttributeAccessIssue]
        del first, reader, stream  # unreachable now, but a cycle: still referred to until collected
        second = pool.take(2 * MiB)
        assert pool.reused == 1 and bytes(second[:4]) == b"v1v1"
        third = pool.take(2 * MiB)  # the second is alive (held here): a fresh one, nothing to collect
        assert pool.reused == 1 and bytes(third[:4]) == bytes(4)
    finally:
        gc.enable()


def test_a_large_buffer_is_returned_at_once_and_populated_behind_the_writes_without_losing_them():
    """Above EAGER_BYTES the pages are mapped in by a thread of their own: bytes written while it
    runs are kept, the rest reads zero, and once it is done writing a page costs no page fault."""
    import resource
    import threading

    from rollwire.push.buffers import EAGER_BYTES

    size = EAGER_BYTES + 5 * MiB + 3
    buf = payload_buffer(size)
    view = memoryview(buf)
    view[:4], view[-4:] = b"head", b"tail"  # written at once, beside the populating thread
    for t in threading.enumerate():
        if t.name == "populate":
            t.join(30)
    assert (bytes(view[:4]), bytes(view[-4:])) == (b"head", b"tail")
    assert bytes(view[4:8]) == bytes(4) and bytes(view[EAGER_BYTES : EAGER_BYTES + 4]) == bytes(4)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for at in range(4096, size - 4096, 4096):
        view[at] = 1
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < size // 4096 // 20, faults  # populated: not one fault per page (~17,700 pages)


def test_populating_a_large_buffer_leaves_the_gil_to_every_other_thread():
    """The populating thread must not hold the GIL through its system calls: the event loop and
    the reading thread run beside it. With a switch interval of a minute, a thread that kept the
    GIL through its calls would let this one run again only once it had ended (mmap.madvise did:
    the check below then saw it finished); one that releases it lets this one run at once."""
    import sys
    import threading

    from rollwire.push.buffers import EAGER_BYTES

    before = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        # the populate thread's first 32 MiB step alone takes 10-50 ms here; the check, microseconds
        buffer = payload_buffer(EAGER_BYTES + 32 * MiB)
        populating = [t for t in threading.enumerate() if t.name == "populate"]
        running_beside = any(t.is_alive() for t in populating)
    finally:
        sys.setswitchinterval(before)
    for t in populating:
        t.join(30)
    assert populating and running_beside
    assert memoryview(buffer)[-1] == 0


def test_a_collection_that_frees_nothing_is_not_run_again_at_every_push():
    """A replica that keeps earlier versions holds their buffers: a collection cannot free them, and
    each one holds the GIL (0.2 s on a replica's heap), so after a futile one `take` maps at once."""
    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            collections.append(1)

    pool = BufferPool(16 * MiB)
    kept = [pool.take(2 * MiB)]  # a version the replica still serves: really in use
    gc.callbacks.append(count)
    try:
        kept.append(pool.take(2 * MiB))  # every 2 MiB buffer in use: one collection, futile
        kept.append(pool.take(2 * MiB))  # and not another one now
    finally:
        gc.callbacks.remove(count)
    assert len(collections) == 1 and pool.reused == 0
