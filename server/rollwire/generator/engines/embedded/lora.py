"""LoRA adapters on the embedded engine's base model: many adapters in one batch, by forward hooks.

The math is PEFT's for plain LoRA, per targeted linear layer:
    y = base(x) + (x Aᵀ)(s·B)ᵀ,    s = lora_alpha / r   (lora_alpha / sqrt(r) with rsLoRA)
with A [r, in] and B [out, r] exactly as `get_peft_model_state_dict` saves them.

Why not PEFT's own layers at serving time: a batch that mixes adapters (every batch of an
asynchronous run, where versions v and v+1 are both in flight) goes through PEFT's
mixed-batch path, which rebuilds each adapter's row list in Python at every one of the
model's LoRA layers and indexes with it; on the tiny model a 64-row decode step took 10.4 ms
that way against 3.6 ms for the base model alone (2026-12-03, 1 thread), and adding an
adapter (new modules for every layer, ~30 ms) stalled the batch at every push. Here the rows
of each adapter are found once per forward pass (`routed`), each layer does one pair of
small matmuls per adapter present, and loading an adapter is copying its tensors.

Invariants:
- the base model's weights are never modified (nothing is merged), so rows without an
  adapter compute exactly the base model, whatever else shares the batch;
- rows never mix: a row's output depends only on its own input and its own adapter;
- an adapter is installed whole or not at all: every tensor is checked against the model
  before any is installed, and an adapter that fails leaves the others as they were;
- only the thread that runs the forward passes calls `load`, `unload` and `routed`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from rollwire.common.errors import InvalidArgument
from rollwire.common.lora import LoraShape
from rollwire.common.reasons import Reason
from rollwire.push.checks import PEFT_PREFIX

_A, _B = ".lora_A.weight", ".lora_B.weight"

# (handle, rows): the rows of one adapter in a forward pass; None = every row of the batch
Route = list[tuple[str, torch.Tensor | None]]


class LoraSet:
    """The loaded adapters of one model, by engine handle; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._layers: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # module -> handle -> (Aᵀ, s·Bᵀ)
        self._handles: set[str] = set()
        self._route: Route = []

    def __contains__(self, handle: str) -> bool:
        return handle in self._handles

    def __len__(self) -> int:
        return len(self._handles)

    def load(self, handle: str, lora: LoraShape, tensors: dict[str, torch.Tensor]) -> None:
        """Install an adapter under `handle` (PEFT state-dict names, as pushed)."""
        if handle in self._handles:
            raise InvalidArgument(f"adapter handle {handle!r} is already loaded")
        scale = lora.lora_alpha / (math.sqrt(lora.r) if lora.use_rslora else lora.r)
        pairs = _pairs(tensors)
        staged = {module: self._prepare(module, a, b, scale) for module, (a, b) in pairs.items()}
        for module, weights in staged.items():
            if module not in self._layers:
                self._layers[module] = {}
                self._model.get_submodule(module).register_forward_hook(_hook(self, self._layers[module]))
            self._layers[module][handle] = weights
        self._handles.add(handle)

    def unload(self, handle: str) -> None:
        for per_handle in self._layers.values():
            per_handle.pop(handle, None)
        self._handles.discard(handle)

    @contextmanager
    def routed(self, handles: Sequence[str | None]) -> Iterator[None]:
        """Run a forward pass whose row i uses adapter handles[i] (None or unknown = base)."""
        self._route = self._plan(handles)
        try:
            yield
        finally:
            self._route = []

    def _plan(self, handles: Sequence[str | None]) -> Route:
        if not self._handles or not handles:
            return []
        first = handles[0]
        if handles.count(first) == len(handles):  # the common case: one adapter for the whole batch
            return [(first, None)] if first in self._handles else []
        rows: dict[str, list[int]] = {}
        for i, h in enumerate(handles):
            if h in self._handles:
                rows.setdefault(h, []).append(i)
        device = next(self._model.parameters()).device
        return [(h, torch.tensor(ix, device=device)) for h, ix in rows.items()]

    def _prepare(
        self, module: str, a: torch.Tensor, b: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            layer = self._model.get_submodule(module)
        except AttributeError:
            raise InvalidArgument(
                f"adapter has tensors for {module[:120]!r}, which this model does not have",
                reason=Reason.TENSOR_MISMATCH,
            ) from None
        in_f, out_f = _features(layer, module)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (r, in_f) or b.shape != (out_f, r):
            raise InvalidArgument(
                f"LoRA tensors of {module[:120]!r} have shapes {list(a.shape)} and {list(b.shape)}; the layer "
                f"maps {in_f} to {out_f} features, so they must be [r, {in_f}] and [{out_f}, r]",
                reason=Reason.TENSOR_MISMATCH,
            )
        weight = _weight(layer)
        a_t = a.to(device=weight.device, dtype=weight.dtype).t().contiguous()
        b_t = (b.to(device=weight.device, dtype=weight.dtype) * scale).t().contiguous()
        return a_t, b_t


def _hook(owner: LoraSet, per_handle: dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """Forward hook of one targeted layer: add each routed adapter's delta to its rows.

    The layer's output is a fresh tensor and the engine runs under inference_mode, so the
    delta is added in place."""

    def hook(_module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        route = owner._route
        if not route:
            return None
        x = args[0]
        for handle, rows in route:
            weights = per_handle.get(handle)
            if weights is None:  # this adapter does not target this layer
                continue
            a_t, b_t = weights
            if rows is None:
                output.add_((x @ a_t) @ b_t)
            else:
                output.index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)
        return output

    return hook


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A, B) from PEFT state-dict names; anything else is refused."""
    a_of: dict[str, torch.Tensor] = {}
    b_of: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, tensor in tensors.items():
        if name.startswith(PEFT_PREFIX) and name.endswith(_A):
            a_of[name[len(PEFT_PREFIX) : -len(_A)]] = tensor
        elif name.startswith(PEFT_PREFIX) and name.endswith(_B):
            b_of[name[len(PEFT_PREFIX) : -len(_B)]] = tensor
        else:
            unexpected.append(name[:120])
    unpaired = sorted(set(a_of) ^ set(b_of))
    if unexpected or unpaired:
        raise InvalidArgument(
            f"adapter has tensors that are not LoRA A/B pairs of one layer: {(unexpected + unpaired)[:3]}",
            reason=Reason.TENSOR_MISMATCH,
        )
    return {m: (a_of[m], b_of[m]) for m in a_of}


def _weight(layer: nn.Module) -> torch.Tensor:
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise InvalidArgument(
            f"{type(layer).__name__} has no weight matrix LoRA could extend", reason=Reason.TENSOR_MISMATCH
        )
    return weight


def _features(layer: nn.Module, module: str) -> tuple[int, int]:
    """(in, out) features of a layer LoRA can wrap: nn.Linear, or GPT-2's Conv1D ([in, out] weight)."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if type(layer).__name__ == "Conv1D" and _weight(layer).dim() == 2:
        return int(_weight(layer).shape[0]), int(_weight(layer).shape[1])
    raise InvalidArgument(
        f"{module[:120]!r} is a {type(layer).__name__}, not a linear layer; the transformers engine applies LoRA "
        "to linear layers only",
        reason=Reason.TENSOR_MISMATCH,
    )
