"""The shape of a LoRA adapter: one type for every part that names one.

The SDK builds it from a PEFT config for a push manifest, the push protocol reads it from a
manifest and checks it, replicas derive tensor shapes and scaling from it, the learner
describes its adapter with it and the benchmarks size adapters with it. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollwire.common.errors import RequestError, finite_number, whole_number
from rollwire.v1 import generator_pb2 as pb

_UINT32 = (1 << 32) - 1


@dataclass(frozen=True)
class LoraShape:
    """The LoRA hyper-parameters that decide tensor shapes and scaling (the wire's LoraConfig).
    `target_modules` is a sorted tuple of module names, or ("all-linear",)."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @classmethod
    def from_peft(cls, config: LoraShape | Mapping[str, Any] | Any) -> LoraShape:
        """From a LoraShape, an adapter_config.json dict, or a peft.LoraConfig object;
        RequestError (an InvalidArgument and a ValueError) for what no server would accept."""
        if isinstance(config, LoraShape):
            return config
        get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
        modules = get("target_modules")
        if isinstance(modules, str) and modules != "all-linear":
            raise RequestError(f"target_modules {modules!r} is a pattern; list the module names or use 'all-linear'")
        if not modules:
            raise RequestError("the LoRA config has no target_modules; list the module names the adapter targets")
        names = (modules,) if isinstance(modules, str) else tuple(sorted(modules))
        alpha = finite_number("lora_alpha", get("lora_alpha"))
        return cls(whole_number("r", get("r"), 1, _UINT32), alpha, names, bool(get("use_rslora", False)))

    @classmethod
    def from_pb(cls, config: pb.LoraConfig) -> LoraShape:
        """As a manifest declares it, unchecked (manifest.check_manifest checks it)."""
        return cls(config.r, config.lora_alpha, tuple(config.target_modules), config.use_rslora)

    def to_pb(self) -> pb.LoraConfig:
        return pb.LoraConfig(
            r=self.r, lora_alpha=self.lora_alpha, target_modules=list(self.target_modules), use_rslora=self.use_rslora
        )
