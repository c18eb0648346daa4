"""Durable files: the one place rollwire writes bytes that must survive a crash.

Invariant: after `write_atomic(path, data)` returns, `path` holds `data` on disk, and a crash
at any moment before leaves either the old content or the new one, never a mix; the rename
is made durable by fsyncing the folder. Used by the proxy's spool, the SGLang engine's
adapter folders and the learner's checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_synced(path: Path, data: bytes) -> None:
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
    write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
