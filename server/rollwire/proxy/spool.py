"""The proxy's on-disk adapter spool: the source of fan-out and of every catch-up.

Invariants:
- a version is listed only once it is known good: its bytes are complete on disk and passed
  the replicas' own checks (manifest.check_manifest, the signature when trust.keys_file is set
  (common.signing; a reloaded version that fails it is quarantined), then push.checks.PayloadInspector and the
  digest while the bytes arrived: length, sha256, a bounded header, tensor names and shapes
  against the base model, dtype, finiteness); a partial upload lives under `.incoming/` and
  is removed on every exit, cancellation included;
- a commit is atomic and durable: payload fsynced in `.incoming/`, manifest written to a
  temporary file and fsynced, both renamed into place, the folder fsynced. A crash leaves at
  worst an orphan (a temporary file, a payload without manifest or the reverse), removed at
  start; every reloaded version is checked again, and one that fails is quarantined;
- per name, versions only increase and the bytes of a version never change (the same rules,
  reasons and codes as a replica, so a client cannot tell the two apart);
- at most `keep_versions` per name and `max_bytes` in all, counting the bytes of uploads in
  flight (reserved at the manifest, released on every exit); the newest version of a name
  is never evicted to make room for another name's version;
- an upload in flight is charged to its tenant from its manifest on (`in_flight`, `charge`:
  the tenant's spool quotas count it as a version it holds, so what a tenant reserves is
  within its own quota), and has a total deadline (PushLimits.upload_deadline_s) besides the idle one,
  so a trickle holds its reservation for a bounded time;
- a full disk refuses a push, never the proxy: a version the disk has no room for (its free
  space less the uploads in flight) is refused at its manifest, and a write that still fails
  for want of space (another process filled the disk) ends that push; both with
  RESOURCE_EXHAUSTED (DISK_FULL) naming the spool's folder, its partial file removed and
  every spooled version kept. Start, reload and quarantine never fail for a full disk;
- a version every replica refuses is moved to `.quarantine/` (never retried, never deleted
  silently: an operator can look at it), see fleet/catchup.py;
- a name whose last version is discarded or quarantined leaves no empty folder behind;
- the folder also keeps `.lineages.json`: what clients' names mean now, and unloads (lineages.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from rollwire.common.errors import InvalidArgument, ResourceExhausted, RollwireError, Unavailable
from rollwire.common.manifest import DEFAULT_MAX_VERSION_STEP, check_manifest, check_push_version, manifest_from_pb
from rollwire.common.reasons import Reason
from rollwire.common.signing import TrustedKeys
from rollwire.proxy.lineages import Lineages
from rollwire.push.checks import check_payload, check_tensors_async
from rollwire.push.reader import PushReader
from rollwire.runtime.durable import fsync_dir, storage_error, write_atomic
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
DEFAULT_IDLE_S = 30.0
DISK_SLACK = 64 << 10
"""Room a version needs on disk beyond its payload: its manifest, and file systems' rounding
of both files up to whole blocks."""
ROOM_FIX = ", or set spool.max_bytes below the room that disk has for the spool (older versions are evicted first)"


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
        try:
            return await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError:
            raise Unavailable(
                f"adapter {self.name!r} v{self.version} left the spool (evicted or quarantined) while being pushed",
                reason=Reason.SPOOL_CHANGED,
                retry_after_s=1.0,
            ) from None


@dataclass(eq=False)
class Upload:
    """A received upload not yet committed: its manifest, its temporary file, and the spool
    bytes reserved for it. `discard` (idempotent) removes the file and frees the bytes."""

    manifest: pb.AdapterManifest
    path: Path
    release: Callable[[], None] = field(default=lambda: None, repr=False)
    validated: bool = False

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        release, self.release = self.release, lambda: None
        release()


class Spool:
    def __init__(
        self,
        folder: Path,
        *,
        max_bytes: int,
        keep_versions: int,
        max_adapter_bytes: int,
        max_version_step: int = DEFAULT_MAX_VERSION_STEP,
        trust: TrustedKeys | None = None,
    ) -> None:
        self.folder, self.max_bytes, self.keep, self.max_adapter_bytes = (
            folder,
            max_bytes,
            keep_versions,
            max_adapter_bytes,
        )
        self.max_version_step = max_version_step
        self.trust = trust or TrustedKeys.none()
        """Keys a version must be signed by (trust.keys_file); none: a signature is carried, not required."""
        self.incoming = folder / ".incoming"
        self.quarantine_dir = folder / ".quarantine"
        self.reserved = 0
        """Bytes of uploads in flight, counted against max_bytes."""
        self._in_flight: dict[Upload, tuple[str, int, int]] = {}
        self.charge: Callable[[pb.AdapterManifest], None] | None = None
        """A push's charge to its tenant (routing.shares.check_spool_quota, set by the proxy's
        assembly), asked by `admit(charge=True)` just before the reservation, so no await lies
        between the quota's check and the bytes it counts."""
        self.quarantined: list[tuple[str, int, str]] = []
        shutil.rmtree(self.incoming, ignore_errors=True)
        try:
            self.incoming.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a full disk: the proxy serves what it spooled; admit() tries again
            log.error("spool_unwritable", folder=str(self.folder), error=str(exc))
        self._by_name: dict[str, list[SpooledAdapter]] = {}
        self.lineages = Lineages(folder)
        """What clients' adapter names mean now, and the versions unloaded (lineages.py)."""
        self._clean_orphans()
        self._reload()

    # -- reading -----------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def versions(self, name: str) -> list[SpooledAdapter]:
        """Spooled versions of `name`, oldest first."""
        return list(self._by_name.get(name, []))

    def get(self, name: str, version: int) -> SpooledAdapter | None:
        return next((a for a in self._by_name.get(name, []) if a.version == version), None)

    def holds(self, adapter: SpooledAdapter) -> bool:
        return adapter in self._by_name.get(adapter.name, [])

    def in_flight(self, prefix: str = "") -> list[tuple[str, int, int]]:
        """(name, version, bytes) of the uploads in flight now whose name starts with `prefix`."""
        return [held for held in self._in_flight.values() if held[0].startswith(prefix)]

    def total_bytes(self) -> int:
        return sum(a.size for versions in self._by_name.values() for a in versions)

    # -- receiving ---------------------------------------------------------------------
    def admit(self, m: pb.AdapterManifest, fingerprint: str | None, charge: bool = False) -> Upload:
        """Check a manifest as a replica would (and against the spool's room, and, with
        `charge`, its tenant's quotas), then reserve its bytes, counted as the tenant's until
        the upload ends; the upload's file is written by the push reader (push.reader.PushReader)."""
        self._check_manifest(m, fingerprint)
        if charge and self.charge is not None:
            self.charge(m)
        try:
            self.incoming.mkdir(exist_ok=True)  # it could not be made at start if the disk was full
        except OSError as exc:
            raise self.store_error(exc) from None
        upload = Upload(m, self.incoming / f"{uuid.uuid4().hex}.part")
        upload.release = self._reserve(upload, m)
        return upload

    async def receive(
        self,
        messages: AsyncIterator[pb.PushAdapterRequest],
        *,
        admit: Callable[[], str] | None = None,
        idle_s: float = DEFAULT_IDLE_S,
    ) -> Upload:
        """Read one whole PushAdapter stream to a temporary file, refusing what a replica
        refuses (the proxy's publication reads with the same reader, but forwards as it goes).

        `admit()` returns the base-model fingerprint pushes must match, or raises (no
        replica known yet); None skips that check. A stream silent for `idle_s` is cut off."""
        reader = PushReader(messages, idle_s, "proxy")
        upload = None
        try:
            first = await reader.open()
            upload = self.admit(first.manifest, admit() if admit is not None else None)
            async for _ in reader.chunks(store=upload.path):
                pass
            await reader.finish()
            return upload
        except BaseException:
            reader.close()
            if upload is not None:
                upload.discard()
            raise

    async def validate(self, upload: Upload, payload: bytes, base_shapes: dict[str, tuple[int, int]] | None) -> None:
        """The replicas' payload check after the incremental digest (header, tensor names and
        shapes, finiteness), off the event loop; raises InvalidArgument."""
        await check_tensors_async(manifest_from_pb(upload.manifest), payload, base_shapes)
        upload.validated = True

    def sync(self, upload: Upload) -> None:
        """Flush an upload's file to disk (blocking: run it in a thread) before `commit`."""
        try:
            fd = os.open(upload.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self.store_error(exc) from None

    def store_error(self, exc: OSError) -> RollwireError:
        """The status for a failed write into the spool: DISK_FULL naming it, or STORE_FAILED."""
        return storage_error(exc, f"the proxy's adapter spool {self.folder}", ROOM_FIX)

    def _reserve(self, upload: Upload, m: pb.AdapterManifest) -> Callable[[], None]:
        size = m.byte_length
        self.reserved += size
        self._in_flight[upload] = (m.name, m.version, size)

        def release() -> None:
            self.reserved -= size
            self._in_flight.pop(upload, None)

        return release

    def _check_manifest(self, m: pb.AdapterManifest, fingerprint: str | None) -> None:
        manifest = manifest_from_pb(m)
        check_manifest(manifest, fingerprint=None, max_bytes=self.max_adapter_bytes, holder="proxy")
        if fingerprint is not None:
            check_manifest(manifest, fingerprint=fingerprint, max_bytes=self.max_adapter_bytes, holder="proxy")
        self.trust.check(m, "proxy")  # a publication, a peer's share and an HTTP load all open here
        self.check_version(m)
        room = self.max_bytes - self.reserved - sum(v[-1].size for n, v in self._by_name.items() if n != m.name)
        if m.byte_length > room:
            busy = (
                f" ({self.reserved} bytes are reserved by uploads in flight; retry when they end)"
                if self.reserved
                else ""
            )
            raise ResourceExhausted(
                f"the proxy's adapter spool has room for {max(room, 0)} bytes but the adapter has {m.byte_length}{busy}; "
                "raise spool.max_bytes or push fewer adapter names",
                reason=Reason.SPOOL_FULL,
                retry_after_s=1.0 if self.reserved else None,
            )
        self._check_disk(m)

    def _check_disk(self, m: pb.AdapterManifest) -> None:
        """Refuse, before any byte, a version the spool's disk has no room for; uploads in
        flight count as if none of their bytes were written yet (so none can fail for another's)."""
        try:
            free = shutil.disk_usage(self.folder).free
        except OSError:
            return  # the writes will tell
        if m.byte_length + DISK_SLACK <= free - self.reserved:
            return
        busy = f", {self.reserved} of them promised to uploads in flight" if self.reserved else ""
        raise ResourceExhausted(
            f"no space left on the disk holding the proxy's adapter spool {self.folder}: it has {free} bytes free{busy}, "
            f"but adapter {m.name!r} v{m.version} needs {m.byte_length} (and {DISK_SLACK} for its manifest); nothing "
            f"was applied: free space on that disk{ROOM_FIX}, then push again",
            reason=Reason.DISK_FULL,
            retry_after_s=1.0 if self.reserved else None,
        )

    def check_version(self, m: pb.AdapterManifest) -> bool:
        """True when this exact version is spooled (an idempotent re-push); raises when the
        version may not be pushed, with the replica's codes and reasons."""
        versions = self._by_name.get(m.name, [])
        same = self.get(m.name, m.version)
        newest = versions[-1].version if versions else 0
        sha256, blake3 = (same.manifest.sha256, same.manifest.blake3) if same is not None else (None, "")
        return check_push_version(m, newest, sha256, "proxy", self.max_version_step, blake3)

    # -- committing --------------------------------------------------------------------
    def commit(self, upload: Upload) -> tuple[SpooledAdapter, bool]:
        """Make an upload visible, atomically and durably; (the spooled version, False) when
        it was already there. The upload is consumed. Callers serialise commits of one name.
        Its files are written, and the versions it evicts deleted, on the calling thread."""
        held = self._held(upload)
        if held is not None:
            return held, False
        adapter = self._adopt(upload.manifest, self._store(upload))
        self.delete(self._evicted(adapter.name))
        return adapter, True

    async def commit_async(self, upload: Upload) -> tuple[SpooledAdapter, bool, list[SpooledAdapter]]:
        """`commit` from the event loop: the payload's rename and the manifest's fsynced write
        run on a worker thread (several ms on a VM's disk, which stalled every request of the
        proxy's loop and a load's answer), the spool's maps change on the loop (where they are
        read without a lock). The versions it evicts are forgotten at once and returned, for the
        caller to `delete` off its answer's path."""
        held = self._held(upload)
        if held is not None:
            return held, False, []
        path = await asyncio.to_thread(self._store, upload)
        adapter = self._adopt(upload.manifest, path)
        return adapter, True, self._evicted(adapter.name)

    def _held(self, upload: Upload) -> SpooledAdapter | None:
        """The spooled version when this exact one is held already (the upload is then
        consumed); raises, consuming it, when the version may not be pushed."""
        m = upload.manifest
        assert m.sha256, "a sha256 left to the proxy is named by the upload's verdict, before any commit"
        try:
            if not self.check_version(m):
                return None
        except BaseException:
            upload.discard()
            raise
        upload.discard()
        held = self.get(m.name, m.version)
        assert held is not None  # check_version says it is spooled
        return held

    def _store(self, upload: Upload) -> Path:
        """The upload's payload and manifest in place, durably (fsynced, renamed, the folder
        fsynced); on a full disk nothing half-made stays. Consumes the upload."""
        m = upload.manifest
        try:
            folder = self.folder / m.name
            created_folder = not folder.exists()
            path, meta = folder / f"{m.version}.safetensors", folder / f"{m.version}.json"
            try:
                folder.mkdir(exist_ok=True)
                os.replace(upload.path, path)  # payload first: a crash here leaves an orphan payload
                write_atomic(meta, json_format.MessageToJson(m).encode())  # and fsyncs `folder`: renames are durable
                if created_folder:
                    fsync_dir(self.folder)
            except OSError as exc:  # a full disk (the manifest did not fit): undo, so nothing half-made stays
                meta.unlink(missing_ok=True)
                path.unlink(missing_ok=True)
                if created_folder:
                    with contextlib.suppress(OSError):
                        folder.rmdir()
                raise self.store_error(exc) from None
        finally:
            upload.discard()
        return path

    def _adopt(self, m: pb.AdapterManifest, path: Path) -> SpooledAdapter:
        adapter = SpooledAdapter(m, path)
        self._by_name.setdefault(m.name, []).append(adapter)
        return adapter

    def discard(self, adapter: SpooledAdapter) -> None:
        """Forget a version no replica accepted."""
        versions = self._by_name.get(adapter.name, [])
        if adapter in versions:
            versions.remove(adapter)
            self._delete(adapter)
        if not versions:
            self._forget_name(adapter.name)

    def quarantine(self, adapter: SpooledAdapter, why: str) -> bool:
        """Move a version out of the spool for good (replicas refuse it); False if it was gone."""
        versions = self._by_name.get(adapter.name, [])
        if adapter not in versions:
            return False
        versions.remove(adapter)
        self._move_to_quarantine(adapter.path.with_suffix(".json"), why)
        if not versions:
            self._forget_name(adapter.name)
        self.quarantined.append((adapter.name, adapter.version, why))
        return True

    def _forget_name(self, name: str) -> None:
        """A name with no version left: its folder goes too (only if empty: nothing is lost)."""
        self._by_name.pop(name, None)
        with contextlib.suppress(OSError):
            (self.folder / name).rmdir()

    def _move_to_quarantine(self, meta: Path, why: str) -> None:
        """Move a version's files to `.quarantine/` with a note saying why; on a disk too full
        for the note (or the folder) the files stay where they are, logged, never fatal."""
        target = self.quarantine_dir / meta.parent.name
        stem = f"{meta.stem}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        try:
            target.mkdir(parents=True, exist_ok=True)
            for src, suffix in ((meta.with_suffix(".safetensors"), ".safetensors"), (meta, ".json")):
                if src.exists():
                    os.replace(src, target / f"{stem}{suffix}")
        except OSError as exc:
            log.error("spool_quarantine_failed", file=str(meta), why=why, error=str(exc))
            return
        try:
            (target / f"{stem}.why.txt").write_text(why + "\n")
        except OSError as exc:  # the log line below says why instead
            log.warning("spool_quarantine_note_failed", file=str(meta), error=str(exc))
        log.error("spool_quarantined", file=str(meta), moved_to=str(target / stem), why=why)

    def _evicted(self, name: str) -> list[SpooledAdapter]:
        """Forget the versions past `keep` of `name`, then the oldest of any name while the
        spool holds more than `max_bytes`; the forgotten ones, whose files `delete` removes."""
        versions, gone = self._by_name[name], []
        while len(versions) > self.keep:
            gone.append(versions.pop(0))
        while self.total_bytes() > self.max_bytes:
            old = [v for vs in self._by_name.values() for v in vs[:-1]]
            if not old:
                break
            victim = min(old, key=lambda a: a.path.stat().st_mtime)
            self._by_name[victim.name].remove(victim)
            gone.append(victim)
        return gone

    def delete(self, adapters: list[SpooledAdapter]) -> None:
        """Remove the files of versions the spool no longer holds (blocking: a worker thread's job)."""
        for adapter in adapters:
            self._delete(adapter)

    def _delete(self, adapter: SpooledAdapter) -> None:
        adapter.path.with_suffix(".json").unlink(missing_ok=True)  # manifest first: a payload alone is an orphan
        adapter.path.unlink(missing_ok=True)
        log.info("spool_evicted", adapter=adapter.name, version=adapter.version)

    # -- start -------------------------------------------------------------------------
    def _clean_orphans(self) -> None:
        """Remove what an interrupted commit or delete left: temporary files, a payload
        without its manifest, a manifest without its payload."""
        for folder in self.folder.iterdir():
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            for path in folder.iterdir():
                orphan = (
                    path.name.startswith(".")
                    or (path.suffix == ".safetensors" and not path.with_suffix(".json").exists())
                    or (path.suffix == ".json" and not path.with_suffix(".safetensors").exists())
                )
                if orphan and path.is_file():
                    path.unlink(missing_ok=True)
                    log.warning("spool_orphan_removed", file=str(path))

    def _reload(self) -> None:
        """Pick up versions a previous run of the proxy spooled, each checked again in full
        (except against the base model, not known yet: replicas check that on catch-up);
        a version that fails is quarantined, never fatal."""
        for meta in sorted(self.folder.glob("*/*.json")):
            if meta.parent.name.startswith("."):
                continue
            try:
                m = json_format.Parse(meta.read_text(), pb.AdapterManifest())
                if m.name != meta.parent.name or meta.stem != str(m.version):
                    raise InvalidArgument(
                        f"manifest of {m.name!r} v{m.version} is filed as {meta}", reason=Reason.MISFILED
                    )
                check_manifest(manifest_from_pb(m), fingerprint=None, max_bytes=self.max_adapter_bytes, holder="proxy")
                self.trust.check(m, "proxy")  # spooled before trust.keys_file was set, or under another key
                path = meta.with_suffix(".safetensors")
                check_payload(manifest_from_pb(m), path.read_bytes(), None)
                if self.get(m.name, m.version) is not None:
                    raise InvalidArgument("duplicate version", reason=Reason.DUPLICATE)
            except Exception as exc:  # a damaged file must not stop the proxy
                self._move_to_quarantine(meta, f"failed its check at start: {exc}")
                self.quarantined.append((meta.parent.name, 0, str(exc)))
                continue
            self._by_name.setdefault(m.name, []).append(SpooledAdapter(m, path))
        for name, versions in list(self._by_name.items()):
            versions.sort(key=lambda a: a.version)
            self.delete(self._evicted(name))
