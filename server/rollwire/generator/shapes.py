"""The layers of a base model that LoRA may target, derived from the model's own modules: what a
pushed adapter's tensors are checked against, on the replica and (through GetStatus's
`base_linear_layers`) on the proxy alike.

The rule is PEFT's: a LoRA layer wraps an `nn.Linear` or a GPT-2 `Conv1D` (whose weight is
stored [in, out]: its LoRA tensors are still A [r, in] and B [out, r]); fused projections (Phi-3's
`qkv_proj`, `gate_up_proj`, GPT-NeoX's `query_key_value`) are linear layers like any other; the
output head is never a target ("all-linear" leaves it out). A MoE model's routers and experts are
not linear modules in transformers 5 (PEFT wraps their parameters, `target_parameters`), so they
are not listed here, and `rollwire.push.checks` refuses their tensors by name.

The modules come from the model class instantiated on the meta device from config.json (no
weights read, no memory); without transformers (or for a model class it cannot build) they come
from the weights' headers, every 2-D `.weight` read as an `nn.Linear` [out, in], and for the
scripted benchmark engine's weightless folders from config.json alone (`config_linear_shapes`).
"""

from __future__ import annotations

import json
from pathlib import Path

from rollwire.common.safetensors_header import read_file_header
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)


def base_linear_shapes(model_dir: str | Path, *, config_only: bool = False) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of every layer LoRA may target (see the module docstring).

    With `config_only` (the scripted benchmark engine, which imports no torch) the headers
    decide, and a folder without weights gets the shapes a Llama/Qwen2-family config.json implies."""
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    if config_only:  # the scripted engine imports no torch
        return header_linear_shapes(weights) or config_linear_shapes(
            json.loads(Path(model_dir, "config.json").read_text())
        )
    if not weights:
        return {}
    modules = module_linear_shapes(model_dir)
    return modules if modules is not None else header_linear_shapes(weights)


def module_linear_shapes(model_dir: str | Path) -> dict[str, tuple[int, int]] | None:
    """The model's own LoRA-wrappable modules, from its class built on the meta device; None when
    transformers is not installed or cannot build the class from config.json."""
    try:
        import torch
        from torch import nn
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # a model type this transformers does not know: the headers decide
        log.warning("lora_layers_from_headers", model=str(model_dir), error=str(exc)[:200])
        return None
    head = model.get_output_embeddings()
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            shapes[name] = (module.out_features, module.in_features)
        elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
            inp, out = module.weight.shape  # Conv1D stores its weight [in, out]
            shapes[name] = (int(out), int(inp))
    return shapes


def header_linear_shapes(weights: list[Path]) -> dict[str, tuple[int, int]]:
    """Every 2-D `.weight` of the weight files as an nn.Linear [out, in], embeddings and the
    output head excluded, as PEFT's "all-linear" excludes them."""
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
