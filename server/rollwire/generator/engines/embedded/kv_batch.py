"""Cache surgery for the transformers engine: the running batch's KV cache, rows joining it,
leaving it, and rows' keys and values copied out of it or seeded into a prefill.

Invariants of a `Batch`: every layer of `cache` holds keys and values [rows, heads, kv_len,
head_dim] with rows in the order of `rows`, and `mask` [rows, kv_len] marks each row's real
tokens (1); padding columns (0) hold zeros and are masked out of attention. A row's real
columns are in token order but need not be contiguous: a prefill that reuses a cached prefix
leaves padding between the prefix (in the seeded past) and the suffix. So a row's KV is only
ever read through its mask (`row_kv`), and positions are never derived from column indexes
after the prefill (each row keeps its own next position id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values) [heads, tokens, head_dim] of one sequence."""


@dataclass
class Batch:
    rows: list  # the engine's rows, in cache order
    cache: Any  # transformers DynamicCache, rows in the same order
    mask: torch.Tensor  # [rows, kv_len] 1 = real token


@dataclass
class PrefillInputs:
    """One prefill pass: row k computes the tokens of prompt k not covered by its reused prefix."""

    ids: torch.Tensor  # [rows, width] left-padded suffixes
    mask: torch.Tensor  # [rows, past + width]: the seeded prefixes, then the suffixes
    positions: torch.Tensor  # [rows, width] each suffix token's position in its prompt
    cache: Any  # DynamicCache seeded with the prefixes (empty when nothing is reused)
    computed: int  # real tokens the pass computes


def prefill_inputs(
    prompts: list[list[int]], reused: list[Layers | None], pad_id: int, config: Any, device: torch.device
) -> PrefillInputs:
    """Inputs of one prefill with one row per prompt. Row k's reused prefix (its first
    len(reused[k][0][0]) tokens' KV, or nothing) is right-aligned in a seeded past of the
    longest prefix's width; the rest of its prompt is right-aligned in the new columns. With
    nothing reused this is a plain left-padded prefill."""
    from transformers import DynamicCache

    lengths = [0 if r is None else int(r[0][0].shape[-2]) for r in reused]
    past = max(lengths, default=0)
    width = max(len(p) - c for p, c in zip(prompts, lengths, strict=True))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), past + width), dtype=torch.long)
    for k, (prompt, c) in enumerate(zip(prompts, lengths, strict=True)):
        tail = prompt[c:]
        ids[k, width - len(tail) :] = torch.tensor(tail)
        mask[k, past - c : past] = 1
        mask[k, past + width - len(tail) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
    cache = DynamicCache(config=config)
    if past:
        for layer in range(len(cache.layers)):
            keys = _seed([None if r is None else r[layer][0] for r in reused], past, device)
            values = _seed([None if r is None else r[layer][1] for r in reused], past, device)
            cache.update(keys, values, layer)
    computed = sum(len(p) - c for p, c in zip(prompts, lengths, strict=True))
    return PrefillInputs(ids, mask, positions, cache, computed)


def _seed(parts: list[torch.Tensor | None], past: int, device: torch.device) -> torch.Tensor:
    """[rows, heads, past, head_dim]: each row's prefix right-aligned, zeros before it."""
    some = next(p for p in parts if p is not None)
    out = torch.zeros((len(parts), some.shape[0], past, some.shape[-1]), dtype=some.dtype, device=device)
    for k, part in enumerate(parts):
        if part is not None and part.shape[-2]:
            out[k, :, past - part.shape[-2] :] = part.to(device)
    return out


def row_kv(cache: Any, mask: torch.Tensor, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Row `row`'s real columns, per layer [heads, tokens, head_dim], as CPU copies (never
    views of the batch's cache, which later steps overwrite)."""
    real = mask[row].bool()
    keys = [layer.keys[row][:, real].to("cpu", copy=True) for layer in cache.layers]
    values = [layer.values[row][:, real].to("cpu", copy=True) for layer in cache.layers]
    return keys, values


def repeat_rows(batch: Batch, samples: torch.Tensor) -> Batch:
    """Row k copied samples[k] times in place (a group's samples share its prompt's KV)."""
    for layer in batch.cache.layers:
        layer.keys = layer.keys.repeat_interleave(samples, 0)
        layer.values = layer.values.repeat_interleave(samples, 0)
    return Batch(batch.rows, batch.cache, batch.mask.repeat_interleave(samples, 0))


def select_rows(batch: Batch, keep: list[int], device: torch.device) -> Batch:
    """Only rows `keep` (in order), padding columns no row needs any more trimmed."""
    rows = [batch.rows[i] for i in keep]
    if not rows:
        return Batch([], None, batch.mask[:0])
    index = torch.tensor(keep, device=device)
    batch.cache.batch_select_indices(index)
    return trim(Batch(rows, batch.cache, batch.mask[index]))


def merge(a: Batch, b: Batch | None) -> Batch:
    """Concatenate two batches, left-padding the shorter KV cache with masked zeros.

    `a`'s cache is grown layer by layer (one layer's copy at a time, not the whole cache's).
    If that fails part-way (memory runs out), every layer is put back to `a`'s rows and
    columns before the error propagates (views of the grown tensors: nothing is allocated),
    so `a` stays a valid batch and only `b`'s groups need to end."""
    if b is None or not b.rows:
        return a
    if not a.rows:
        return b
    rows, old_width = len(a.rows), a.mask.shape[1]
    width = max(old_width, b.mask.shape[1])
    try:
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=False):
            la.keys = torch.cat([pad_left(la.keys, width), pad_left(lb.keys, width)], 0)
            la.values = torch.cat([pad_left(la.values, width), pad_left(lb.values, width)], 0)
        mask = torch.cat([pad_left(a.mask, width), pad_left(b.mask, width)], 0)
    except BaseException:
        for layer in a.cache.layers:
            layer.keys = layer.keys[:rows, :, layer.keys.shape[-2] - old_width :]
            layer.values = layer.values[:rows, :, layer.values.shape[-2] - old_width :]
        raise
    return Batch(a.rows + b.rows, a.cache, mask)


def pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pad the sequence axis (dim -2 for KV [B,H,T,D], dim -1 for masks [B,T]) on the left."""
    axis = -1 if t.dim() == 2 else -2
    missing = width - t.shape[axis]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], axis)


def trim(batch: Batch) -> Batch:
    """Cut KV columns that are padding for every remaining row."""
    real = batch.mask.any(0).nonzero()
    start = int(real[0]) if len(real) else 0
    if start == 0:
        return batch
    for layer in batch.cache.layers:
        layer.keys = layer.keys[:, :, start:]
        layer.values = layer.values[:, :, start:]
    return Batch(batch.rows, batch.cache, batch.mask[:, start:])


def cut_cache(cache: Any, kv_len: int) -> None:
    """Undo a step that failed part-way: every layer's keys and values back to `kv_len`
    tokens (layers the step reached had appended its token, the others had not)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > kv_len:
            layer.keys = layer.keys[..., :kv_len, :]
            layer.values = layer.values[..., :kv_len, :]


def plain_layers(config: Any) -> bool:
    """Whether every layer of this model's cache is a plain growing one (no sliding window,
    no recurrent state): the layout the prefix cache copies rows out of and seeds back."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)
