"""Durable files: the one place rollwire writes bytes or folders that must survive a crash.

Invariants: after `write_atomic(path, data)` returns, `path` holds `data` on disk, and a
crash at any moment before leaves either the old content or the new one, never a mix; after
an `atomic_dir(final)` block ends, `final` is the folder the block wrote, whole, and a crash
or an exception before leaves no `final` from it (a crash leaves at most a hidden
`.<name>.tmp-*` folder beside it). Each rename is made durable by fsyncing the folder it
happened in. A write that fails (a full disk included) leaves no temporary file behind:
space it took is given back at once. Used by the proxy's spool, the SGLang engine's adapter
folders, the learner's checkpoints and summary, the demo's taught model and the servers'
ready files. `storage_error` turns a failed write into the status a client is sent.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rollwire.common.errors import ResourceExhausted, RollwireError, Unavailable
from rollwire.common.reasons import Reason

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A write refused for want of space: no space left on the device, or a disk quota used up."""


def disk_full(exc: BaseException) -> bool:
    """True for an OSError that means the disk (or the writer's quota) is full."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def storage_error(exc: OSError, where: str, fix: str = "") -> RollwireError:
    """The status for a write into `where` (a sentence naming the folder) that failed with
    `exc`: RESOURCE_EXHAUSTED (DISK_FULL) when the disk is full, to be retried once space is
    freed (`fix`: how else to make room, as a clause starting with ", or"), UNAVAILABLE
    (STORE_FAILED) for any other failure of the disk. Nothing was applied either way."""
    cause = exc.strerror or str(exc)
    if disk_full(exc):
        return ResourceExhausted(
            f"no space left on the disk holding {where} ({cause}); nothing was applied: free space on that "
            f"disk{fix}, then try again",
            reason=Reason.DISK_FULL,
        )
    return Unavailable(
        f"could not write to {where} ({cause}); nothing was applied, retry later",
        reason=Reason.STORE_FAILED,
        retry_after_s=1.0,
    )


def write_synced(path: Path, data: ReadableBuffer) -> None:
    """Write `data` to `path` and flush it to disk (not yet atomic: see write_atomic)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` durably: a crash leaves the old or the new content."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written copy
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_dir(final: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside `final` to fill; when the block ends without an
    exception, fsync that folder, rename it to `final` (removing an old `final` first when
    `replace`; otherwise an existing non-empty `final` makes the rename fail) and fsync the
    parent. Files written into it that must be durable are written with `write_synced`. On an
    exception the temporary folder is removed and `final` is untouched."""
    final = Path(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        fsync_dir(tmp)
        if replace and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)


def write_ready_file(path: str, data: dict) -> None:
    """Atomically write the ports a supervisor or test waits for (every server process, the
    learner's ingest service included)."""
    write_atomic(Path(path), json.dumps(data).encode())
