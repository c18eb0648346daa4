"""Sample receipts: a replica's signed word for what it sampled (audit S11: provenance).

Score gives any caller exact logprobs for any tokens, so a trajectory's behaviour logprobs can
be checked for plausibility (ingest.max_logprob_gap) but not for provenance: a producer could
submit tokens no policy sampled, with their true logprobs. A receipt closes that: the replica
that sampled a sample signs, with its own Ed25519 key, digests of the ids it was conditioned on
(the prompt, a session's history, the caller's resumed prefix), of the ids it sampled, of their
logprobs and of their versions, with the adapter's name and a sample id unique to it. A learner
that trusts the replicas' public keys (ingest.receipt_keys_file) takes a trained token only
where a receipt covers it and every digest matches the trajectory.

What is signed is `canonical(receipt)`: the fixed prefix `DOMAIN`, then signer, adapter, the
four digests, the token count, the sample id and the time issued, each length-prefixed (ints as
8-byte big-endian), in that order.

Invariants:
- a receipt verifies for exactly one (context, tokens, logprobs, versions, adapter, sample,
  signer): changing any of them fails `verify`; the prefix keeps it from being valid as anything
  else signed with the key (a manifest signature uses another prefix);
- digests are over fixed encodings (ids int32 LE, logprobs float32 LE — the wire's own float —
  versions uint64 LE), so the learner recomputes them from the Trajectory it was sent;
- `SampleDigest` hashes incrementally: a replica keeps 3 hash states per running sample, never
  its tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rollwire.v1 import generator_pb2 as pb

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from rollwire.common.signing import SigningKey

DOMAIN = b"rollwire-sample-receipt-v1\0"
DIGEST_BYTES = 32
SIGNATURE_BYTES = 64


def ids_digest(ids: Iterable[int]) -> bytes:
    ids = list(ids)
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).digest()


class SampleDigest:
    """The running digests of one sample's sampled ids, logprobs and versions."""

    def __init__(self) -> None:
        self._ids, self._logprobs, self._versions = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
        self.tokens = 0

    def add(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        n = len(ids)
        self._ids.update(struct.pack(f"<{n}i", *ids))
        self._logprobs.update(struct.pack(f"<{n}f", *logprobs))
        self._versions.update(struct.pack(f"<{n}Q", *versions))
        self.tokens += n

    def digests(self) -> tuple[bytes, bytes, bytes]:
        return self._ids.digest(), self._logprobs.digest(), self._versions.digest()


def _field(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def canonical(r: pb.SampleReceipt) -> bytes:
    parts = [
        r.signer.encode(),
        r.adapter.encode(),
        r.context_sha256,
        r.tokens_sha256,
        r.logprobs_sha256,
        r.versions_sha256,
        struct.pack(">Q", r.tokens),
        r.sample_id.encode(),
        struct.pack(">Q", r.issued_unix_ms),
    ]
    return DOMAIN + b"".join(_field(p) for p in parts)


def sign(r: pb.SampleReceipt, key: SigningKey) -> pb.SampleReceipt:
    """Set the receipt's signer and signature (in place, and returned) for its current fields."""
    r.signer = key.key_id
    r.signature = key.private.sign(canonical(r))
    return r


def verify(r: pb.SampleReceipt, keys: dict[str, Ed25519PublicKey]) -> bool:
    """Does the receipt's signature verify under the trusted key its signer names?"""
    from cryptography.exceptions import InvalidSignature

    public = keys.get(r.signer)
    if public is None or len(r.signature) != SIGNATURE_BYTES:
        return False
    try:
        public.verify(r.signature, canonical(r))
    except InvalidSignature:
        return False
    return True


def covers(
    r: pb.SampleReceipt,
    context: Sequence[int],
    ids: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    context_digest: bytes | None = None,
) -> str | None:
    """Why the receipt does not describe these tokens sampled after `context`, or None if it does
    (`context_digest`: ids_digest(context), when the caller keeps a running one)."""
    if r.tokens != len(ids):
        return f"it covers {r.tokens} tokens, not {len(ids)}"
    if r.context_sha256 != (context_digest if context_digest is not None else ids_digest(context)):
        return "the tokens before them are not those the replica was given"
    digest = SampleDigest()
    digest.add(ids, logprobs, versions)
    got = digest.digests()
    for what, want, have in zip(
        ("ids", "logprobs", "versions"), (r.tokens_sha256, r.logprobs_sha256, r.versions_sha256), got, strict=True
    ):
        if want != have:
            return f"their {what} are not those the replica sampled"
    return None
