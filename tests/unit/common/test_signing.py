"""Signed manifests (rollwire.common.signing): the canonical encoding binds every identifying
field, a signature cannot be replayed onto other bytes, names or versions, and a receiver with
trusted keys refuses what is unsigned, signed by a key it does not trust, or signed over another
manifest (issue 37, item 3). Pure logic: no process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.wire import manifest_for, streamed

from rollwire.common.errors import RollwireError
from rollwire.common.reasons import Reason
from rollwire.common.signing import (
    DOMAIN,
    KeyFileError,
    SignatureFile,
    SigningKey,
    TrustedKeys,
    canonical,
    sign,
    verify,
)
from rollwire.proxy.spool import Spool
from rollwire.v1 import generator_pb2 as pb

KEY = SigningKey.generate("learner-2026")
OTHER = SigningKey.generate("learner-2026")  # same id, another key: an impostor
TRUST = TrustedKeys({KEY.key_id: KEY.private.public_key()})

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
manifests = st.builds(
    lambda name, version, fp, r, alpha, modules, rslora, payload: pb.AdapterManifest(
        name=name,
        version=version,
        base_model_fingerprint=fp,
        lora_config=pb.LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, use_rslora=rslora),
        byte_length=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    ),
    names,
    st.integers(1, 1 << 53),
    st.text(min_size=1, max_size=40),
    st.integers(1, 4096),
    st.sampled_from([1.0, 8.0, 16.0, 32.5]),
    st.lists(st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj"]), min_size=1, max_size=4, unique=True),
    st.booleans(),
    st.binary(min_size=1, max_size=64),
)

CHANGES = {
    "name": lambda m: setattr(m, "name", m.name + "x"),
    "version": lambda m: setattr(m, "version", m.version + 1),
    "base_model_fingerprint": lambda m: setattr(m, "base_model_fingerprint", m.base_model_fingerprint + "0"),
    "lora r": lambda m: setattr(m.lora_config, "r", m.lora_config.r + 1),
    "lora alpha": lambda m: setattr(m.lora_config, "lora_alpha", m.lora_config.lora_alpha * 2),
    "target modules": lambda m: m.lora_config.target_modules.append("down_proj"),
    "rslora": lambda m: setattr(m.lora_config, "use_rslora", not m.lora_config.use_rslora),
    "byte_length": lambda m: setattr(m, "byte_length", m.byte_length + 1),
    "sha256": lambda m: setattr(m, "sha256", hashlib.sha256(m.sha256.encode()).hexdigest()),
    "signer": lambda m: setattr(m, "signer", m.signer + "2"),
}


def refusal(manifest: pb.AdapterManifest, trust: TrustedKeys = TRUST) -> RollwireError:
    with pytest.raises(RollwireError) as caught:
        trust.check(manifest)
    return caught.value


@settings(max_examples=60, deadline=None)
@given(manifests)
def test_a_signature_verifies_for_its_manifest_and_each_identifying_field_changed_breaks_it(m):
    sign(m, KEY)
    assert verify(m, KEY.private.public_key())
    TRUST.check(m)  # accepted
    for what, change in CHANGES.items():
        changed = pb.AdapterManifest()
        changed.CopyFrom(m)
        change(changed)
        assert not verify(changed, KEY.private.public_key()), what
        err = refusal(changed)
        assert err.reason == Reason.BAD_SIGNATURE, what
    # transport fields are not signed: the same signature holds on every route
    assert canonical(m, m.signer).startswith(DOMAIN)


@settings(max_examples=30, deadline=None)
@given(manifests, st.binary(min_size=1, max_size=64))
def test_a_signature_replayed_onto_other_bytes_or_another_name_is_refused(m, other_payload):
    sign(m, KEY)
    replay = pb.AdapterManifest()
    replay.CopyFrom(m)
    replay.byte_length, replay.sha256 = len(other_payload), hashlib.sha256(other_payload).hexdigest()
    if replay.sha256 != m.sha256:
        err = refusal(replay)
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION and err.reason == Reason.BAD_SIGNATURE
        assert "sign this exact manifest again" in err.message
    onto_name = pb.AdapterManifest()
    onto_name.CopyFrom(m)
    onto_name.name = "other-" + m.name[:50]
    assert refusal(onto_name).reason == Reason.BAD_SIGNATURE


def test_canonical_encoding_is_unambiguous_and_ignores_module_order():
    a = pb.AdapterManifest(name="ab", base_model_fingerprint="c", lora_config=pb.LoraConfig(target_modules=["x", "y"]))
    b = pb.AdapterManifest(name="a", base_model_fingerprint="bc", lora_config=pb.LoraConfig(target_modules=["y", "x"]))
    assert canonical(a, "k") != canonical(b, "k")  # length-prefixed: no field bleeds into the next
    b.name, b.base_model_fingerprint = "ab", "c"
    assert canonical(a, "k") == canonical(b, "k")  # target modules are a set
    assert canonical(a, "k") != canonical(a, "k2")


def test_unsigned_untrusted_and_impostor_signatures_are_refused_with_a_sentence():
    m = pb.AdapterManifest(name="pol", version=3, sha256="0" * 64, byte_length=1)
    err = refusal(m)
    assert (err.code, err.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.UNSIGNED_ADAPTER)
    assert "rollwire push-adapter --signing-key" in err.message and "learner-2026" in err.message
    sign(m, SigningKey.generate("stranger"))
    err = refusal(m)
    assert err.reason == Reason.BAD_SIGNATURE and "does not trust" in err.message
    sign(m, OTHER)  # a trusted id, but not the trusted key
    assert refusal(m).reason == Reason.BAD_SIGNATURE
    m.signature = b"\0" * 10
    err = refusal(m, TrustedKeys.none())  # malformed: refused even where nothing is required
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.BAD_SIGNATURE)


def test_without_trusted_keys_anything_well_formed_passes():
    none = TrustedKeys.none()
    assert not none.required
    none.check(pb.AdapterManifest(name="pol", version=1))
    none.check(sign(pb.AdapterManifest(name="pol", version=1), OTHER))


def test_key_files_round_trip_and_rotation_trusts_several_keys(tmp_path):
    new = SigningKey.generate("learner-2027")
    KEY.save(tmp_path / "old.json")
    assert oct(os.stat(tmp_path / "old.json").st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        KEY.save(tmp_path / "old.json")  # never overwritten
    loaded = SigningKey.load(tmp_path / "old.json")
    trust_file = tmp_path / "trust.json"
    trust_file.write_text(json.dumps({"keys": [loaded.trust_entry(), new.trust_entry()]}))
    trust = TrustedKeys.load(trust_file)
    assert set(trust.keys) == {"learner-2026", "learner-2027"}
    trust.check(sign(pb.AdapterManifest(name="pol", version=1), loaded))
    trust.check(sign(pb.AdapterManifest(name="pol", version=2), new))
    for bad, said in (
        ({"keys": []}, "needs"),
        ({"keys": [KEY.trust_entry(), KEY.trust_entry()]}, "twice"),
        ({"keys": [{"id": "bad id", "public_key": KEY.public_b64()}]}, "must be 1-64"),
        ({"keys": [{"id": "k", "public_key": "AAAA"}]}, "32 bytes"),
    ):
        trust_file.write_text(json.dumps(bad))
        with pytest.raises(KeyFileError, match=said):
            TrustedKeys.load(trust_file)
    with pytest.raises(KeyFileError, match="cannot be read"):
        TrustedKeys.load(tmp_path / "absent.json")


def test_a_signature_file_round_trips_and_a_bad_one_is_refused():
    m = sign(pb.AdapterManifest(name="pol", version=4, sha256="1" * 64, byte_length=5), KEY)
    parsed = SignatureFile.parse(SignatureFile.of(m).to_json().encode())
    assert (parsed.name, parsed.version, parsed.signer) == ("pol", 4, KEY.key_id)
    TRUST.check(parsed.apply(pb.AdapterManifest(name="pol", version=4, sha256="1" * 64, byte_length=5)))
    for bad in (b"{", b'{"name": "pol"}', b"x" * 5000, b'{"name": 1, "version": 1, "signer": "k", "signature": ""}'):
        with pytest.raises(RollwireError) as caught:
            SignatureFile.parse(bad)
        assert caught.value.reason == Reason.BAD_SIGNATURE


def _lora_bytes() -> bytes:
    """A tiny r=1 PEFT LoRA in safetensors, built without torch (a spool reload checks payloads)."""
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    header = {
        f"{prefix}.lora_A.weight": {"dtype": "F32", "shape": [1, 4], "data_offsets": [0, 16]},
        f"{prefix}.lora_B.weight": {"dtype": "F32", "shape": [4, 1], "data_offsets": [16, 32]},
    }
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + struct.pack("<8f", *([0.5] * 8))


def _put(spool: Spool, manifest: pb.AdapterManifest, payload: bytes) -> None:
    messages = [pb.PushAdapterRequest(manifest=manifest), pb.PushAdapterRequest(chunk=payload)]
    spool.commit(asyncio.run(spool.receive(streamed(messages))))


def test_the_spool_refuses_unsigned_manifests_and_quarantines_unsigned_versions_at_reload(tmp_path):
    payload = _lora_bytes()

    def open_spool(trust: TrustedKeys | None = None) -> Spool:
        return Spool(tmp_path, max_bytes=1 << 20, keep_versions=8, max_adapter_bytes=1 << 20, trust=trust)

    before = open_spool()  # no keys trusted: a signature is carried, not required
    _put(before, manifest_for(payload, "pol", 1, r=1), payload)
    _put(before, sign(manifest_for(payload, "pol", 2, r=1), KEY), payload)
    spool = open_spool(TRUST)
    assert [a.version for a in spool.versions("pol")] == [2]  # v1 was spooled before the keys were set
    assert spool.versions("pol")[0].manifest.signer == KEY.key_id  # the signature survives the disk
    assert len(list((tmp_path / ".quarantine" / "pol").glob("*.why.txt"))) == 1
    with pytest.raises(RollwireError) as caught:
        spool.admit(manifest_for(payload, "pol", 3, r=1), None)
    assert caught.value.reason == Reason.UNSIGNED_ADAPTER and spool.reserved == 0  # refused before reserving
    spool.admit(sign(manifest_for(payload, "pol", 3, r=1), KEY), None).discard()


def test_the_keys_commands_generate_sign_and_verify_a_folder(tmp_path, capsys):
    from rollwire.client import cli

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(_lora_bytes())
    (folder / "adapter_config.json").write_text(json.dumps({"r": 1, "lora_alpha": 2, "target_modules": ["q_proj"]}))
    key, trust = str(tmp_path / "a.key"), str(tmp_path / "trust.json")
    assert cli.main(["keys", "generate", "--id", "key-a", "--out", key, "--trust-file", trust]) == 0
    assert cli.main(["keys", "generate", "--id", "key-a", "--out", key]) == 2  # never overwritten
    sign_args = ["--name", "pol", "--version", "3", "--base-fingerprint", "fp", str(folder)]
    assert cli.main(["keys", "sign", "--signing-key", key, *sign_args]) == 0
    verify = ["keys", "verify", "--trust-file", trust, "--base-fingerprint", "fp", str(folder)]
    assert cli.main(verify) == 0 and "signed by 'key-a'" in capsys.readouterr().out
    assert cli.main([*verify[:-2], "other-fp", str(folder)]) == 1  # the signature names another base model
    assert "FAILED_PRECONDITION" in capsys.readouterr().err
    (folder / "adapter_model.safetensors").write_bytes(_lora_bytes().replace(b"\x00\x00\x00?", b"\x00\x00\x80?"))
    assert cli.main(verify) == 1  # other bytes under the same signature
    assert "does not match its manifest" in capsys.readouterr().err


def test_rank_and_alpha_patterns_are_covered_in_their_order_and_absent_ones_change_nothing():
    """A pattern changes a module's scaling, so a signature covers it (issue 49); a manifest without
    patterns encodes as before, so older signatures still verify."""
    plain = manifest_for(b"x", r=2)
    with_rank = manifest_for(b"x", r=2)
    with_rank.lora_config.rank_pattern.add(pattern="q_proj", value=4)
    reordered = manifest_for(b"x", r=2)
    reordered.lora_config.rank_pattern.add(pattern="k_proj", value=2)
    reordered.lora_config.rank_pattern.add(pattern="q_proj", value=4)
    ordered = manifest_for(b"x", r=2)
    ordered.lora_config.rank_pattern.add(pattern="q_proj", value=4)
    ordered.lora_config.rank_pattern.add(pattern="k_proj", value=2)
    as_alpha = manifest_for(b"x", r=2)
    as_alpha.lora_config.alpha_pattern.add(pattern="q_proj", value=4)
    encodings = {canonical(m, "k") for m in (plain, with_rank, reordered, ordered, as_alpha)}
    assert len(encodings) == 5  # the first match wins, so the order is part of the meaning
    stripped = pb.AdapterManifest()
    stripped.CopyFrom(with_rank)
    del stripped.lora_config.rank_pattern[:]
    assert canonical(stripped, "k") == canonical(plain, "k")
