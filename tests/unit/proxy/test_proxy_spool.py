"""The proxy's adapter spool on a real folder: checks, idempotence, bounds, reload."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from support.wire import manifest_for, streamed

from rollwire.common.errors import RollwireError
from rollwire.common.reasons import Reason
from rollwire.proxy.spool import Spool
from rollwire.v1 import generator_pb2 as pb


def upload_msgs(name, version, payload, chunk=4, **changes):
    yield pb.PushAdapterRequest(manifest=manifest_for(payload, name, version, r=1, **changes))
    for i in range(0, len(payload), chunk):
        yield pb.PushAdapterRequest(chunk=payload[i : i + chunk])


def spool_at(path, **kw) -> Spool:
    opts = dict(max_bytes=1000, keep_versions=2, max_adapter_bytes=500) | kw
    return Spool(path, **opts)


def put(spool: Spool, name, version, payload, **changes):
    upload = asyncio.run(spool.receive(streamed(upload_msgs(name, version, payload, **changes))))
    return spool.commit(upload)


def refusal(spool, name, version, payload, **changes) -> RollwireError:
    with pytest.raises(RollwireError) as info:
        put(spool, name, version, payload, **changes)
    return info.value


def test_a_committed_version_is_listed_and_its_bytes_kept(tmp_path):
    spool = spool_at(tmp_path)
    adapter, created = put(spool, "pol", 1, b"0123456789")
    assert created and [a.version for a in spool.versions("pol")] == [1]
    assert asyncio.run(adapter.payload()) == b"0123456789"
    assert not list((tmp_path / ".incoming").iterdir())


def test_same_version_same_bytes_is_idempotent_and_different_bytes_conflict(tmp_path):
    spool = spool_at(tmp_path)
    put(spool, "pol", 1, b"aaaa")
    assert put(spool, "pol", 1, b"aaaa")[1] is False
    err = refusal(spool, "pol", 1, b"bbbb")
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.VERSION_CONFLICT)
    err = refusal(spool, "pol", 0, b"bbbb")
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_ADAPTER_VERSION)
    put(spool, "pol", 3, b"cccc")
    err = refusal(spool, "pol", 2, b"dddd")
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.VERSION_NOT_MONOTONIC)


@pytest.mark.parametrize(
    "changes, reason",
    [
        (dict(sha256="0" * 64), Reason.DIGEST_MISMATCH),
        (dict(byte_length=11), Reason.LENGTH_MISMATCH),
        (dict(byte_length=9), Reason.LENGTH_MISMATCH),
        (dict(sha256="XYZ"), Reason.BAD_DIGEST),
    ],
)
def test_bad_uploads_are_refused_and_leave_nothing_behind(tmp_path, changes, reason):
    spool = spool_at(tmp_path)
    err = refusal(spool, "pol", 1, b"0123456789", **changes)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == reason
    assert spool.names() == [] and not list((tmp_path / ".incoming").iterdir())


def test_a_name_that_could_escape_the_folder_is_refused(tmp_path):
    err = refusal(spool_at(tmp_path), "../escape", 1, b"0123456789")
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_ADAPTER_NAME)
    assert not (tmp_path.parent / "escape").exists()


def test_too_large_adapters_are_refused_before_any_byte(tmp_path):
    err = refusal(spool_at(tmp_path, max_adapter_bytes=5), "pol", 1, b"0123456789")
    assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.ADAPTER_TOO_LARGE)
    spool = spool_at(tmp_path, max_bytes=15)
    put(spool, "a", 1, b"0123456789")
    err = refusal(spool, "b", 1, b"0123456789")  # a's newest version may not be evicted for b
    assert (err.code, err.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.SPOOL_FULL)


def test_keeps_the_newest_versions_and_evicts_old_ones_for_room(tmp_path):
    spool = spool_at(tmp_path, max_bytes=25, keep_versions=2)
    for v in (1, 2, 3):
        put(spool, "a", v, bytes([v]) * 10)
    assert [a.version for a in spool.versions("a")] == [2, 3]
    put(spool, "b", 1, b"x" * 10)  # 30 > 25 bytes: a v2 goes, a v3 (newest) stays
    assert [a.version for a in spool.versions("a")] == [3] and spool.total_bytes() == 20


def lora_bytes(value: float = 0.5) -> bytes:
    """A tiny r=1 PEFT LoRA in safetensors, built without torch (reload checks payloads)."""
    import json
    import struct

    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    header = {
        f"{prefix}.lora_A.weight": {"dtype": "F32", "shape": [1, 4], "data_offsets": [0, 16]},
        f"{prefix}.lora_B.weight": {"dtype": "F32", "shape": [4, 1], "data_offsets": [16, 32]},
    }
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + struct.pack("<8f", *([value] * 8))


def test_a_name_whose_last_version_leaves_leaves_no_folder(tmp_path):
    spool = spool_at(tmp_path)
    discarded, _ = put(spool, "gone", 1, b"0123456789")
    spool.discard(discarded)  # a push no replica accepted
    quarantined, _ = put(spool, "bad", 1, b"0123456789")
    assert spool.quarantine(quarantined, "every replica refused it")
    put(spool, "kept", 1, b"0123456789")
    older, _ = put(spool, "kept", 2, b"abcdefghij")
    spool.discard(older)  # another version is left: the folder stays
    assert sorted(p.name for p in tmp_path.iterdir()) == [".incoming", ".quarantine", "kept"]
    assert spool.names() == ["kept"]


def test_a_restarted_proxy_reloads_its_spool(tmp_path):
    good = lora_bytes()
    put(spool_at(tmp_path), "pol", 4, good)
    put(spool_at(tmp_path), "pol", 5, b"payload!")  # not safetensors: quarantined at reload
    (tmp_path / "pol" / "9.json").write_text("not json")  # a manifest without payload: an orphan, removed
    again = spool_at(tmp_path)
    assert [a.version for a in again.versions("pol")] == [4]
    assert asyncio.run(again.versions("pol")[0].payload()) == good
    assert sorted(p.suffix for p in (tmp_path / "pol").iterdir()) == [".json", ".safetensors"]
    assert len(list((tmp_path / ".quarantine" / "pol").glob("*.why.txt"))) == 1
