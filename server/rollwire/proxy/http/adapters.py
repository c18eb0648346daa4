"""Adapters through the HTTP door: vLLM's load/unload calls and an upload, each one push.

Invariants:
- a load publishes through FanOut.push, exactly as a gRPC PushAdapter to the proxy does:
  the manifest and bytes are checked, spooled, relayed to every replica, healed, caught up
  by late joiners and shared with peer proxies; the load answers once the version is
  durable in the spool (`http.load_answer = "spooled"`, the default: the relay and commit
  finish behind the answer, and a request naming the version waits for a replica that
  serves it) or once it is committed (`"committed"`), or with the refusal the push met;
- `lora_path` is read only inside `http.adapter_root`, after resolving symlinks and `..`;
  anything else is refused (403) before the file system is asked whether it exists; the
  folder and its files are then opened without following symlinks (a link is a 403), and
  nothing parsed out of a refused file is echoed to the caller;
- bytes are bounded before they are read: adapter_config.json by MAX_CONFIG_BYTES, the
  weights by the spool's max_adapter_bytes (file size, or the upload's length);
- a version keeps its bytes: `NAME-vN` loaded again with the same bytes is an idempotent
  success; `NAME-v1` with other bytes than the v1 of NAME's current lineage, once that
  lineage has a version, starts a new lineage (a new run: lineages.py), published under an
  internal name no replica has seen, to which NAME then maps for every caller; any other
  version with other bytes is a 409 (VERSION_CONFLICT), as within one run it is a mistake;
- an unload is durable and fleet-wide (lineages.py, in the spool, and shared with every peer
  proxy before it answers: a peer that is down is marked behind and gets it when caught up):
  the version is never served again by name or as "latest", by either door of any proxy, nor
  listed, until it is loaded again; unloading what the fleet never had is a 404. The
  replicas' windows move on by themselves as newer versions arrive, so nothing needs
  unloading there;
- a new lineage is told to peer proxies once its first version is in their spools (after
  the publication's share), so no peer routes NAME to a lineage it cannot serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import stat
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc

from rollwire.common.digest import payload_digests
from rollwire.common.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import check_name
from rollwire.common.reasons import Reason
from rollwire.common.safetensors_header import HeaderError, read_header
from rollwire.common.signing import MAX_SIGNATURE_FILE_BYTES, SIGNATURE_FILE, SignatureFile
from rollwire.common.writer import MAX_CHUNK, messages
from rollwire.proxy.core import ProxyState
from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.dialect.names import ModelRef, model_id, parse_model
from rollwire.proxy.http.edge.uploads import UploadBudget
from rollwire.proxy.lineages import Lineages
from rollwire.proxy.routing.shares import check_spool_quota
from rollwire.proxy.tenants import Scope
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
MAX_CONFIG_BYTES = 1 << 20
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
UPLOAD_SLACK = (64 << 10) + 1024
"""An upload's bytes besides its files: lora_name, the parts' headers and boundaries."""


class AdapterDoor:
    """Loads, uploads and unloads of adapters; names are mapped by the spool's lineages."""

    def __init__(self, state: ProxyState, adapter_root: str, max_adapter_bytes: int) -> None:
        self.state, self.max_bytes = state, max_adapter_bytes
        largest = max_adapter_bytes + MAX_CONFIG_BYTES + MAX_SIGNATURE_FILE_BYTES + UPLOAD_SLACK  # one upload's body
        budget = state.config.http.max_upload_bytes_in_flight or 2 * largest
        self.uploads = UploadBudget(budget, state.config.routing.retry_after_s)
        """The bytes of uploads the door holds at once (edge.uploads: in all, and per tenant)."""
        self.root = Path(adapter_root).resolve() if adapter_root else None
        self._folder_fingerprint = ""
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        """Per external name while loads of it run (then dropped: audit A16): a load picks its
        version and lineage and publishes under it."""

    @property
    def lineages(self) -> Lineages:
        return self.state.spool.lineages

    # -- vLLM's calls ---------------------------------------------------------------------
    async def load_path(self, lora_name: str, lora_path: str, rid: str) -> dict[str, Any]:
        folder = self._inside_root(lora_path)
        config, payload, signed = await asyncio.to_thread(self._read_folder, folder)
        return await self.publish(lora_name, config, payload, rid, signed)

    async def unload(self, lora_name: str, base_names: frozenset[str]) -> dict[str, Any]:
        """Unload one version, or every version of NAME's current lineage, for good (durable,
        and in every synced peer's map, each within `peering.timeout_s`, before it answers)."""
        ref = parse_model(lora_name, base_names)
        if ref.is_base:
            raise InvalidArgument("the base model cannot be unloaded", reason=Reason.BAD_ADAPTER_NAME)
        name = self.lineages.internal(ref.name)
        known = self._known(name)
        if (ref.version and ref.version not in known) or not known:
            raise HttpError(
                grpc.StatusCode.NOT_FOUND,
                f"The lora adapter '{lora_name[:256]}' cannot be found.",
                reason=Reason.ADAPTER_NOT_FOUND,
                param="lora_name",
            )
        versions = [ref.version] if ref.version else sorted(known)
        self.lineages.prune(self._holds)
        self.lineages.unload(name, versions)
        await self.lineages.flush()
        log.info("adapter_unloaded", name=ref.name, internal=name, versions=versions)
        await self._share_lineages()
        return {"object": "lora_adapter", "id": lora_name, "unloaded": [model_id(ref.name, v) for v in versions]}

    def is_hidden(self, ref: ModelRef) -> bool:
        """Was the version `ref` names unloaded (for a bare name: every version the fleet has)?"""
        name = self.lineages.internal(ref.name)
        unloaded = self.lineages.unloaded(name)
        if ref.version or not unloaded:
            return ref.version in unloaded
        known = self._known(name)
        return bool(known) and known <= unloaded

    def listed(self, name: str, version: int, scope: Scope) -> str | None:
        """The id /v1/models lists a replica's (name, version) under for `scope`: its external
        name's, or None for an earlier lineage, an unloaded version or another tenant's."""
        external = self.lineages.external(name)
        if external is None or version in self.lineages.unloaded(name):
            return None
        shown = scope.shown(external)
        return model_id(shown, version) if shown is not None else None

    def _known(self, name: str) -> set[int]:
        """Versions of internal `name` the fleet has: spooled, on a member, or answered."""
        held = {a.version for a in self.state.spool.versions(name)}
        for replica in self.state.replicas.all():
            held.update(replica.versions.get(name, ()))
        return held | {v for n, v in self.state.replicas.answered if n == name}

    def _holds(self, name: str, version: int) -> bool:
        return version in self._known(name)

    def _taken(self, name: str) -> bool:
        """Has any replica, the spool or a client used `name`?"""
        return bool(self._known(name)) or self.lineages.internal(name) != name

    @contextlib.asynccontextmanager
    async def _name_lock(self, name: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(name, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                self._locks.pop(name, None)

    # -- publishing -----------------------------------------------------------------------
    async def publish(
        self, lora_name: str, config: Any, payload: bytes, rid: str, signed: SignatureFile | None = None
    ) -> dict[str, Any]:
        """Push `payload` as the version `lora_name` names (or its name's next one; with a
        signature, the signed version) to every replica, under the name's current lineage or,
        for a new run's v1, a new one. The signature rides in the manifest and the spool
        verifies it (trust.keys_file), as for a gRPC push."""
        ref = parse_model(lora_name, frozenset())
        if signed is not None and not ref.version:
            ref = ModelRef(ref.name, signed.version)
        if self.lineages.reserved(ref.name):
            raise InvalidArgument(
                f"{ref.name!r} is the internal name of a lineage of another adapter name; load under another name",
                reason=Reason.BAD_ADAPTER_NAME,
            )
        lora = _lora_shape(config)
        try:
            read_header(payload)
        except HeaderError as exc:  # its text quotes the file's bytes: logged, never echoed (audit A11)
            log.info("adapter_header_refused", lora_name=lora_name[:256], error=str(exc)[:300])
            raise _bad_folder(
                f"{WEIGHTS_FILE} is not a valid safetensors file (its header does not parse; the proxy's log says why)"
            ) from None
        sha256, b3 = await asyncio.to_thread(payload_digests, payload)
        await self._model_folder_fingerprint()
        async with self._name_lock(ref.name):
            name = self.lineages.internal(ref.name)
            if not ref.version:
                return await self._push(ref.name, name, self._newest(name) + 1, lora, payload, sha256, rid, signed, b3)
            if ref.version > 1 or not self._restarts(name, sha256):
                return await self._push(ref.name, name, ref.version, lora, payload, sha256, rid, signed, b3)
            if signed is not None:
                raise _signed_restart(ref.name)
            internal, generation = self.lineages.next_lineage(ref.name, self._taken)
            out = await self._push(ref.name, internal, 1, lora, payload, sha256, rid, b3=b3)
            self.lineages.switch(ref.name, generation, shared=False)  # only once the new lineage's v1 is durable
            await self.lineages.flush()
            await self._share_switch(ref.name, generation, internal)
            return out | {"new_lineage": True}

    async def _share_lineages(self) -> None:
        if self.state.peers is not None:
            await self.state.peers.share_lineages()

    async def _share_switch(self, name: str, generation: int, internal: str) -> None:
        """Tell the peers `name` means lineage `generation`: at once when its v1's publication
        ended (a load answered at "committed"), else once it has (its v1 is then in their spools)."""
        peers, publication = self.state.peers, self.state.replicas.publishing.get((internal, 1))
        if peers is not None and publication is not None:
            peers.share_lineage_after(publication, name, generation)
            return
        self.lineages.release(name, generation)
        await self._share_lineages()

    def _restarts(self, name: str, sha256: str) -> bool:
        """Does a v1 with `sha256` start a new run of internal `name`? Yes once the lineage has
        a version and its v1 is not these bytes (or left the spool: the lineage moved on)."""
        if not self._newest(name):
            return False
        first = self.state.spool.get(name, 1)
        return first is None or first.manifest.sha256 != sha256

    async def _push(
        self,
        external: str,
        name: str,
        version: int,
        lora: LoraShape,
        payload: bytes,
        sha256: str,
        rid: str,
        signed: SignatureFile | None = None,
        b3: str = "",
    ) -> dict[str, Any]:
        """`b3`: the payload's BLAKE3, carried beside its sha256 unless the upload is signed."""
        fingerprint, _ = self.state.replicas.push_basis(self._fleet_model())
        manifest = pb.AdapterManifest(
            name=check_name(name),
            version=version,
            base_model_fingerprint=fingerprint,
            lora_config=lora.to_pb(),
            byte_length=len(payload),
            sha256=sha256,
            blake3="" if signed is not None else b3,  # a signature file covers no BLAKE3 (docs/protocol.md, Digests)
        )
        if signed is not None:
            signed.apply(manifest)
        check_spool_quota(
            self.state.dispatcher.shares, self.state.spool, self.state.config.spool.keep_versions, manifest
        )
        fanout, answer = self.state.fanout, self.state.config.http.load_answer
        earlier = fanout.failed_after_answer.pop(name, "")
        reply = await fanout.push(_aiter(messages(manifest, payload, MAX_CHUNK)), rid, answer=answer)
        if self.lineages.show(name, version):
            await self.lineages.flush()
            await self._share_lineages()
        out = {
            "object": "lora_adapter",
            "id": model_id(external, version),
            "name": external,
            "lineage": name,
            "version": version,
            "sha256": sha256,
            "signer": manifest.signer,
            "state": "committed" if reply.replicas else "spooled",
            "already_loaded": reply.already_loaded,
            "replicas": [{"replica": r.replica, "code": r.code, "message": r.message} for r in reply.replicas],
        }
        return out | ({"earlier_failure": earlier} if earlier else {})

    async def _model_folder_fingerprint(self) -> str:
        """The fingerprint of `http.model_path`, the base model's folder the operator gave the
        door (computed once, off the event loop); empty without one."""
        folder = self.state.config.http.model_path
        if folder and not self._folder_fingerprint:
            self._folder_fingerprint = await asyncio.to_thread(model_fingerprint, folder)
        return self._folder_fingerprint

    def _fleet_model(self) -> str:
        """The base model a PEFT folder (which names none we can trust) is pushed for: the
        fleet's own (fleet/basemodel.py: declared, or agreed by the spool), else the one of the model
        folder the operator gave the door (http.model_path); never one a member reports."""
        fingerprint = self.state.replicas.base.fingerprint or self._folder_fingerprint
        if fingerprint:
            return fingerprint
        raise FailedPrecondition(
            "this proxy does not know its fleet's base model yet (nothing declared, nothing spooled), and never takes "
            "it from a replica; set base_model in the proxy's config to the fingerprint the replicas serve "
            "(`rollwire status` shows it) or http.model_path to the base model's folder, or push a first version over "
            "gRPC; nothing was applied",
            reason=Reason.BASE_MODEL_UNKNOWN,
        )

    def _newest(self, name: str) -> int:
        spooled = max((a.version for a in self.state.spool.versions(name)), default=0)
        return max(spooled, self.state.replicas.latest(name))

    # -- reading adapter folders ------------------------------------------------------------
    def _inside_root(self, lora_path: str) -> Path:
        """The folder, resolved, when it lies inside the adapter root; 403 otherwise."""
        if self.root is None:
            raise PermissionDenied(
                "this proxy loads no adapter by path (http.adapter_root is not set): upload the folder's files to "
                "POST /v1/upload_lora_adapter instead",
                reason=Reason.PATH_OUTSIDE_ROOT,
            )
        try:
            folder = Path(lora_path).resolve()
        except (OSError, RuntimeError, ValueError):
            folder = None
        if folder is None or not folder.is_relative_to(self.root):
            raise PermissionDenied(
                f"lora_path {lora_path[:200]!r} is outside the folder this proxy reads adapters from; save adapters "
                "under http.adapter_root, or upload them to POST /v1/upload_lora_adapter",
                reason=Reason.PATH_OUTSIDE_ROOT,
            )
        return folder

    def _read_folder(self, folder: Path) -> tuple[Any, bytes, SignatureFile | None]:
        """adapter_config.json (parsed) and the weights' bytes, each bounded before it is read;
        the folder and each file opened without following a symlink (audit A11)."""
        try:
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            raise _bad_folder(f"{folder} is not a folder; point lora_path at a folder saved by PEFT") from None
        try:
            self._check_opened(dir_fd, folder)
            config = _parse_config(_read_bounded(dir_fd, folder, CONFIG_FILE, MAX_CONFIG_BYTES))
            payload = _read_bounded(dir_fd, folder, WEIGHTS_FILE, self.max_bytes)
            signature = _read_optional(dir_fd, folder, SIGNATURE_FILE, MAX_SIGNATURE_FILE_BYTES)
            return config, payload, SignatureFile.parse(signature) if signature is not None else None
        finally:
            os.close(dir_fd)

    def _check_opened(self, dir_fd: int, folder: Path) -> None:
        """The folder opened is still inside the root (it was not swapped after resolving)."""
        try:
            opened = Path(os.readlink(f"/proc/self/fd/{dir_fd}"))
        except OSError:
            return  # no /proc: the resolved path and O_NOFOLLOW are the check
        if self.root is not None and not opened.is_relative_to(self.root):
            raise PermissionDenied(
                f"{folder} moved outside the folder this proxy reads adapters from", reason=Reason.PATH_OUTSIDE_ROOT
            )

    async def read_upload(self, parts: Iterable[tuple[str, bytes]]) -> tuple[Any, bytes, SignatureFile | None]:
        """The two files of an upload (by field name), and its signature file if sent, checked like a folder's."""
        files = dict(parts)
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if f not in files]
        if missing:
            raise _bad_folder(f"the upload lacks {', '.join(missing)}; send both files of the adapter folder")
        if len(files[CONFIG_FILE]) > MAX_CONFIG_BYTES:
            raise _bad_folder(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
        signed = SignatureFile.parse(files[SIGNATURE_FILE]) if SIGNATURE_FILE in files else None
        return _parse_config(files[CONFIG_FILE]), files[WEIGHTS_FILE], signed


def _read_optional(dir_fd: int, folder: Path, name: str, limit: int) -> bytes | None:
    """`_read_bounded`, or None when the folder has no `name` (not even a link of that name)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return _read_bounded(dir_fd, folder, name, limit)


def _read_bounded(dir_fd: int, folder: Path, name: str, limit: int) -> bytes:
    """`name` in the folder `dir_fd`, a regular file and no symlink, at most `limit` bytes."""
    try:  # O_NONBLOCK: a FIFO planted under the name does not block the open
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _bad_folder(f"{folder} has no {name}; point lora_path at a folder saved by PEFT") from None
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else "unreadable"
        raise PermissionDenied(
            f"{folder}/{name} is {why}; adapter files under http.adapter_root must be regular files, not links",
            reason=Reason.PATH_OUTSIDE_ROOT,
        ) from None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _bad_folder(f"{folder}/{name} is not a regular file")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{name} is larger than this proxy takes ({limit} bytes)",
            reason=Reason.BODY_TOO_LARGE,
        )
    return data


def _parse_config(data: bytes) -> Any:
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad_folder(f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _bad_folder(f"{CONFIG_FILE} does not hold a JSON object")
    return config


def _lora_shape(config: dict[str, Any]) -> LoraShape:
    if config.get("peft_type", "LORA") != "LORA":
        raise _bad_folder(f"the adapter is a {str(config.get('peft_type'))[:40]} adapter; only LoRA is served")
    try:
        return LoraShape.from_peft(config)
    except InvalidArgument as exc:
        raise _bad_folder(f"{CONFIG_FILE}: {exc.message}") from None


def _signed_restart(name: str) -> FailedPrecondition:
    """A signed v1 with other bytes than NAME's v1 would start a new lineage, published under an
    internal name the signature does not name (docs/security.md)."""
    return FailedPrecondition(
        f"{name}-v1 with other bytes than the v1 {name!r} already has would start a new lineage under another "
        f"internal name, which its signature does not name; load the new run under a new name, signed for it",
        reason=Reason.BAD_SIGNATURE,
    )


def _bad_folder(message: str) -> HttpError:
    return HttpError(grpc.StatusCode.INVALID_ARGUMENT, message, reason=Reason.BAD_ADAPTER_FOLDER)


async def _aiter(items: Iterable[pb.PushAdapterRequest]) -> AsyncIterator[pb.PushAdapterRequest]:
    for item in items:
        yield item
