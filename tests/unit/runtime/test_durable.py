"""rollwire.runtime.durable: a file or a folder is replaced whole or not at all."""

from __future__ import annotations

import pytest

from rollwire.runtime.durable import atomic_dir, write_atomic, write_synced


def test_a_folder_appears_whole_and_replaces_the_old_one(tmp_path):
    final = tmp_path / "model"
    with atomic_dir(final) as tmp:
        write_synced(tmp / "a", b"1")
        assert not final.exists() and tmp.parent == tmp_path and tmp.name.startswith(".model.tmp-")
    assert (final / "a").read_bytes() == b"1"
    with atomic_dir(final) as tmp:
        write_synced(tmp / "b", b"2")
    assert sorted(p.name for p in final.iterdir()) == ["b"]  # the old folder is gone, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary folder is left


def test_a_failed_block_leaves_the_old_folder_and_no_temporary_one(tmp_path):
    final = tmp_path / "model"
    with atomic_dir(final) as tmp:
        write_synced(tmp / "a", b"old")
    with pytest.raises(ZeroDivisionError), atomic_dir(final) as tmp:
        write_synced(tmp / "a", b"new")
        raise ZeroDivisionError
    assert (final / "a").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_without_replace_an_existing_folder_is_kept(tmp_path):
    final = tmp_path / "adapter"
    with atomic_dir(final) as tmp:
        write_synced(tmp / "a", b"first")
    with pytest.raises(OSError), atomic_dir(final, replace=False) as tmp:
        write_synced(tmp / "a", b"second")
    assert (final / "a").read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_a_file_is_replaced_whole(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, b"{}")
    write_atomic(path, b'{"a": 1}')
    assert path.read_bytes() == b'{"a": 1}' and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
