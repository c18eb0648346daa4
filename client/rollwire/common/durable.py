"""Durable files: the one place rollwire writes bytes or folders that must survive a crash.

Invariants: after `write_atomic(path, data)` returns, `path` holds `data` on disk, and a
crash at any moment before leaves either the old content or the new one, never a mix; after
an `atomic_dir(final)` block ends, `final` is the folder the block wrote, whole, and a crash
or an exception before leaves no `final` from it (a crash leaves at most a hidden
`.<name>.tmp-*` folder beside it). Each rename is made durable by fsyncing the folder it
happened in. Used by the proxy's spool, the SGLang engine's adapter folders, the learner's
checkpoints and summary, the demo's taught model and the servers' ready files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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
