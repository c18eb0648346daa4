"""Adapter names and push manifests: the rules every sender and receiver of a push shares.

The SDK checks a name before it dials; the proxy and every replica refuse a manifest with
the same codes, reasons and sentences (`check_manifest`, `check_push_version`). Needs no
torch and no server code: it is part of the client-facing contract (with
`rollwire.common.writer`); the receiving side lives in `rollwire.push`.

Invariants:
- one adapter-name rule (`NAME_RE`, always fullmatch) for the SDK, the proxy and the replica;
  a server also holds tenant-qualified names, `TENANT:NAME` (`QUALIFIED_RE`: both parts by
  NAME_RE), which the proxy makes of a tenant's names (rollwire.proxy.tenants): ':' is in no
  name a client gives, so no tenant's name can spell another tenant's;
- versions are 1 to 2**53 (`MAX_VERSION`: exact in JSON and in a double) and at most
  `max_step` above the newest a holder accepted, so no push can use up a name's range;
- versions are immutable: a held version re-pushed with its digest is an idempotent success,
  with another digest it is refused; below or at the newest it is refused;
- a digest on the wire is exactly 64 lowercase hex digits;
- an unsigned manifest with a BLAKE3 may leave its sha256 empty, for its receiver to name from
  the verified bytes (`identity`: such a version is known by its BLAKE3 until then), so a
  pusher need not hash the whole payload twice before its first byte (docs/protocol.md, "Digests").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from rollwire.common.errors import FailedPrecondition, InvalidArgument, RequestError, ResourceExhausted, clip
from rollwire.common.lora import MAX_PATTERNS, LoraShape, check_pattern
from rollwire.common.probe import check_probe
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""Adapter names: always used with fullmatch (a `$` would let a final newline through)."""
NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
TENANT_SEPARATOR = ":"
"""Between a tenant's name and its adapter's in a qualified name (`team-a:trl-policy`); NAME_RE forbids it."""
QUALIFIED_RE = re.compile(rf"(?:{NAME_RE.pattern}{TENANT_SEPARATOR})?{NAME_RE.pattern}")
"""The names servers hold (replicas, the proxy's spool and lineages): a name, or TENANT:NAME."""
MAX_VERSION = 1 << 53
"""Largest adapter version: exact in JSON and in a double, so every tool reads it right."""
DEFAULT_MAX_VERSION_STEP = 1_000_000
"""A version may be at most newest + this (newest = 0 for a new name), so no single push can
use up a name's version range; pushing 2**53 takes 9e9 pushes."""
MAX_LORA_R = 4096
MAX_TARGET_MODULES = 256
MAX_TARGET_MODULE_CHARS = 256
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def name_ok(name: object) -> bool:
    """A name a server may hold: NAME, or TENANT:NAME as the proxy qualifies a tenant's (QUALIFIED_RE)."""
    return isinstance(name, str) and QUALIFIED_RE.fullmatch(name) is not None


def check_name(name: object) -> str:
    """The adapter name, or INVALID_ARGUMENT (reason BAD_ADAPTER_NAME) with the rule."""
    if not name_ok(name):
        raise InvalidArgument(
            f"adapter name {clip(str(name))} is invalid: use {NAME_RULE}", reason=Reason.BAD_ADAPTER_NAME
        )
    return name  # type: ignore[return-value]


@dataclass(frozen=True)
class Manifest:
    """What a push declares before its bytes arrive."""

    name: str
    version: int
    base_model_fingerprint: str
    lora: LoraShape
    byte_length: int
    sha256: str
    signer: str = ""
    """The key id that signed it (rollwire.common.signing); empty when unsigned."""
    blake3: str = ""
    """The payload's BLAKE3 beside its sha256 (empty: none); every hop verifies it when set."""
    probe: pb.AdapterProbe | None = field(default=None, compare=False, repr=False)
    """The version's behavioural proof (rollwire.common.probe); None: the publisher sent none."""


def identity(m: Manifest | pb.AdapterManifest) -> str:
    """What names a version's bytes: its sha256, or "blake3:" + its BLAKE3 while its sha256 is
    left to its receiver (a relay's stage of such a manifest, until the commit names it)."""
    return m.sha256 or f"blake3:{m.blake3}"


def manifest_from_pb(m: pb.AdapterManifest) -> Manifest:
    """The wire AdapterManifest as a Manifest (the digest as sent: only lowercase hex is valid)."""
    return Manifest(
        m.name,
        m.version,
        m.base_model_fingerprint,
        LoraShape.from_pb(m.lora_config),
        m.byte_length,
        m.sha256,
        m.signer if m.signature else "",
        m.blake3,
        m.probe if m.HasField("probe") else None,
    )


def check_patterns(lora: LoraShape) -> None:
    """A manifest's rank_pattern and alpha_pattern: at most MAX_PATTERNS keys each, of the form
    rollwire matches (`lora.check_pattern`), whole ranks in 1..MAX_LORA_R, finite alphas > 0."""
    for name, patterns in (("rank_pattern", lora.rank_pattern), ("alpha_pattern", lora.alpha_pattern)):
        if len(patterns) > MAX_PATTERNS:
            raise InvalidArgument(
                f"lora_config.{name} has {len(patterns)} entries; at most {MAX_PATTERNS}", reason=Reason.BAD_LORA_CONFIG
            )
        for key, value in patterns:
            try:
                check_pattern(key)
            except RequestError as exc:
                raise InvalidArgument(f"lora_config.{name}: {exc.message}", reason=Reason.BAD_LORA_CONFIG) from None
            bad_rank = name == "rank_pattern" and not (value == int(value) and 1 <= value <= MAX_LORA_R)
            if bad_rank or not (math.isfinite(value) and value > 0):
                raise InvalidArgument(
                    f"lora_config.{name}[{key[:80]!r}] is {value}; a rank must be a whole number in 1..{MAX_LORA_R}, "
                    "an alpha finite and > 0",
                    reason=Reason.BAD_LORA_CONFIG,
                )


def check_manifest(m: Manifest, *, fingerprint: str | None, max_bytes: int, holder: str = "replica") -> None:
    """Refuse a manifest before any byte is read; each failure has its own sentence.
    `fingerprint=None` skips the base-model check (a spool reload, before any replica is known)."""
    check_name(m.name)
    check_version_number(m.version)
    if fingerprint is not None and m.base_model_fingerprint != fingerprint:
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} was trained on base model {m.base_model_fingerprint[:80] or '(none given)'}, "
            f"but the base model served here is {fingerprint}; push an adapter of this base model",
            reason=Reason.BASE_MODEL_MISMATCH,
        )
    lora = m.lora
    modules = lora.target_modules
    if (
        not 1 <= lora.r <= MAX_LORA_R
        or not math.isfinite(lora.lora_alpha)
        or not lora.lora_alpha > 0
        or not 1 <= len(modules) <= MAX_TARGET_MODULES
        or not all(1 <= len(t) <= MAX_TARGET_MODULE_CHARS for t in modules)
    ):
        raise InvalidArgument(
            f"lora_config needs 1 <= r <= {MAX_LORA_R}, a finite lora_alpha > 0 and 1 to {MAX_TARGET_MODULES} target "
            f"modules of 1 to {MAX_TARGET_MODULE_CHARS} characters (got r={lora.r}, lora_alpha={lora.lora_alpha}, "
            f"{len(modules)} target modules)",
            reason=Reason.BAD_LORA_CONFIG,
        )
    check_patterns(lora)
    if m.blake3 and not _DIGEST_RE.fullmatch(m.blake3):
        raise InvalidArgument(
            "blake3 must be empty or the 64 lowercase hex digits of the payload's BLAKE3", reason=Reason.BAD_DIGEST
        )
    if m.sha256 or not m.blake3:
        check_digest(m.sha256)
    elif m.signer:
        raise InvalidArgument(
            "a signed manifest must carry its sha256 (the signature covers it): compute it before signing",
            reason=Reason.BAD_DIGEST,
        )
    if m.probe is not None:
        check_probe(m.probe)
    if m.byte_length < 1:
        raise InvalidArgument("byte_length must be > 0", reason=Reason.BAD_LENGTH)
    if m.byte_length > max_bytes:
        raise ResourceExhausted(
            f"adapter of {m.byte_length} bytes exceeds this {holder}'s limit of {max_bytes} bytes",
            reason=Reason.ADAPTER_TOO_LARGE,
        )


def check_push_version(
    m,
    newest: int,
    held_sha256: str | None,
    holder: str,
    max_step: int = DEFAULT_MAX_VERSION_STEP,
    held_blake3: str = "",
) -> bool:
    """The version rule shared by replicas and the proxy's spool: True when this exact
    version is already held (an idempotent re-push); raises when it may not be pushed.
    `m` is a Manifest or the wire AdapterManifest: only name, version and the digests are read.
    A manifest that left its sha256 to its receiver is the held version when its BLAKE3 is the
    held one's (`held_blake3`; a version held without one cannot be shown equal: refused).
    A version above 2**53 or more than `max_step` above the newest (0 for a new name) is
    refused, so no push can use up the range of a name."""
    if m.version > MAX_VERSION or m.version > newest + max_step:
        raise InvalidArgument(
            f"adapter {m.name!r} v{m.version} is too far ahead: a version may be at most {max_step} above the newest "
            f"(v{newest} on this {holder}) and at most 2**53; push v{newest + 1}",
            reason=Reason.VERSION_TOO_FAR,
        )
    if held_sha256 is not None:
        if (held_sha256 == m.sha256) if m.sha256 else (bool(held_blake3) and held_blake3 == m.blake3):
            return True
        unknown = "" if m.sha256 or held_blake3 else " (it is held without a BLAKE3: name the sha256 to re-push it)"
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} is already loaded with a different digest{unknown}; "
            f"versions are immutable, push it as v{newest + 1}",
            reason=Reason.VERSION_CONFLICT,
        )
    if m.version <= newest:
        raise FailedPrecondition(
            f"adapter {m.name!r} v{m.version} is not above the newest version v{newest} this {holder} has "
            f"accepted; versions only increase, push v{newest + 1} or higher",
            reason=Reason.VERSION_NOT_MONOTONIC,
        )
    return False


def check_commit(name: str, version: int, sha256: str, blake3: str = "") -> None:
    """The fields of a CommitAdapterRequest; INVALID_ARGUMENT with a sentence."""
    check_name(name)
    check_version_number(version)
    check_digest(sha256, "of the staged payload")
    if blake3 and not _DIGEST_RE.fullmatch(blake3):
        raise InvalidArgument(
            "blake3 must be empty or the 64 lowercase hex digits of the staged payload's BLAKE3",
            reason=Reason.BAD_DIGEST,
        )


def check_version_number(version: int) -> None:
    """The one range rule of versions, for manifests and commits: 1 to MAX_VERSION (2**53);
    INVALID_ARGUMENT with the reason a client acts on otherwise."""
    if version < 1:
        raise InvalidArgument(f"adapter version must be >= 1 (got {version})", reason=Reason.BAD_ADAPTER_VERSION)
    if version > MAX_VERSION:
        raise InvalidArgument(
            f"adapter version {version} is above the largest version, 2**53 ({MAX_VERSION})",
            reason=Reason.VERSION_TOO_FAR,
        )


def check_digest(sha256: str, of: str = "of the payload") -> None:
    """A sha256 as sent on the wire: exactly 64 lowercase hex digits; INVALID_ARGUMENT otherwise."""
    if not _DIGEST_RE.fullmatch(sha256):
        raise InvalidArgument(f"sha256 must be the 64 lowercase hex digits {of}", reason=Reason.BAD_DIGEST)
