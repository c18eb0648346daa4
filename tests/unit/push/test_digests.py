"""The digest agreement of a push (rollwire.push.digests, issue 36): a manifest's BLAKE3 is
verified in sha256's place on every hop, both at the proxy that takes a client's upload, with
the same reason (DIGEST_MISMATCH) whichever fails; signatures and relay grants cover it.

No processes and no sockets: a reader is fed an async iterator of messages. The real hops
(both paths, a byte altered mid-tree) are tests/integration/push/test_push_relay.py's."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

import pytest
from blake3 import blake3
from support.wire import manifest_for, push_messages, streamed

from rollwire.client._push import build_manifest
from rollwire.common.errors import InvalidArgument
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import check_manifest, manifest_from_pb
from rollwire.common.signing import SigningKey, sign, verify
from rollwire.common.writer import opening
from rollwire.push.digests import Digests
from rollwire.push.plan import relay_grant
from rollwire.push.reader import PushReader

PAYLOAD = random.Random(3).randbytes(300 << 10)
SHA, B3 = hashlib.sha256(PAYLOAD).hexdigest(), blake3(PAYLOAD).hexdigest()
OTHER = "0" * 64


async def received(manifest, payload: bytes = PAYLOAD, *, both: bool = False) -> bytes:
    reader = PushReader(streamed(push_messages(manifest, payload, 64 << 10)), 5, "test", both_digests=both)
    try:
        await reader.open()
        async for _ in reader.chunks():
            pass
        return bytes(await reader.finish())
    finally:
        reader.close()


def test_the_sdk_sets_both_digests_of_the_same_bytes():
    m = build_manifest("pol", 1, PAYLOAD, LoraShape(2, 4.0, ("q_proj",)), "fp")
    assert (m.sha256, m.blake3) == (SHA, B3)


@pytest.mark.parametrize(
    ("sha256", "b3", "both", "refused_by"),
    [
        (SHA, B3, False, None),
        (SHA, B3, True, None),
        (SHA, "", False, None),  # no BLAKE3: sha256, as before
        (OTHER, "", False, "sha256"),
        (SHA, OTHER, False, "blake3"),  # a BLAKE3 that does not match: refused as a bad sha256 is
        (SHA, OTHER, True, "blake3"),
        (OTHER, B3, True, "sha256"),  # the proxy checks both: a sha256 that does not name these bytes
    ],
)
async def test_a_hop_verifies_the_blake3_when_set_and_the_proxy_both(sha256, b3, both, refused_by):
    manifest = manifest_for(PAYLOAD, sha256=sha256, blake3=b3)
    if refused_by is None:
        assert await received(manifest, both=both) == PAYLOAD
        return
    with pytest.raises(InvalidArgument) as err:
        await received(manifest, both=both)
    assert err.value.reason == "DIGEST_MISMATCH" and f"payload {refused_by} is" in err.value.message


async def test_a_hop_that_trusts_the_blake3_still_catches_a_tampered_byte():
    """A relayed hop (no `both`) sees the right sha256 and BLAKE3 but one altered byte."""
    altered = bytearray(PAYLOAD)
    altered[123_456] ^= 0x10
    with pytest.raises(InvalidArgument) as err:
        await received(manifest_for(PAYLOAD, blake3=B3), bytes(altered))
    assert err.value.reason == "DIGEST_MISMATCH" and "blake3" in err.value.message


def test_digests_computed_match_each_library_on_pieces():
    d = Digests(manifest_for(PAYLOAD, blake3=B3), both=True)
    view = memoryview(PAYLOAD)
    for i in range(0, len(PAYLOAD), 7777):
        d.update(view[i : i + 7777])
    d.check()
    assert [name for name, _, _ in d.expected] == ["BLAKE3", "sha256"]


def test_a_malformed_blake3_is_refused_before_any_byte():
    for bad in ("AB" * 32, "ab" * 31, "zz" * 32):
        with pytest.raises(InvalidArgument) as err:
            check_manifest(manifest_from_pb(manifest_for(PAYLOAD, blake3=bad)), fingerprint="fp", max_bytes=1 << 30)
        assert err.value.reason == "BAD_DIGEST"
    check_manifest(manifest_from_pb(manifest_for(PAYLOAD, blake3=B3)), fingerprint="fp", max_bytes=1 << 30)


def test_a_signature_and_a_relay_grant_cover_the_blake3():
    key = SigningKey.generate("learner")
    signed = sign(manifest_for(PAYLOAD, blake3=B3), key)
    assert verify(signed, key.private.public_key())
    swapped = type(signed)()
    swapped.CopyFrom(signed)
    swapped.blake3 = OTHER
    assert not verify(swapped, key.private.public_key())
    plain = sign(manifest_for(PAYLOAD), key)  # no BLAKE3: signed as before it existed
    assert verify(plain, key.private.public_key())
    grant = relay_grant(b"k" * 32, signed, "10.0.0.1:50051")
    assert grant != relay_grant(b"k" * 32, swapped, "10.0.0.1:50051")
    assert relay_grant(b"k" * 32, plain, "a:1") == relay_grant(b"k" * 32, manifest_for(PAYLOAD), "a:1")


def test_the_proxys_sha256_beside_takes_every_piece_in_order_on_its_own_thread():
    """Both digests (a proxy): the sha256 runs on a worker of its own, fed the pieces in order;
    many small pieces of random sizes give exactly hashlib's digest of the whole, and a byte
    swapped between two pieces is caught (order matters to sha256, not only content)."""
    rng = random.Random(11)
    cuts = sorted(rng.sample(range(1, len(PAYLOAD)), 999))
    pieces = [PAYLOAD[a:b] for a, b in zip([0, *cuts], [*cuts, len(PAYLOAD)], strict=True)]
    d = Digests(manifest_for(PAYLOAD, blake3=B3), both=True)
    assert d._beside is not None  # the sha256 has its own thread
    for piece in pieces:
        d.update(memoryview(piece))
    d.wait()
    d.check()
    order = [pieces[1], pieces[0], *pieces[2:]]
    # the BLAKE3 of the bytes as sent, the sha256 of the payload: only the sha256 beside can refuse
    swapped = Digests(manifest_for(PAYLOAD, blake3=blake3(b"".join(order)).hexdigest()), both=True)
    for piece in order:
        swapped.update(piece)
    with pytest.raises(InvalidArgument) as err:
        swapped.check()
    assert err.value.reason == "DIGEST_MISMATCH" and "payload sha256 is" in err.value.message


def test_a_closed_digest_drops_what_its_sha256_has_not_hashed():
    d = Digests(manifest_for(PAYLOAD, blake3=B3), both=True)
    for _ in range(200):
        d.update(PAYLOAD)
    d.close()
    d.wait()  # returns: nothing queued is left to hash
    assert d._beside is not None and d._beside._shutdown


# -- a sha256 left to the receiver (issue 36: the first byte after the BLAKE3 alone) -----------
@pytest.mark.parametrize("stage_only", [False, True])
async def test_a_receiver_that_keeps_the_bytes_names_the_sha256_a_manifest_left_to_it(stage_only):
    """The first receiver (a proxy, a replica pushed to directly) computes the sha256 of the bytes
    the BLAKE3 verified and writes it into the manifest it holds; a relay's stage computes none
    (its commit names it) and the manifest keeps its empty sha256."""
    manifest = manifest_for(PAYLOAD, sha256="", blake3=B3)
    messages = [opening(manifest, stage_only=stage_only), *list(push_messages(manifest, PAYLOAD, 50_000))[1:]]
    reader = PushReader(streamed(messages), 5, "test")
    try:
        await reader.open()
        async for _ in reader.chunks():
            pass
        assert bytes(await reader.finish()) == PAYLOAD
    finally:
        reader.close()
    assert reader.manifest is not None
    assert reader.manifest.sha256 == ("" if stage_only else hashlib.sha256(PAYLOAD).hexdigest())


async def test_bytes_a_wrong_blake3_refuses_get_no_sha256_named():
    manifest = manifest_for(PAYLOAD, sha256="", blake3=OTHER)
    with pytest.raises(InvalidArgument) as err:
        await received(manifest)
    assert err.value.reason == "DIGEST_MISMATCH" and "payload blake3 is" in err.value.message
    assert manifest.sha256 == ""  # the reader's copy was never named either: checked before


def test_only_an_unsigned_manifest_with_a_blake3_may_leave_its_sha256_empty():
    """Every combination of sha256 (right, empty, malformed), BLAKE3 (right, empty, malformed) and
    signer (none, one): the rule, stated independently, against check_manifest."""
    for sha in (SHA, "", "AB" * 32, "ab" * 31):
        for b3 in (B3, "", "zz" * 32):
            for signer in ("", "learner"):
                m = manifest_from_pb(manifest_for(PAYLOAD, sha256=sha, blake3=b3))
                m = replace(m, signer=signer)
                hex64 = {SHA, B3}
                ok = (b3 == "" or b3 in hex64) and (sha in hex64 or (sha == "" and b3 in hex64 and not signer))
                if ok:
                    check_manifest(m, fingerprint="fp", max_bytes=1 << 30)
                    continue
                with pytest.raises(InvalidArgument) as err:
                    check_manifest(m, fingerprint="fp", max_bytes=1 << 30)
                assert err.value.reason == "BAD_DIGEST", (sha, b3, signer)


def test_the_version_rule_knows_a_held_version_by_its_blake3_when_the_sha256_was_left_out():
    from rollwire.common.errors import FailedPrecondition
    from rollwire.common.manifest import check_push_version

    deferred = manifest_for(PAYLOAD, sha256="", blake3=B3)
    assert check_push_version(deferred, 1, SHA, "replica", held_blake3=B3)  # the same bytes: idempotent
    assert check_push_version(manifest_for(PAYLOAD, blake3=B3), 1, SHA, "replica", held_blake3="")
    for held_b3, hint in ((OTHER, False), ("", True)):  # other bytes, or a version held without a BLAKE3
        with pytest.raises(FailedPrecondition) as err:
            check_push_version(deferred, 1, SHA, "proxy", held_blake3=held_b3)
        assert err.value.reason == "VERSION_CONFLICT"
        assert ("name the sha256" in err.value.message) is hint
    assert not check_push_version(deferred, 0, None, "replica")  # a new version


def test_the_sdk_leaves_the_sha256_out_only_unsigned_and_its_blake3_is_the_whole_payloads():
    from rollwire.common.errors import RequestError

    shape = LoraShape(2, 4.0, ("q_proj",))
    m = build_manifest("pol", 1, PAYLOAD, shape, "fp", sha256_by_receiver=True)
    assert (m.sha256, m.blake3) == ("", B3)
    big = random.Random(5).randbytes(9 << 20)  # past PARALLEL_BYTES: BLAKE3 on every core
    assert build_manifest("pol", 1, big, shape, "fp", sha256_by_receiver=True).blake3 == blake3(big).hexdigest()
    with pytest.raises(RequestError):
        build_manifest("pol", 1, PAYLOAD, shape, "fp", SigningKey.generate("k"), sha256_by_receiver=True)
