"""The transformers engine's KV-token budget, derived from memory at start when none is configured.

budget = ((free - weights) x fraction - prefix cache) / KV bytes per token, where
- free is the memory the device has before the weights are loaded: on CUDA what
  `torch.cuda.mem_get_info` reports free; on CPU /proc/meminfo's MemAvailable, or less when the
  process's cgroup (a container's memory limit) leaves less;
- weights are the bytes of the model's parameters and buffers, loaded on that device;
- fraction is `transformers.kv_memory_fraction`: the share of what is left that the running
  groups' reservations may take; the rest is headroom for activations, the per-layer copies a
  step makes of the cache (a decode step concatenates each layer's keys and values; joining and
  leaving rows copy them too), and everything else in the process;
- the prefix cache's whole budget (`transformers.prefix_cache.max_tokens`) is set aside when it is
  held on the same device (it is held on CPU);
- KV bytes per token = layers x 2 (keys, values) x KV heads x head dim x dtype bytes, from the
  model's config. Sliding-window layers are counted as full ones: that over-estimates their
  memory, so the budget errs low.

Invariant: the budget is fixed for the engine's life (read once, before any request), so
admission never depends on what other processes happen to hold at the moment; an explicit
`transformers.max_batch_tokens` always wins over the derivation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollwire.common.errors import FailedPrecondition
from rollwire.runtime.logs import get_logger

log = get_logger("rollwire.generator.engines.embedded.transformers_engine")

MEMINFO = Path("/proc/meminfo")
CGROUP_V2 = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current"))
CGROUP_V1 = (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"))
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number near 2**63


@dataclass(frozen=True)
class Memory:
    """Free memory of a device and where the figure came from (for the log)."""

    free_bytes: int
    source: str


@dataclass(frozen=True)
class KvBudget:
    """The budget and every input it was derived from (logged as `engine_kv_budget`)."""

    tokens: int
    source: str  # "config" (transformers.max_batch_tokens) or the free-memory figure's source
    free_bytes: int = 0
    weights_bytes: int = 0
    fraction: float = 0.0
    set_aside_bytes: int = 0  # the prefix cache's budget, when on the same device
    bytes_per_token: int = 0


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in the cache: layers x 2 x KV heads x head dim x dtype bytes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        layers = int(text.num_hidden_layers)
    except (AttributeError, TypeError) as exc:
        raise FailedPrecondition(
            f"the KV-token budget cannot be derived: this model's config has no attention shape ({exc}); "
            "set transformers.max_batch_tokens"
        ) from None
    return layers * 2 * kv_heads * head_dim * dtype.itemsize


def free_memory(device: torch.device) -> Memory:
    """What `device` has free now. Refuses (FailedPrecondition) a device it cannot read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return Memory(int(free), "cuda mem_get_info")
    if device.type == "cpu":
        return _cpu_memory()
    raise FailedPrecondition(
        f"the KV-token budget cannot be derived on device {device} (free memory is read on cuda and cpu only); "
        "set transformers.max_batch_tokens"
    )


def _cpu_memory() -> Memory:
    """MemAvailable, or what the process's cgroup limit leaves when that is less."""
    available = _meminfo_available()
    if available is None:
        raise FailedPrecondition(
            f"the KV-token budget cannot be derived: {MEMINFO} has no MemAvailable on this system; "
            "set transformers.max_batch_tokens"
        )
    best = Memory(available, "/proc/meminfo MemAvailable")
    for limit_file, usage_file in (CGROUP_V2, CGROUP_V1):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT and limit - usage < best.free_bytes:
            best = Memory(max(limit - usage, 0), f"cgroup {limit_file.name} - {usage_file.name}")
    return best


def _meminfo_available() -> int | None:
    try:
        lines = MEMINFO.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip() == "kB" else 1)
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def derive(memory: Memory, weights: int, fraction: float, set_aside: int, bytes_per_token: int) -> KvBudget:
    """The budget in tokens from its inputs (see the module docstring); never negative."""
    room = int((memory.free_bytes - weights) * fraction) - set_aside
    tokens = max(room, 0) // bytes_per_token
    return KvBudget(tokens, memory.source, memory.free_bytes, weights, fraction, set_aside, bytes_per_token)


def budget(
    model: Any, device: torch.device, configured: int | None, fraction: float, free: Memory | None, prefix_tokens: int
) -> KvBudget:
    """The engine's budget, logged (`engine_kv_budget`): `configured` when set, else derived from
    `free` (read before the weights were loaded), the model and, on CPU, the prefix cache's
    `prefix_tokens`. Refuses (FailedPrecondition) a device left with no room for one token."""
    if configured or free is None:
        chosen = KvBudget(configured or 0, "config")
        log.info("engine_kv_budget", tokens=chosen.tokens, source=chosen.source, device=str(device))
        return chosen
    per_token = kv_bytes_per_token(model.config, model.dtype)
    set_aside = prefix_tokens * per_token if device.type == "cpu" else 0  # the prefix cache is held on CPU
    chosen = derive(free, weights_bytes(model), fraction, set_aside, per_token)
    log.info("engine_kv_budget", device=str(device), **dataclasses.asdict(chosen))
    if chosen.tokens < 1:
        raise too_small(chosen, device)
    return chosen


def too_small(budget: KvBudget, device: torch.device) -> FailedPrecondition:
    """The start-up refusal when memory leaves no room for even one token."""
    return FailedPrecondition(
        f"no memory is left for the KV cache on {device}: {budget.free_bytes} bytes free ({budget.source}), the weights "
        f"take {budget.weights_bytes} and the prefix cache {budget.set_aside_bytes}, at transformers.kv_memory_fraction "
        f"{budget.fraction}; free memory, raise kv_memory_fraction, or set transformers.max_batch_tokens"
    )


__all__ = ["KvBudget", "Memory", "budget", "derive", "free_memory", "kv_bytes_per_token", "too_small", "weights_bytes"]
