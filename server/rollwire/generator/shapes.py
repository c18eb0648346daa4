"""The linear layers of a base model that LoRA may target, from its weights' headers (or, for the
scripted benchmark engine, its config.json): what a pushed adapter's tensors are checked against."""

from __future__ import annotations

import json
from pathlib import Path

from rollwire.common.safetensors_header import read_file_header


def base_linear_shapes(model_dir: str | Path, *, config_only: bool = False) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of every linear layer LoRA may target, from weight headers.

    Embeddings and the output head are excluded, as PEFT's "all-linear" excludes them.
    With `config_only` (the scripted benchmark engine) a folder without weights gets the
    shapes a Llama/Qwen2-family config.json implies.
    """
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    if not weights and config_only:
        return config_linear_shapes(json.loads(Path(model_dir, "config.json").read_text()))
    shapes: dict[str, tuple[int, int]] = {}
    for path in weights:
        for name, (_, shape) in read_file_header(path).items():
            if not name.endswith(".weight") or len(shape) != 2:
                continue
            module = name[: -len(".weight")]
            if "embed" in module or module.endswith("lm_head"):
                continue
            shapes[module] = (shape[0], shape[1])
    return shapes


CONFIG_SHAPE_FAMILIES = ("llama", "qwen2", "mistral")


def config_linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """The linear layers of a Llama/Qwen2-family decoder, from its config.json values."""
    if config.get("model_type") not in CONFIG_SHAPE_FAMILIES:
        raise ValueError(
            f"cannot derive layer shapes of model_type {config.get('model_type')!r} from config.json "
            f"(known: {', '.join(CONFIG_SHAPE_FAMILIES)}); give the folder its *.safetensors weights"
        )
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    layer = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    return {
        f"model.layers.{i}.{module}": shape
        for i in range(config["num_hidden_layers"])
        for module, shape in layer.items()
    }
