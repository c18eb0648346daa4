"""PEFT adapter folders on disk, as TRL's `save_lora_adapter` writes them (save_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

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


def write_peft_dir(path: Path, **config_overrides) -> Path:
    """A small PEFT folder of fixed tensors (no model needed), with `config_overrides` in its config."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["v_proj", "q_proj"],
        "use_rslora": True,
        "base_model_name_or_path": "org/some-hub-model",
    }
    config.update(config_overrides)
    (path / "adapter_config.json").write_text(json.dumps(config))
    tensors = {
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
        "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((16, 8), dtype=np.float32),
    }
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path
