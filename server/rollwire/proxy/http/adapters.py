"""Adapters through the HTTP door, in vLLM's words: a load's `lora_name` (NAME-vN) and its
files (a folder under the adapter root, or an upload), read and checked here, then published
by the core's `load` verb (core.py, publish/loads.py: the load and lineage rules both doors
use); an unload's name, for the core's `unload`; their answers in vLLM's shape.

Invariants:
- `lora_path` is read only inside `http.adapter_root`, after resolving symlinks and `..`;
  anything else is refused (403) before the file system is asked whether it exists; the
  folder and its files are then opened without following symlinks (a link is a 403), and
  nothing parsed out of a refused file is echoed to the caller;
- bytes are bounded before they are read: adapter_config.json by MAX_CONFIG_BYTES, the
  weights by the spool's max_adapter_bytes (file size, or the upload's length);
- no caller loads under the base model's id (a tenant would write the shared namespace with
  it, audit S7), nor unloads the base model: INVALID_ARGUMENT BAD_ADAPTER_NAME.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from rollwire.common.errors import InvalidArgument, PermissionDenied
from rollwire.common.lora import LoraShape
from rollwire.common.reasons import Reason
from rollwire.common.signing import MAX_SIGNATURE_FILE_BYTES, SIGNATURE_FILE, SignatureFile
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.dialect.names import ModelRef, model_id, parse_model
from rollwire.proxy.http.edge.uploads import UploadBudget
from rollwire.runtime.logs import get_logger

if TYPE_CHECKING:
    from rollwire.proxy.core import Loaded

log = get_logger(__name__)
MAX_CONFIG_BYTES = 1 << 20
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
UPLOAD_SLACK = (64 << 10) + 1024
"""An upload's bytes besides its files: lora_name, the parts' headers and boundaries."""
Files = tuple[LoraShape, bytes, SignatureFile | None]
"""An adapter's LoRA shape (from adapter_config.json), its weights' bytes and its signature file, if any."""


class AdapterDoor:
    """Reading adapters' names and files as vLLM's load, upload and unload routes take them."""

    def __init__(self, config: ProxyConfig, base_names: frozenset[str]) -> None:
        self.max_bytes, self.base_names = config.spool.max_adapter_bytes, base_names
        largest = self.max_bytes + MAX_CONFIG_BYTES + MAX_SIGNATURE_FILE_BYTES + UPLOAD_SLACK  # one upload's body
        budget = config.http.max_upload_bytes_in_flight or 2 * largest
        self.uploads = UploadBudget(budget, config.routing.retry_after_s)
        """The bytes of uploads the door holds at once (edge.uploads: in all, and per tenant)."""
        adapter_root = config.http.adapter_root
        self.root = Path(adapter_root).resolve() if adapter_root else None

    def load_ref(self, lora_name: str) -> ModelRef:
        """The version a load or upload names (NAME-vN, or NAME for its next), never the base model's id."""
        if lora_name in self.base_names:
            raise InvalidArgument(
                f"lora_name {lora_name[:80]!r} is the base model's id, which names the base model on this server; "
                "load the adapter under a name of its own",
                reason=Reason.BAD_ADAPTER_NAME,
            )
        return parse_model(lora_name, frozenset())

    def unload_ref(self, lora_name: str) -> tuple[str, int]:
        """The name and version (0: every version) an unload names, never the base model."""
        ref = parse_model(lora_name, self.base_names)
        if ref.is_base:
            raise InvalidArgument("the base model cannot be unloaded", reason=Reason.BAD_ADAPTER_NAME)
        return ref.name, ref.version

    async def read_path(self, lora_path: str) -> Files:
        """A folder under the adapter root, read off the event loop."""
        folder = self._inside_root(lora_path)
        config, payload, signed = await asyncio.to_thread(self._read_folder, folder)
        return _lora_shape(config), payload, signed

    def read_upload(self, parts: Iterable[tuple[str, bytes]]) -> Files:
        """The two files of an upload (by field name), and its signature file if sent, checked like a folder's."""
        files = dict(parts)
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if f not in files]
        if missing:
            raise _bad_folder(f"the upload lacks {', '.join(missing)}; send both files of the adapter folder")
        if len(files[CONFIG_FILE]) > MAX_CONFIG_BYTES:
            raise _bad_folder(f"{CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
        signed = SignatureFile.parse(files[SIGNATURE_FILE]) if SIGNATURE_FILE in files else None
        return _lora_shape(_parse_config(files[CONFIG_FILE])), files[WEIGHTS_FILE], signed

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


def answer(loaded: Loaded) -> dict[str, Any]:
    """A load's answer as the door gives it (docs/http.md): vLLM's object, with the version,
    its lineage, digest and signer, and how far its publication got."""
    out = {
        "object": "lora_adapter",
        "id": model_id(loaded.name, loaded.version),
        "name": loaded.name,
        "lineage": loaded.lineage,
        "version": loaded.version,
        "sha256": loaded.sha256,
        "signer": loaded.signer,
        "state": "committed" if loaded.committed else "spooled",
        "already_loaded": loaded.already_loaded,
        "replicas": [{"replica": r.replica, "code": r.code, "message": r.message} for r in loaded.replicas],
    }
    if loaded.earlier_failure:
        out["earlier_failure"] = loaded.earlier_failure
    if loaded.new_lineage:
        out["new_lineage"] = True
    return out


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


def _bad_folder(message: str) -> HttpError:
    return HttpError(grpc.StatusCode.INVALID_ARGUMENT, message, reason=Reason.BAD_ADAPTER_FOLDER)
