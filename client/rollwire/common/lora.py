"""The shape of a LoRA adapter: one type for every part that names one.

The SDK builds it from a PEFT config for a push manifest, the push protocol reads it from a
manifest and checks it, replicas derive tensor shapes and scaling from it, the learner
describes its adapter with it and the benchmarks size adapters with it. Torch-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rollwire.common.errors import RequestError, finite_number, whole_number
from rollwire.v1 import generator_pb2 as pb

_UINT32 = (1 << 32) - 1


MAX_PATTERNS = 256
"""Most entries of a rank_pattern or an alpha_pattern."""
MAX_PATTERN_CHARS = 256
_PATTERN_RE = re.compile(r"(\.\*(\\\.)?)?[A-Za-z0-9_\-]+((\\\.|\.)[A-Za-z0-9_\-]+)*")
"""The pattern keys served: a module name or dotted suffix, optionally after `.*` or `.*\\.` (what
PEFT writes itself, e.g. `.*\\.gate_up_proj` for a MoE model's experts). A regex beyond that is
refused: matching a caller's regex costs what the regex wants, and these match without one."""

Patterns = tuple[tuple[str, float], ...]


def check_pattern(key: object) -> str:
    """A rank_pattern / alpha_pattern key as served (`_PATTERN_RE`), or RequestError naming it."""
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_PATTERN_CHARS or not _PATTERN_RE.fullmatch(key):
        raise RequestError(
            f"pattern {str(key)[:80]!r} is not a module name or dotted name suffix (optionally after '.*' or "
            f"'.*\\.'); rollwire matches rank_pattern and alpha_pattern keys such as 'q_proj', "
            "'model.layers.0.self_attn.q_proj' or '.*\\.gate_up_proj', at most "
            f"{MAX_PATTERN_CHARS} characters: rewrite the key as one"
        )
    return key


def pattern_matches(key: str, module: str) -> bool:
    """PEFT's match of a pattern key on a module name, `re.match(rf"(.*\\.)?({key})$", module)`, for
    the keys `check_pattern` admits (a '.' in the name part read as a literal dot)."""
    if key.startswith(".*"):
        return module.endswith(key[2:].replace("\\.", "."))
    name = key.replace("\\.", ".")
    return module == name or module.endswith("." + name)


def _first(patterns: Patterns, module: str) -> float | None:
    return next((value for key, value in patterns if pattern_matches(key, module)), None)


@dataclass(frozen=True)
class LoraShape:
    """The LoRA hyper-parameters that decide tensor shapes and scaling (the wire's LoraConfig).
    `target_modules` is a sorted tuple of module names, or ("all-linear",); `rank_pattern` and
    `alpha_pattern` are PEFT's, in its order (the first key that matches a module decides)."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    rank_pattern: Patterns = ()
    alpha_pattern: Patterns = ()

    def rank_of(self, module: str) -> int:
        """The rank of `module`'s LoRA (PEFT: rank_pattern's first match, else r)."""
        rank = _first(self.rank_pattern, module)
        return self.r if rank is None else int(rank)

    def scale_of(self, module: str) -> float:
        """The scaling of `module`'s update: its alpha over its rank (over its square root with
        rsLoRA), alpha from alpha_pattern's first match, else lora_alpha (PEFT's rule)."""
        alpha = _first(self.alpha_pattern, module)
        alpha = self.lora_alpha if alpha is None else alpha
        rank = self.rank_of(module)
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)

    @property
    def ranks(self) -> set[int]:
        """Every rank the adapter's modules may have."""
        return {self.r, *(int(v) for _, v in self.rank_pattern)}

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
        ranks = _patterns(get("rank_pattern"), "rank_pattern", lambda k, v: whole_number(k, v, 1, _UINT32))
        alphas = _patterns(get("alpha_pattern"), "alpha_pattern", finite_number)
        return cls(whole_number("r", get("r"), 1, _UINT32), alpha, names, bool(get("use_rslora", False)), ranks, alphas)

    @classmethod
    def from_pb(cls, config: pb.LoraConfig) -> LoraShape:
        """As a manifest declares it, unchecked (manifest.check_manifest checks it)."""
        return cls(
            config.r,
            config.lora_alpha,
            tuple(config.target_modules),
            config.use_rslora,
            tuple((p.pattern, p.value) for p in config.rank_pattern),
            tuple((p.pattern, p.value) for p in config.alpha_pattern),
        )

    def to_pb(self) -> pb.LoraConfig:
        return pb.LoraConfig(
            r=self.r,
            lora_alpha=self.lora_alpha,
            target_modules=list(self.target_modules),
            use_rslora=self.use_rslora,
            rank_pattern=[pb.LoraPattern(pattern=k, value=v) for k, v in self.rank_pattern],
            alpha_pattern=[pb.LoraPattern(pattern=k, value=v) for k, v in self.alpha_pattern],
        )


def _patterns(value: object, name: str, number: Callable[[str, object], float]) -> Patterns:
    """A PEFT config's pattern dict as ordered pairs, each key and value checked."""
    if not value:
        return ()
    if not isinstance(value, Mapping) or len(value) > MAX_PATTERNS:
        raise RequestError(f"{name} must be an object of at most {MAX_PATTERNS} module patterns")
    return tuple((check_pattern(k), float(number(f"{name}[{str(k)[:40]!r}]", v))) for k, v in value.items())
