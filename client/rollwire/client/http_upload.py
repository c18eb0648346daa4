"""Sending a PEFT adapter folder to a rollwire proxy's HTTP door, with no shared filesystem.

vLLM's `/v1/load_lora_adapter` takes a *path* the server reads, so a trainer and a vLLM
server must share a disk. A rollwire proxy also takes the folder's two files over HTTP
(`POST /v1/upload_lora_adapter`, multipart/form-data) and publishes them to every replica
as one push. `upload_lora_adapter` sends them with the standard library alone;
`use_uploads_in_trl()` makes TRL's `VLLMClient.load_lora_adapter` upload instead of
sending a path, so TRL's AsyncGRPOTrainer can train on another host than the proxy
(docs/http.md, "Train with TRL").
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path

FILES = ("adapter_config.json", "adapter_model.safetensors")


def upload_lora_adapter(
    base_url: str, lora_name: str, folder: str | Path, *, token: str | None = None, timeout: float = 1800
) -> dict:
    """Upload `folder`'s adapter files as `lora_name` (`NAME-vN`: version N of NAME; a plain
    NAME: its next version); returns the proxy's answer (name, version, sha256, per-replica
    outcomes). Raises RuntimeError with the proxy's message when it refuses."""
    root = Path(folder)
    boundary = uuid.uuid4().hex
    parts = [_field(boundary, "lora_name", lora_name.encode())]
    for name in FILES:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"{root} has no {name}; save the adapter with PEFT's save_pretrained")
        parts.append(_field(boundary, name, path.read_bytes(), filename=name))
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/upload_lora_adapter", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(
            f"the proxy refused the upload ({err.code}): {err.read()[:2000].decode(errors='replace')}"
        ) from None


def _field(boundary: str, name: str, data: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
    if filename:
        head += "Content-Type: application/octet-stream\r\n"
    return head.encode() + b"\r\n" + data + b"\r\n"


def use_uploads_in_trl(token: str | None = None) -> None:
    """Make TRL's `VLLMClient.load_lora_adapter` upload the folder to a rollwire proxy instead
    of naming its path (call it before creating the trainer)."""
    from trl.experimental.async_grpo.vllm_client import VLLMClient  # pyright: ignore[reportMissingImports]

    def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: int = 1800) -> None:
        upload_lora_adapter(self.server_url, lora_name, lora_path, token=token, timeout=timeout)

    VLLMClient.load_lora_adapter = load_lora_adapter
