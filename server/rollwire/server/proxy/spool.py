"""The proxy's on-disk adapter spool: the source of fan-out and of every catch-up.

Invariants:
- a version is listed only once its bytes are complete on disk and match the manifest's
  length and sha256; a partial upload lives under `.incoming/` and is removed on every exit;
- per name, versions only increase and the bytes of a version never change (the same rules,
  reasons and codes as a replica, so a client cannot tell the two apart);
- at most `keep_versions` per name and `max_bytes` in all; the newest version of a name is
  never evicted to make room for another name's version.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from rollwire.common.errors import InvalidArgument, ResourceExhausted
from rollwire.common.logs import get_logger
from rollwire.server.adapters import NAME_RE, check_push_version
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
MAX_CHUNK = 1 << 20


@dataclass(frozen=True)
class SpooledAdapter:
    """One complete, checked version on disk."""

    manifest: pb.AdapterManifest
    path: Path

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def size(self) -> int:
        return self.manifest.byte_length

    async def payload(self) -> bytes:
        return await asyncio.to_thread(self.path.read_bytes)


@dataclass
class Upload:
    """A received upload not yet committed: its manifest and its temporary file."""

    manifest: pb.AdapterManifest
    path: Path

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


class Spool:
    def __init__(self, folder: Path, *, max_bytes: int, keep_versions: int, max_adapter_bytes: int) -> None:
        self.folder, self.max_bytes, self.keep, self.max_adapter_bytes = folder, max_bytes, keep_versions, max_adapter_bytes
        self.incoming = folder / ".incoming"
        shutil.rmtree(self.incoming, ignore_errors=True)
        self.incoming.mkdir(parents=True, exist_ok=True)
        self._by_name: dict[str, list[SpooledAdapter]] = {}
        self._reload()

    # -- reading -----------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def versions(self, name: str) -> list[SpooledAdapter]:
        """Spooled versions of `name`, oldest first."""
        return list(self._by_name.get(name, []))

    def get(self, name: str, version: int) -> SpooledAdapter | None:
        return next((a for a in self._by_name.get(name, []) if a.version == version), None)

    def total_bytes(self) -> int:
        return sum(a.size for versions in self._by_name.values() for a in versions)

    # -- receiving ---------------------------------------------------------------------
    async def receive(self, messages: AsyncIterator[pb.PushAdapterRequest]) -> Upload:
        """Read one PushAdapter stream to a temporary file, refusing what a replica refuses."""
        manifest, path, received = None, None, 0
        digest = hashlib.sha256()
        out = None
        try:
            async for msg in messages:
                part = msg.WhichOneof("part")
                if manifest is None:
                    if part != "manifest":
                        raise InvalidArgument("the first PushAdapter message must be the manifest", reason="NO_MANIFEST")
                    manifest = msg.manifest
                    self._check_manifest(manifest)
                    path = self.incoming / f"{uuid.uuid4().hex}.part"
                    out = path.open("wb")
                    continue
                if part != "chunk":
                    raise InvalidArgument("only the first PushAdapter message may be a manifest", reason="SECOND_MANIFEST")
                if len(msg.chunk) > MAX_CHUNK:
                    raise InvalidArgument(
                        f"a chunk of {len(msg.chunk)} bytes exceeds the 1 MiB ({MAX_CHUNK} bytes) chunk limit; "
                        "split the payload into smaller chunks",
                        reason="CHUNK_TOO_LARGE",
                    )
                received += len(msg.chunk)
                if received > manifest.byte_length:
                    raise InvalidArgument(
                        f"received more than the {manifest.byte_length} bytes the manifest declared", reason="LENGTH_MISMATCH"
                    )
                digest.update(msg.chunk)
                out.write(msg.chunk)
            if manifest is None:
                raise InvalidArgument("the upload was empty: send a manifest, then the chunks", reason="NO_MANIFEST")
            out.close()
            _check_payload(manifest, received, digest.hexdigest())
            return Upload(manifest, path)
        except BaseException:
            if out is not None:
                out.close()
                path.unlink(missing_ok=True)
            raise

    def _check_manifest(self, m: pb.AdapterManifest) -> None:
        if not NAME_RE.match(m.name):
            raise InvalidArgument(
                f"adapter name {m.name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
                reason="BAD_ADAPTER_NAME",
            )
        if m.version < 1:
            raise InvalidArgument("adapter version must be >= 1", reason="BAD_ADAPTER_VERSION")
        if len(m.sha256) != 64 or any(c not in "0123456789abcdef" for c in m.sha256):
            raise InvalidArgument("sha256 must be 64 lowercase hex digits", reason="BAD_DIGEST")
        if m.byte_length < 1:
            raise InvalidArgument("byte_length must be > 0", reason="BAD_LENGTH")
        if m.byte_length > self.max_adapter_bytes:
            raise ResourceExhausted(
                f"adapter of {m.byte_length} bytes exceeds this proxy's limit of {self.max_adapter_bytes} bytes",
                reason="ADAPTER_TOO_LARGE",
            )
        self.check_version(m)
        room = self.max_bytes - sum(v[-1].size for n, v in self._by_name.items() if n != m.name)
        if m.byte_length > room:
            raise ResourceExhausted(
                f"the proxy's adapter spool has room for {max(room, 0)} bytes but the adapter has {m.byte_length}; "
                "raise spool.max_bytes or push fewer adapter names",
                reason="SPOOL_FULL",
            )

    def check_version(self, m: pb.AdapterManifest) -> bool:
        """True when this exact version is spooled (an idempotent re-push); raises when the
        version may not be pushed, with the replica's codes and reasons."""
        versions = self._by_name.get(m.name, [])
        same = self.get(m.name, m.version)
        newest = versions[-1].version if versions else 0
        return check_push_version(m, newest, same.manifest.sha256 if same else None, "proxy")

    # -- committing --------------------------------------------------------------------
    def commit(self, upload: Upload) -> tuple[SpooledAdapter, bool]:
        """Make an upload visible; (the spooled version, False) when it was already there.
        Callers serialise commits of one name."""
        m = upload.manifest
        if self.check_version(m):
            upload.discard()
            return self.get(m.name, m.version), False
        folder = self.folder / m.name
        folder.mkdir(exist_ok=True)
        path = folder / f"{m.version}.safetensors"
        upload.path.replace(path)
        (folder / f"{m.version}.json").write_text(json_format.MessageToJson(m))
        adapter = SpooledAdapter(m, path)
        self._by_name.setdefault(m.name, []).append(adapter)
        self._evict(m.name)
        return adapter, True

    def discard(self, adapter: SpooledAdapter) -> None:
        """Forget a version no replica accepted."""
        versions = self._by_name.get(adapter.name, [])
        if adapter in versions:
            versions.remove(adapter)
            self._delete(adapter)
        if not versions:
            self._by_name.pop(adapter.name, None)

    def _evict(self, name: str) -> None:
        versions = self._by_name[name]
        while len(versions) > self.keep:
            self._delete(versions.pop(0))
        while self.total_bytes() > self.max_bytes:
            old = [v for vs in self._by_name.values() for v in vs[:-1]]
            if not old:
                break
            victim = min(old, key=lambda a: a.path.stat().st_mtime)
            self._by_name[victim.name].remove(victim)
            self._delete(victim)

    def _delete(self, adapter: SpooledAdapter) -> None:
        adapter.path.unlink(missing_ok=True)
        adapter.path.with_suffix(".json").unlink(missing_ok=True)
        log.info("spool_evicted", adapter=adapter.name, version=adapter.version)

    def _reload(self) -> None:
        """Pick up versions a previous run of the proxy spooled; skip damaged ones."""
        for meta in sorted(self.folder.glob("*/*.json")):
            try:
                m = json_format.Parse(meta.read_text(), pb.AdapterManifest())
                path = meta.with_suffix(".safetensors")
                _check_payload(m, path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
            except Exception as exc:  # a damaged file must not stop the proxy
                log.warning("spool_skipped", file=str(meta), error=str(exc))
                continue
            self._by_name.setdefault(m.name, []).append(SpooledAdapter(m, path))
        for name, versions in self._by_name.items():
            versions.sort(key=lambda a: a.version)
            self._evict(name)


def _check_payload(m: pb.AdapterManifest, received: int, digest: str) -> None:
    if received != m.byte_length:
        raise InvalidArgument(
            f"upload ended after {received} of the {m.byte_length} bytes the manifest declared; "
            "the upload was truncated or the manifest is wrong",
            reason="LENGTH_MISMATCH",
        )
    if digest != m.sha256:
        raise InvalidArgument(
            f"payload sha256 is {digest} but the manifest declared {m.sha256}; the bytes were corrupted or the manifest is stale",
            reason="DIGEST_MISMATCH",
        )
