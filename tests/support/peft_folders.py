"""PEFT adapter folders on disk, as TRL's `save_lora_adapter` writes them (save_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

from .wire import Adapter, make_adapter


def peft_folder(model_dir: Path, dest: Path, seed: int) -> Adapter:
    """A folder with adapter_config.json and adapter_model.safetensors; returns the adapter (its
    bytes and shape, for a reference model)."""
    adapter = make_adapter(model_dir, seed, r=4)
    dest.mkdir(parents=True)
    (dest / "adapter_model.safetensors").write_bytes(adapter.payload)
    config = {
        "peft_type": "LORA",
        "r": adapter.r,
        "lora_alpha": adapter.lora_alpha,
        "target_modules": list(adapter.targets),
        "base_model_name_or_path": str(model_dir),
        "task_type": "CAUSAL_LM",
    }
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return adapter
