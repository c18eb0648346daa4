"""Signed adapter versions: a publisher signs a manifest (Ed25519), receivers that trust its key verify it.

What is signed is `canonical(manifest)`: the fixed prefix `DOMAIN`, then every manifest field that
decides which policy the bytes are — name, version, base-model fingerprint, LoRA shape (r, alpha as
the wire's float32, sorted target modules, rslora), byte length, sha256 — and the signer's key id,
each length-prefixed, in that order; then, when set, the BLAKE3, the probe's digest
(rollwire.common.probe) and the rank/alpha patterns. Transport fields (relay plan, stripes, grants, stage_only)
are not, so the same signature serves every route a version takes.

Invariants:
- a signature verifies for exactly one (name, version, bytes, base model, LoRA shape, signer):
  changing any of them, or replaying the signature onto another manifest, fails `verify`;
- the prefix keeps a manifest signature from being valid as anything else signed with the key;
- `TrustedKeys.check` is the one verdict every receiver uses (replica intake, proxy spool): with
  no key trusted it accepts anything (a signature is carried, not required); with keys, an
  unsigned manifest is refused (UNSIGNED_ADAPTER), a wrong or unknown-key one too (BAD_SIGNATURE),
  both FAILED_PRECONDITION with a sentence saying how to sign, before any payload byte is read;
- several keys may be trusted at once (rotation: trust the new key, move publishers to it, then
  drop the old one); key ids are `KEY_ID_RE`, unique within one trust file.

Files (JSON): a signing key `{"id": ID, "private_key": BASE64 of the 32-byte Ed25519 seed}` (keep it
0600, `rollwire keys generate` writes it so); a trust file `{"keys": [{"id": ID, "public_key":
BASE64 of the 32-byte public key}, ...]}`. Needs no torch and no server code.
"""

from __future__ import annotations

import base64
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollwire.common.errors import FailedPrecondition, InvalidArgument
from rollwire.common.probe import probe_digest
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb

if TYPE_CHECKING:  # cryptography loads in ~35 ms: only processes that sign or verify pay for it
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

DOMAIN = b"rollwire-manifest-v1\0"
"""Prefix of every signed message: a signature over a manifest is valid as nothing else."""
KEY_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""Key ids: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit (fullmatch)."""
SIGNATURE_BYTES = 64
HOW_TO_SIGN = (
    "sign it with a trusted key (`rollwire push-adapter --signing-key FILE`, the SDK's push_adapter(signing_key=...), "
    "the learner's signing_key_file, or `rollwire keys sign` for a folder loaded over HTTP; docs/security.md)"
)


class KeyFileError(ValueError):
    """A key or trust file that cannot be used; the message names the file and what is wrong."""


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def canonical(manifest: pb.AdapterManifest, key_id: str) -> bytes:
    """The bytes a signature covers: DOMAIN, then the identifying fields and the key id,
    each length-prefixed (so no two different manifests encode alike)."""
    lora = manifest.lora_config
    parts = [
        manifest.name.encode(),
        struct.pack(">Q", manifest.version),
        manifest.base_model_fingerprint.encode(),
        struct.pack(">I", lora.r),
        struct.pack(">f", lora.lora_alpha),
        b"".join(_field(t.encode()) for t in sorted(lora.target_modules)),
        b"\1" if lora.use_rslora else b"\0",
        struct.pack(">Q", manifest.byte_length),
        manifest.sha256.encode(),
        key_id.encode(),
    ]
    if manifest.blake3:  # covered when set, so no hop can swap it with the bytes; absent, as before
        parts.append(b"blake3:" + manifest.blake3.encode())
    if manifest.HasField("probe"):  # covered when set (the numbers a replica is held to); absent, as before
        parts.append(b"probe:" + probe_digest(manifest.probe))
    for tag, patterns in ((b"rank_pattern:", lora.rank_pattern), (b"alpha_pattern:", lora.alpha_pattern)):
        if patterns:  # covered in their order when set (they change the scaling); absent, as before
            parts.append(tag + b"".join(_field(p.pattern.encode()) + struct.pack(">f", p.value) for p in patterns))
    return DOMAIN + b"".join(_field(p) for p in parts)


@dataclass(frozen=True)
class SigningKey:
    """A publisher's Ed25519 key and its id: what `sign` puts in a manifest."""

    key_id: str
    private: Ed25519PrivateKey

    @classmethod
    def generate(cls, key_id: str) -> SigningKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return cls(_check_id(key_id, "the key id"), Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | Path) -> SigningKey:
        """From a signing key file (`rollwire keys generate`); KeyFileError naming the file."""
        data = _read_json(path, "signing key")
        if not isinstance(data, dict) or not isinstance(data.get("private_key"), str):
            raise KeyFileError(f"signing key file {str(path)!r} needs {{'id': ..., 'private_key': BASE64}}")
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key_id = _check_id(data.get("id"), f"the id in {str(path)!r}")
        return cls(key_id, Ed25519PrivateKey.from_private_bytes(_raw32(data["private_key"], path)))

    def public_b64(self) -> str:
        raw = self.private.public_key().public_bytes_raw()
        return base64.b64encode(raw).decode()

    def save(self, path: str | Path) -> None:
        """Write the key file, readable by its owner only (created 0600; never overwrites)."""
        raw = base64.b64encode(self.private.private_bytes_raw()).decode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"id": self.key_id, "private_key": raw}, f)
            f.write("\n")

    def trust_entry(self) -> dict[str, str]:
        """This key's entry in a trust file's "keys" list."""
        return {"id": self.key_id, "public_key": self.public_b64()}


def sign(manifest: pb.AdapterManifest, key: SigningKey) -> pb.AdapterManifest:
    """Set `manifest`'s signer and signature (in place, and returned) for its current fields."""
    manifest.signer = key.key_id
    manifest.signature = key.private.sign(canonical(manifest, key.key_id))
    return manifest


def verify(manifest: pb.AdapterManifest, public: Ed25519PublicKey) -> bool:
    """Does `manifest.signature` verify under `public` for this manifest and its signer?"""
    from cryptography.exceptions import InvalidSignature

    if len(manifest.signature) != SIGNATURE_BYTES:
        return False
    try:
        public.verify(manifest.signature, canonical(manifest, manifest.signer))
    except InvalidSignature:
        return False
    return True


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys a receiver accepts versions from, by key id; empty = nothing required."""

    keys: dict[str, Ed25519PublicKey]
    source: str = ""

    @classmethod
    def none(cls) -> TrustedKeys:
        return cls({})

    @classmethod
    def load(cls, path: str | Path) -> TrustedKeys:
        """From a trust file; KeyFileError for a file that cannot be read, or a malformed,
        duplicate or empty list of keys (a trust file that trusts nothing is a mistake)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        data = _read_json(path, "trusted keys")
        entries = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise KeyFileError(
                f"trusted keys file {str(path)!r} needs {{'keys': [{{'id': ..., 'public_key': BASE64}}]}}"
            )
        keys: dict[str, Ed25519PublicKey] = {}
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("public_key"), str):
                raise KeyFileError(f"each key in {str(path)!r} needs an 'id' and a 'public_key' (BASE64)")
            key_id = _check_id(entry.get("id"), f"a key id in {str(path)!r}")
            if key_id in keys:
                raise KeyFileError(f"key id {key_id!r} appears twice in {str(path)!r}; each key needs its own id")
            keys[key_id] = Ed25519PublicKey.from_public_bytes(_raw32(entry["public_key"], path))
        return cls(keys, str(path))

    @classmethod
    def from_file(cls, path: str) -> TrustedKeys:
        """`load(path)`, or none for an empty setting."""
        return cls.load(path) if path else cls.none()

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def check(self, manifest: pb.AdapterManifest, holder: str = "replica") -> None:
        """Refuse a manifest this receiver may not take (see the module's invariants). A
        signature that is there is always well formed (INVALID_ARGUMENT otherwise), trusted or not."""
        check_format(manifest)
        if not self.keys:
            return
        what = f"adapter {manifest.name!r} v{manifest.version}"
        if not manifest.signature and not manifest.signer:
            raise FailedPrecondition(
                f"{what} is not signed, and this {holder} serves only versions signed by a trusted key "
                f"({', '.join(sorted(self.keys))}); {HOW_TO_SIGN}; nothing was applied",
                reason=Reason.UNSIGNED_ADAPTER,
            )
        public = self.keys.get(manifest.signer)
        if public is None:
            raise FailedPrecondition(
                f"{what} is signed by key {manifest.signer[:64]!r}, which this {holder} does not trust (it trusts "
                f"{', '.join(sorted(self.keys))}); sign with one of those keys, or add the key to its trusted keys file; "
                "nothing was applied",
                reason=Reason.BAD_SIGNATURE,
            )
        if not verify(manifest, public):
            raise FailedPrecondition(
                f"{what}'s signature by key {manifest.signer!r} does not match its manifest (name, version, digest, "
                "size, base model, LoRA shape or probe differ from what was signed); sign this exact manifest again; nothing "
                "was applied",
                reason=Reason.BAD_SIGNATURE,
            )


SIGNATURE_FILE = "rollwire-signature.json"
"""Beside adapter_config.json in a PEFT folder loaded over HTTP (or the upload's field of that name)."""
MAX_SIGNATURE_FILE_BYTES = 4096


@dataclass(frozen=True)
class SignatureFile:
    """A signature kept apart from a manifest: for an adapter folder loaded through the HTTP
    door, which builds the manifest itself (TRL writes none: `rollwire keys sign` does). The
    door publishes under `name` and `version` as a client's load names them; a bare name takes
    `version` from here."""

    name: str
    version: int
    signer: str
    signature: bytes

    @classmethod
    def of(cls, manifest: pb.AdapterManifest) -> SignatureFile:
        return cls(manifest.name, manifest.version, manifest.signer, manifest.signature)

    def to_json(self) -> str:
        sig = base64.b64encode(self.signature).decode()
        return json.dumps({"name": self.name, "version": self.version, "signer": self.signer, "signature": sig}) + "\n"

    @classmethod
    def parse(cls, data: bytes) -> SignatureFile:
        """From a signature file's bytes; INVALID_ARGUMENT (BAD_SIGNATURE) naming what is wrong."""
        try:
            doc = json.loads(data) if len(data) <= MAX_SIGNATURE_FILE_BYTES else {}
            name, version, signer = doc["name"], doc["version"], doc["signer"]
            signature = base64.b64decode(doc["signature"], validate=True)
            if not isinstance(name, str) or not isinstance(version, int) or not isinstance(signer, str):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            raise InvalidArgument(
                f"{SIGNATURE_FILE} must be JSON of at most {MAX_SIGNATURE_FILE_BYTES} bytes with 'name', 'version', "
                "'signer' and 'signature' (base64), as `rollwire keys sign` writes it",
                reason=Reason.BAD_SIGNATURE,
            ) from None
        return cls(name, version, signer, signature)

    def apply(self, manifest: pb.AdapterManifest) -> pb.AdapterManifest:
        """Carry the signature in `manifest` (which a receiver then verifies as it would any)."""
        manifest.signer, manifest.signature = self.signer, self.signature
        return manifest


def check_format(manifest: pb.AdapterManifest) -> None:
    """A signer and signature, when either is set: a key id and 64 bytes; INVALID_ARGUMENT
    (BAD_SIGNATURE) otherwise, so nothing unbounded is kept or reported as a signer."""
    if not manifest.signature and not manifest.signer:
        return
    if len(manifest.signature) != SIGNATURE_BYTES or not KEY_ID_RE.fullmatch(manifest.signer):
        raise InvalidArgument(
            f"adapter {manifest.name!r} v{manifest.version}'s signature must be {SIGNATURE_BYTES} bytes with a signer key "
            "id of 1-64 letters, digits, '.', '_' or '-'; sign it with rollwire.common.signing.sign",
            reason=Reason.BAD_SIGNATURE,
        )


def _check_id(key_id: object, what: str) -> str:
    if not isinstance(key_id, str) or not KEY_ID_RE.fullmatch(key_id):
        raise KeyFileError(f"{what} must be 1-64 letters, digits, '.', '_' or '-' (got {str(key_id)[:80]!r})")
    return key_id


def _read_json(path: str | Path, what: str) -> object:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise KeyFileError(f"{what} file {str(path)!r} cannot be read: {exc.strerror}") from None
    except ValueError as exc:
        raise KeyFileError(f"{what} file {str(path)!r} is not JSON: {exc}") from None


def _raw32(text: str, path: str | Path) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise KeyFileError(f"a key in {str(path)!r} is not the base64 of 32 bytes (an Ed25519 key)")
    return raw
