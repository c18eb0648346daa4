"""Adapter pushes from the SDK: reading a PEFT folder, the manifest, the request stream, results.

Invariants:
- what a server would refuse (an empty or non-safetensors payload, a bad name or version, no
  base-model fingerprint) is refused here first, before any byte leaves the process;
- the stream is the contract's own writer (rollwire.common.writer): the manifest, then chunks
  of at most MAX_CHUNK_BYTES; a push of the same version and digest is idempotent, so retrying it is safe.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollwire.client._requests import UINT64, check_adapter_name
from rollwire.common.digest import payload_blake3, payload_digests
from rollwire.common.errors import RequestError, RollwireError
from rollwire.common.errors import whole_number as _int
from rollwire.common.lora import LoraShape
from rollwire.common.probe import check_probe
from rollwire.common.safetensors_header import HeaderError, read_header
from rollwire.common.signing import SigningKey, sign
from rollwire.common.writer import MAX_CHUNK, messages
from rollwire.v1 import generator_pb2 as pb

MAX_CHUNK_BYTES = MAX_CHUNK
"""Largest payload chunk of a PushAdapter stream (the contract's limit)."""


LoraSpec = LoraShape
"""The SDK's first name for rollwire.common.lora.LoraShape, kept for existing callers."""


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT adapter folder read into memory, ready to push."""

    payload: bytes
    """adapter_model.safetensors, byte for byte."""
    lora: LoraShape
    base_model_name_or_path: str | None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()


def read_peft_dir(path: str | Path) -> PeftAdapter:
    """Read adapter_config.json and adapter_model.safetensors; refuses anything else."""
    root = Path(path)
    config_path, weights_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_path.is_file():
        raise RequestError(f"{root} has no adapter_config.json; point at a folder saved by PEFT's save_pretrained")
    if not weights_path.is_file():
        raise RequestError(f"{root} has no adapter_model.safetensors; save the adapter with safe_serialization=True")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"{config_path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise RequestError(f"{config_path} does not hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise RequestError(f"{config_path} describes a {config['peft_type']} adapter; only LoRA is served")
    payload = weights_path.read_bytes()
    try:
        read_header(payload)
    except HeaderError as exc:
        raise RequestError(f"{weights_path} is not a valid safetensors file: {exc}") from None
    return PeftAdapter(payload, LoraShape.from_peft(config), config.get("base_model_name_or_path") or None)


def build_manifest(
    name: str,
    version: int,
    payload: bytes,
    lora_config: LoraShape | Mapping[str, Any] | Any,
    base_model_fingerprint: str,
    signing_key: SigningKey | None = None,
    sha256_by_receiver: bool = False,
    probe: pb.AdapterProbe | None = None,
) -> pb.AdapterManifest:
    """The manifest message that opens a push, signed with `signing_key` when given
    (rollwire.common.signing); checks what the server would refuse anyway.
    `sha256_by_receiver`: carry the BLAKE3 alone and leave the sha256 (the version's identity)
    for the receiver to compute from the verified bytes and answer (`PushResult.sha256`), so
    the first byte goes after the BLAKE3's 0.04 s per 296 MB here instead of the sha256's 0.17;
    a signature covers the sha256, so a signed manifest always carries it.
    `probe`: the version's behavioural proof (rollwire.common.probe.build_probe: sequences and the
    logprobs the publisher's own model gives them), covered by the signature; every replica
    serves the version only if its engine agrees within its tolerance (docs/protocol.md, "Proof")."""
    if not isinstance(payload, (bytes, bytearray, memoryview)) or not len(payload):
        raise RequestError("the adapter payload must be non-empty bytes (a safetensors file)")
    if not isinstance(base_model_fingerprint, str) or not base_model_fingerprint:
        raise RequestError("base_model_fingerprint is required; take it from GetStatus or model_fingerprint()")
    if sha256_by_receiver and signing_key is not None:
        raise RequestError("a signed manifest carries its sha256: sha256_by_receiver needs no signing_key")
    sha256, b3 = ("", payload_blake3(payload)) if sha256_by_receiver else payload_digests(payload)
    manifest = pb.AdapterManifest(
        name=check_adapter_name(name),
        version=_int("version", version, 1, UINT64),
        base_model_fingerprint=base_model_fingerprint,
        lora_config=LoraShape.from_peft(lora_config).to_pb(),
        byte_length=len(payload),
        sha256=sha256,
        blake3=b3,  # what every hop verifies: twice sha256's speed (docs/protocol.md)
    )
    if probe is not None:
        try:
            check_probe(probe)
        except RollwireError as err:
            raise RequestError(err.message) from None
        manifest.probe.CopyFrom(probe)
    return sign(manifest, signing_key) if signing_key is not None else manifest


def check_chunk_size(chunk_size: int) -> int:
    return _int("chunk_size", chunk_size, 1, MAX_CHUNK_BYTES)


def push_requests(
    manifest: pb.AdapterManifest, payload: bytes, chunk_size: int = MAX_CHUNK_BYTES
) -> Iterator[pb.PushAdapterRequest]:
    """The manifest, then the payload in chunks of at most `chunk_size` bytes."""
    yield from messages(manifest, payload, check_chunk_size(chunk_size))


@dataclass(frozen=True, slots=True)
class ReplicaPush:
    """Outcome of a push on one replica behind a proxy."""

    replica: str
    code: str
    """gRPC status code name; "OK" on success."""
    message: str


@dataclass(frozen=True, slots=True)
class PushResult:
    """A confirmed push: the version is loaded and served."""

    name: str
    version: int
    already_loaded: bool
    loaded_versions: list[int]
    replicas: list[ReplicaPush]
    """Filled by a proxy; empty from a replica."""
    peers: list[PeerPush] = field(default_factory=list)
    """Filled by a proxy with peer proxies: whether each one's spool holds the version now."""
    sha256: str = ""
    """The version's sha256: the manifest's, or the receiver's when the push left it to it."""


@dataclass(frozen=True, slots=True)
class PeerPush:
    """Outcome of sharing a push with one peer proxy (a peer that is behind is named here)."""

    address: str
    code: str
    """gRPC status code name; "OK" when the peer's spool holds the version."""
    reason: str
    """PEER_BEHIND for a peer being caught up, PEER_VERSION_CONFLICT, ...; empty on success."""
    message: str


def push_result_from_pb(message: pb.PushAdapterResponse, sha256: str = "") -> PushResult:
    """The reply as a PushResult; `sha256`: the manifest's, for a receiver that does not answer one."""
    replicas = [ReplicaPush(r.replica, r.code, r.message) for r in message.replicas]
    peers = [PeerPush(p.address, p.code, p.reason, p.message) for p in message.peers]
    loaded = list(message.loaded_versions)
    digest = message.sha256 or sha256
    return PushResult(message.name, message.version, message.already_loaded, loaded, replicas, peers, digest)
