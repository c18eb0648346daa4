"""Adapter folders and keys on this replica's disk for an engine server (sglang, vllm).

Invariants: an adapter version is written in full (PEFT folder: adapter_config.json +
adapter_model.safetensors), fsynced and renamed into place before a server is asked to load
it; keys come from files named in config, never from the environment, never logged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rollwire.common.errors import FailedPrecondition, Internal
from rollwire.common.manifest import Manifest
from rollwire.common.safetensors_header import header_length, read_header
from rollwire.common.secrets import SecretFileError, read_secret_file
from rollwire.push.buffers import Payload
from rollwire.runtime.durable import atomic_dir, write_synced


def peft_config(manifest: Manifest, payload: Payload, base_model: str) -> dict:
    """adapter_config.json for a pushed payload, as PEFT writes it and the servers read it.

    Target modules are the ones the tensors really adapt. SGLang scales by lora_alpha / r and
    has no rsLoRA (vLLM follows the file), so an rsLoRA adapter (alpha / sqrt(r)) is written
    with lora_alpha * sqrt(r): the same scaling, exactly, for both.
    """
    head = bytes(payload[: 8 + header_length(bytes(payload[:8]))])  # the header alone: it may be a bulk buffer
    tensors = read_header(head, body_length=len(payload) - len(head))
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors if ".lora_" in name})
    lora = manifest.lora
    if lora.rank_pattern or lora.alpha_pattern:  # only for a server that reads them (vLLM): the file as PEFT wrote it
        return {
            **_config(base_model, lora.r, lora.lora_alpha, modules, lora.use_rslora),
            "rank_pattern": {k: int(v) for k, v in lora.rank_pattern},
            "alpha_pattern": dict(lora.alpha_pattern),
        }
    alpha = lora.lora_alpha * (math.sqrt(lora.r) if lora.use_rslora else 1.0)
    return _config(base_model, lora.r, alpha, modules, False)


def _config(base_model: str, r: int, alpha: float, modules: list[str], rslora: bool) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft_folder(root: Path, name: str, manifest: Manifest, payload: Payload, base_model: str) -> Path:
    """Write the PEFT folder under a temporary name, fsync it, then rename it into place."""
    final = root / name
    if final.exists():
        raise Internal(f"adapter folder {final} already exists; adapter names are never reused, so it is stale")
    with atomic_dir(final, replace=False) as tmp:
        write_synced(tmp / "adapter_model.safetensors", payload)
        write_synced(
            tmp / "adapter_config.json", json.dumps(peft_config(manifest, payload, base_model), indent=1).encode()
        )
    return final


def read_secret(path: str, key: str) -> str | None:
    """A key from a file named in config (never from the environment, never logged)."""
    if not path:
        return None
    try:
        return read_secret_file(path, key)
    except SecretFileError as exc:
        raise FailedPrecondition(str(exc)) from None


def find_key(tree, key: str):
    """The value of `key` anywhere in nested dicts (SGLang's /server_info nests by version)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = find_key(value, key)
            if found is not None:
                return found
    return None
