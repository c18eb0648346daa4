"""CPU stand-ins for the three GPU-only parts of TRL 1.16's `AsyncGRPOTrainer`.

TRL's asynchronous GRPO trainer (`trl.experimental.async_grpo`) assumes a CUDA machine next to
a vLLM server. Three of its parts cannot run on a CPU-only machine, although nothing in the
algorithm needs a GPU; `install()` replaces exactly those three, from our process, at import
time, and leaves every file of TRL untouched:

1. the rollout worker's refusal to start unless vLLM is importable (`is_vllm_available`);
2. the FLOPs probe that asks CUDA for the device's name (`get_peak_flops_per_device`);
3. the `tree_fa3` attention kernel, CUDA FlashAttention-3 fetched from the Hub, replaced by
   `flash_attn_varlen_func` below, a plain-torch kernel with FA's varlen semantics.

Invariants:
- `install()` changes nothing where CUDA is present (`needed()` is False): a GPU machine runs
  TRL as shipped; it is idempotent and only ever rebinds names inside TRL's modules.
- Only the trainer's process needs them. TRL starts its rollout worker with the `spawn` start
  method (`AsyncRolloutWorker.start`: `_child_main` builds an `_AsyncRolloutLoop`), and that
  child only tokenizes, posts HTTP requests and scores: it calls none of the three (the vLLM
  check runs in the parent's `AsyncRolloutWorker.__init__`, the probe and the attention in the
  trainer). So nothing needs re-installing there.
- `flash_attn_varlen_func` computes, for every packed segment, exactly what FA's varlen causal
  kernel computes: query i of a segment of length Lq sees key j of its K/V path of length Lk iff
  j <= i + (Lk - Lq) (causal aligned bottom-right), within the sliding window when one is
  given, after tanh soft-capping when asked, with grouped K/V heads repeated for the query
  heads; a query that sees no key gets zeros, as from FA.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["flash_attn_varlen_func", "install", "needed"]


def needed() -> bool:
    """True where TRL's GPU-only parts cannot run: no CUDA device here."""
    return not torch.cuda.is_available()


def install() -> bool:
    """Apply the three stand-ins to TRL's modules when `needed()`; returns whether it did."""
    if not needed():
        return False
    from trl.experimental.async_grpo import async_grpo_trainer, async_rollout_worker, packing

    # (1) Replaces: `is_vllm_available()` as seen by the rollout worker's constructor, which refuses to start
    # without vLLM installed. Why: the worker never imports vLLM; it talks to "a vLLM server" over HTTP only
    # (`/v1/completions` with aiohttp), and rollwire's proxy is that server. Rebinding the name in the worker's
    # module alone keeps every other TRL module's answer true (weight_transfer.py imports vLLM when it says yes).
    async_rollout_worker.is_vllm_available = _vllm_server_is_enough  # pyright: ignore[reportPrivateImportUsage]
    # (2) Replaces: `get_peak_flops_per_device`, which calls `torch.cuda.get_device_name` and asserts without CUDA.
    # Why: its answer only feeds the MFU metric; None is TRL's own "unknown device" answer (MFU is then not logged).
    async_grpo_trainer.get_peak_flops_per_device = _no_peak_flops  # pyright: ignore[reportPrivateImportUsage]
    # (3) Replaces: the `tree_fa3` kernel that `packing.tree_attention` loads through `_flash_attn()` from the Hub
    # (kernels-community/flash-attn3, CUDA only, and no Hub here). Why: TRL always loads the model with
    # attn_implementation="tree_fa3" (padding-free tree packing), so training cannot start without a kernel. TRL's
    # own `tree_attention` still gathers the K/V paths and shapes the output; only the varlen kernel is ours.
    packing._flash_attn = _cpu_flash_attn
    return True


def _vllm_server_is_enough(*args: Any, **kwargs: Any) -> bool:
    """Stand-in (1): the rollout worker needs a server that speaks vLLM's HTTP API, not vLLM itself."""
    return True


def _no_peak_flops(accelerator: Any, dtype: str) -> None:
    """Stand-in (2): the peak FLOPs of a device that is not a GPU are unknown (no MFU metric)."""
    return None


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    **unsupported: Any,
) -> torch.Tensor:
    """Stand-in (3): FlashAttention's varlen attention in plain torch (differentiable, any device).

    q: (total_q, H, D); k, v: (total_k, Hkv, D) with H a multiple of Hkv; `cu_seqlens_q` and
    `cu_seqlens_k` (S + 1 offsets) cut them into S segments, segment s of q attending only to
    segment s of k/v. Returns (total_q, H, D) in q's dtype. `window_size` = (left, right), -1
    for unbounded; `causal` forces right = 0. `max_seqlen_*` are FA's launch hints (unused).

    One masked attention over all segments at once: the mask is total_q x total_k per head,
    cheap for the rows a CPU trains on (a few hundred tokens), not meant for long GPU rows."""
    if unsupported:
        raise NotImplementedError(f"the CPU stand-in for flash_attn_varlen_func does not support {sorted(unsupported)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} K/V heads")
    if kv_heads != heads:  # GQA: query head h reads K/V head h // (heads // kv_heads), as FA does
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    allowed = _varlen_mask(cu_seqlens_q.long(), cu_seqlens_k.long(), causal, window_size)  # (total_q, total_k)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    seen = allowed.any(dim=-1, keepdim=True)  # a query that sees no key: FA writes zeros
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~seen, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def _varlen_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, window_size: tuple[int, int]) -> torch.Tensor:
    """(total_q, total_k) booleans: which key each packed query may see (FA's varlen rules)."""
    len_q, len_k = cu_q.diff(), cu_k.diff()
    segments = torch.arange(len(len_q), device=cu_q.device)
    seg_q = segments.repeat_interleave(len_q)
    seg_k = segments.repeat_interleave(len_k)
    i = torch.arange(len(seg_q), device=cu_q.device) - cu_q[seg_q]  # position within its segment
    j = torch.arange(len(seg_k), device=cu_q.device) - cu_k[seg_k]
    # FA aligns a segment's queries with the END of its keys: query i sits at key position i + (Lk - Lq).
    at = (i + (len_k - len_q)[seg_q]).unsqueeze(1)
    j = j.unsqueeze(0)
    allowed = seg_q.unsqueeze(1) == seg_k.unsqueeze(0)
    left, right = window_size
    if causal:
        right = 0
    if right >= 0:
        allowed &= j <= at + right
    if left >= 0:
        allowed &= j >= at - left
    return allowed


_CPU_KERNEL = SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def _cpu_flash_attn() -> SimpleNamespace:
    """What `packing._flash_attn()` returns once installed: a kernel module with our varlen function."""
    return _CPU_KERNEL
