"""LoRA adapters on the embedded engine's base model: many adapters in one batch, by forward hooks.

The math is PEFT's for plain LoRA, per targeted linear layer:
    y = base(x) + ((x Aᵀ) Bᵀ)·s,    s = lora_alpha / r   (lora_alpha / sqrt(r) with rsLoRA)
per layer, r and lora_alpha that layer's (PEFT's rank_pattern / alpha_pattern: LoraShape.scale_of)
with A [r, in] and B [out, r] exactly as `get_peft_model_state_dict` saves them.

Why not PEFT's own layers at serving time: a batch that mixes adapters (every batch of an
asynchronous run, where versions v and v+1 are both in flight, and every batch of a replica
that serves several runs' adapters) goes through PEFT's mixed-batch path, which rebuilds each
adapter's row list in Python at every one of the model's LoRA layers and indexes with it; on
the tiny model a 64-row decode step took 10.4 ms that way against 3.6 ms for the base model
alone (2026-12-03, 1 thread), and adding an adapter (new modules for every layer, ~30 ms)
stalled the batch at every push. Here the route of a forward pass is planned once (`routed`)
and loading an adapter is copying its tensors.

Two ways through a layer, chosen per forward pass:
- one adapter for every row (a Score, a replica serving one run): one pair of matmuls on the
  whole batch with PEFT's own operations in its order (F.linear by A, by B, times s), so a
  pass of one adapter gives a PeftModel's numbers bit for bit on CPU;
- rows of several adapters, base rows among them (`_Mixed`): each layer keeps every loaded
  adapter's Aᵀ and s·Bᵀ stacked in slots, zero-padded to the largest rank that targets it
  (an adapter that does not target the layer has zeros there). The pass is planned once: the
  adapter rows grouped by adapter into equal blocks (a short block padded with copies of its
  own rows, whose results are dropped); each layer then gathers the rows into blocks, does two
  batched matmuls (torch.bmm: block j with adapter j's slot) and adds each real row's delta
  back. So a step costs the same number of operations whether its rows use 2 adapters or 8,
  and reads each adapter's weights once (issue 35: N adapters cost close to one;
  docs/benchmarks.md). The zero padding adds exact zeros, so a row's delta is its own
  adapter's up to float rounding of the sums (checked against PEFT per adapter). Cost: the
  stacks are a second copy of the adapters' weights, and a skewed mix pads: blocks x the
  largest block's rows x tokens x in features per layer, transiently.

Invariants:
- the base model's weights are never modified (nothing is merged), so rows without an
  adapter compute exactly the base model, whatever else shares the batch (they are never
  gathered: their output is untouched);
- rows never mix: a row's output depends only on its own input and its own adapter's weights
  (a row reads only its own slot, so even a diverged adapter's NaN stays in its own rows);
- an adapter is installed whole or not at all: every tensor is checked against the model
  before any is installed, and an adapter that fails leaves the others as they were;
- only the thread that runs the forward passes calls `load`, `unload` and `routed`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from rollwire.common.errors import InvalidArgument
from rollwire.common.lora import LoraShape
from rollwire.common.reasons import Reason
from rollwire.push.checks import PEFT_PREFIX

_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class _Mixed:
    """A pass whose rows use several adapters, planned once for every layer.

    The adapter rows are grouped by adapter into `groups` blocks of `width` rows each (a block
    with fewer rows is padded by repeating one of its own rows): `gather` lists, block by
    block, the batch row each of the groups x width places reads; `slots` the stack slot of
    each block's adapter (None: every loaded adapter, in slot order); `keep` the places that
    are real rows (None: all of them) and `rows` the batch row each of those writes to."""

    groups: int
    width: int
    gather: torch.Tensor
    slots: torch.Tensor | None
    keep: torch.Tensor | None
    rows: torch.Tensor

    @staticmethod
    def plan(handles: Sequence[str | None], order: list[str], device: torch.device) -> _Mixed | None:
        slot_of = {h: i for i, h in enumerate(order)}
        by_slot: dict[int, list[int]] = {}
        for i, h in enumerate(handles):
            if h is not None and h in slot_of:
                by_slot.setdefault(slot_of[h], []).append(i)
        if not by_slot:
            return None
        slots = sorted(by_slot)
        width = max(len(rows) for rows in by_slot.values())
        gather: list[int] = []
        keep: list[int] = []
        rows: list[int] = []
        for slot in slots:
            block = by_slot[slot]
            keep += range(len(gather), len(gather) + len(block))
            rows += block
            gather += block + [block[0]] * (width - len(block))

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return _Mixed(
            len(slots),
            width,
            tensor(gather),
            None if slots == list(range(len(order))) else tensor(slots),
            None if len(keep) == len(gather) else tensor(keep),
            tensor(rows),
        )


# the route of one forward pass: nothing (the base model), one handle for every row, or _Mixed
Route = str | _Mixed | None


class _Layer:
    """One targeted layer: each adapter's (A, B) as PEFT holds them for the one-adapter path,
    and all of them transposed and stacked by slot ([slots, in, R] and [slots, R, out], R the
    largest rank here, zeros elsewhere) for the mixed one."""

    def __init__(self) -> None:
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scales: dict[str, float] = {}  # handle -> s of this layer (rank_pattern / alpha_pattern)
        self.stack_a: torch.Tensor | None = None
        self.stack_b: torch.Tensor | None = None

    def restack(self, order: list[str]) -> None:
        """Rebuild the stacks for slot order `order` (every loaded handle, slot i = order[i]);
        the B stack holds s·Bᵀ, so the mixed path needs no multiply of its own."""
        if not self.weights:
            self.stack_a = self.stack_b = None
            return
        a0, b0 = next(iter(self.weights.values()))
        rank = max(a.shape[0] for a, _ in self.weights.values())
        stack_a = a0.new_zeros(len(order), a0.shape[1], rank)
        stack_b = b0.new_zeros(len(order), rank, b0.shape[0])
        for slot, handle in enumerate(order):
            if handle in self.weights:
                a, b = self.weights[handle]
                stack_a[slot, :, : a.shape[0]] = a.t()
                stack_b[slot, : b.shape[1], :] = b.t() * self.scales[handle]
        self.stack_a, self.stack_b = stack_a, stack_b


class LoraSet:
    """The loaded adapters of one model, by engine handle; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._layers: dict[str, _Layer] = {}  # targeted module -> its adapters
        self._order: list[str] = []  # loaded handles; a handle's index is its stack slot
        self._route: Route = None

    def __contains__(self, handle: str) -> bool:
        return handle in self._order

    def __len__(self) -> int:
        return len(self._order)

    def load(self, handle: str, lora: LoraShape, tensors: dict[str, torch.Tensor]) -> None:
        """Install an adapter under `handle` (PEFT state-dict names, as pushed)."""
        if handle in self._order:
            raise InvalidArgument(f"adapter handle {handle!r} is already loaded")
        pairs = _pairs(tensors)
        staged = {module: self._prepare(module, a, b) for module, (a, b) in pairs.items()}
        for module, weights in staged.items():
            if module not in self._layers:
                self._layers[module] = _Layer()
                self._model.get_submodule(module).register_forward_hook(_hook(self, self._layers[module]))
            self._layers[module].weights[handle] = weights
            self._layers[module].scales[handle] = lora.scale_of(module)
        self._order.append(handle)
        self._restack()

    def unload(self, handle: str) -> None:
        if handle not in self._order:
            return
        for layer in self._layers.values():
            layer.weights.pop(handle, None)
            layer.scales.pop(handle, None)
        self._order.remove(handle)
        self._restack()

    def _restack(self) -> None:
        for layer in self._layers.values():
            layer.restack(self._order)

    @contextmanager
    def routed(self, handles: Sequence[str | None]) -> Iterator[None]:
        """Run a forward pass whose row i uses adapter handles[i] (None or unknown = base)."""
        self._route = self._plan(handles)
        try:
            yield
        finally:
            self._route = None

    def _plan(self, handles: Sequence[str | None]) -> Route:
        if not self._order or not handles:
            return None
        first = handles[0]
        if handles.count(first) == len(handles):  # the common case: one adapter for the whole batch
            return first if first in self._order else None
        return _Mixed.plan(handles, self._order, next(self._model.parameters()).device)

    def _prepare(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        a, b = (t.to(device=weight.device, dtype=weight.dtype).contiguous() for t in (a, b))
        return a, b


def _hook(owner: LoraSet, layer: _Layer):
    """Forward hook of one targeted layer: add each routed row's delta to its output.

    The layer's output is a fresh tensor and the engine runs under inference_mode, so the
    delta is added in place."""

    def hook(_module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        route = owner._route
        if route is None:
            return None
        x = args[0]
        if isinstance(route, str):
            weights = layer.weights.get(route)
            if weights is None:  # this adapter does not target this layer
                return None
            a, b = weights  # PEFT's own operations, in its order: the same numbers as a PeftModel
            output.add_(F.linear(F.linear(x, a), b) * layer.scales[route])
            return output
        if layer.stack_a is None or layer.stack_b is None:
            return None
        stack_a, stack_b = layer.stack_a, layer.stack_b
        if route.slots is not None:
            stack_a, stack_b = stack_a.index_select(0, route.slots), stack_b.index_select(0, route.slots)
        xs = x.index_select(0, route.gather)  # [groups x width, tokens..., in]
        low = torch.bmm(xs.reshape(route.groups, -1, x.shape[-1]), stack_a)
        delta = torch.bmm(low, stack_b).reshape(*xs.shape[:-1], -1)
        if route.keep is not None:
            delta = delta.index_select(0, route.keep)
        output.index_add_(0, route.rows, delta)
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
