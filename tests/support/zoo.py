"""The model zoo in tests (rollwire.demo.zoo): the architectures, each one's PEFT adapters as a
user's training would write them, and the independent computations they are checked against."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest
from rollwire.demo.zoo import ARCHITECTURES

ARCHS = list(ARCHITECTURES)
MOE = {"qwen3_moe", "mixtral"}
ATTENTION = {"gpt2": ["c_attn", "c_proj"], "gpt_neox": ["query_key_value", "dense"], "phi3": ["qkv_proj", "o_proj"]}


def attention_targets(arch: str) -> list[str]:
    """The attention projections of `arch` by name (what a MoE user lists to leave the experts out)."""
    return ATTENTION.get(arch, ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class PeftAdapter:
    """A PEFT adapter as PEFT's own save writes it (get_peft_model_state_dict, safetensors), with the
    PeftModel that holds it: the reference the replica must reproduce."""

    payload: bytes
    shape: LoraShape
    model: Any  # the PeftModel
    config: Any  # its LoraConfig

    def manifest(self, name: str = "zoo", version: int = 1) -> Manifest:
        return Manifest(
            name, version, "sha256:test", self.shape, len(self.payload), hashlib.sha256(self.payload).hexdigest()
        )


def peft_adapter(model_dir: Path, seed: int, scale: float = 0.3, **lora) -> PeftAdapter:
    """A LoRA of `model_dir` with random, clearly non-zero weights (PEFT zero-inits B, which would
    change nothing), configured by `lora` (LoraConfig's own keywords)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM

    lora.setdefault("r", 8)
    config = LoraConfig(init_lora_weights=False, **lora)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    state = {k: v.contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return PeftAdapter(save(state), LoraShape.from_peft(model.peft_config["default"]), model.eval(), config)
