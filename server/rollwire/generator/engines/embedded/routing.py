"""The experts a MoE model routes each position to, read off the forward pass (routing replay).

A learner that trains a MoE policy on rollouts replays the routing the rollout used (the
"rollout routing replay" of MoE RL), so the ratio it computes compares the same experts. The
transformers engine reports them on request (GenerateRequest.return_routed_experts): for each
sample, positions x MoE layers x top_k expert ids (RoutedExperts, vLLM's `routed_experts`).

Where they come from: every transformers 5 MoE block hands its experts module the ids its
router chose (`experts(hidden_states, top_k_index, top_k_weights)`, one row per flattened
token, highest weight first), so a forward pre-hook on each such module sees exactly what the
layer computed with. That is the definition used here: the experts the layer *ran*, not a
recomputation from router logits (which could break a tie the other way).

Invariants:
- hooks only read; a pass that records nothing costs one attribute test per MoE layer;
- a recording holds one [tokens, top_k] tensor per MoE layer, in the model's module order,
  for one forward pass only (`Recording.take` stacks and clears it);
- only the thread that runs the forward passes records (the engine's worker thread).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from rollwire.common.errors import FailedPrecondition, InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.generator.types import MAX_ROUTED_BYTES, GroupRequest, RoutedExperts

if TYPE_CHECKING:
    from rollwire.generator.engines.embedded.transformers_groups import Row

__all__ = ["MAX_ROUTED_BYTES", "RoutingRules", "RoutingTap", "encode", "moe_layers"]


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The experts modules of a transformers 5 MoE model, in module order: those whose forward
    takes the router's choice as `top_k_index`. [] for a dense model."""
    found = []
    for module in model.modules():
        forward = type(module).forward
        try:
            params = inspect.signature(forward).parameters
        except (TypeError, ValueError):  # builtins without a signature
            continue
        if "top_k_index" in params:
            found.append(module)
    return found


class RoutingTap:
    """Forward pre-hooks on a model's MoE layers that record their routing while `recording`."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_layers(model)
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
        self._taken: list[torch.Tensor] | None = None
        for module in self.layers:
            module.register_forward_pre_hook(self._hook, with_kwargs=True)

    @property
    def available(self) -> bool:
        """Whether this model has MoE layers whose routing can be reported."""
        return bool(self.layers) and self.top_k > 0

    def bytes_per_position(self) -> int:
        return 2 * len(self.layers) * self.top_k

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._taken is None:
            return
        index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
        if index is not None:
            self._taken.append(index.detach())

    @contextmanager
    def recording(self, wanted: bool) -> Iterator[Recording]:
        """Record the routing of the forward pass run in the body (when `wanted`)."""
        rec = Recording(self)
        if not wanted:
            yield rec
            return
        self._taken = []
        try:
            yield rec
        finally:
            rec.layers, self._taken = self._taken, None


class Recording:
    """What one forward pass routed: `take(rows, width)` -> [rows, width, layers, top_k] int32
    on the CPU, or None when nothing was recorded (not wanted, or a dense model)."""

    def __init__(self, tap: RoutingTap) -> None:
        self.tap = tap
        self.layers: list[torch.Tensor] = []

    def take(self, rows: int, width: int) -> torch.Tensor | None:
        if not self.layers or len(self.layers) != len(self.tap.layers):
            return None
        stacked = torch.stack([t.reshape(rows, width, -1) for t in self.layers], dim=2)
        return stacked.to("cpu", torch.int32)


def encode(chunks: list[torch.Tensor]) -> tuple[int, bytes]:
    """A sample's routing chunks ([positions, layers, top_k] each, oldest first) as (positions,
    little-endian uint16 bytes, position-major)."""
    if not chunks:
        return 0, b""
    whole = torch.cat(chunks, 0).contiguous()
    data = whole.numpy().astype("<u2", copy=False).tobytes()
    return int(whole.shape[0]), data


class RoutingRules:
    """The transformers engine's routing-replay rules (a mixin, as MemoryRules and ScoreRules):
    what a group asking for its routing may be, and how its rows' routing is gathered."""

    _routing: RoutingTap | None = None  # set by the engine's _load
    _recorded: Recording  # the last forward pass's recording (the engine's _forward)
    model_dir: Path

    @property
    def reports_routed_experts(self) -> bool:
        """Whether this model's MoE layers' routing can be reported (GroupRequest.routed_experts)."""
        return self._routing is not None and self._routing.available

    def _check_routed(self, group: GroupRequest) -> None:
        """A group asking for its routing: refused on a dense model, and when one sample's
        routing could not travel in one message (routing.MAX_ROUTED_BYTES)."""
        if self._routing is None or not self._routing.available:
            raise FailedPrecondition(
                f"return_routed_experts: this replica's model ({self.model_dir.name}) has no MoE layers whose "
                "routing can be reported; send the request without it, or to a replica of a MoE model",
                reason=Reason.ROUTED_EXPERTS_UNSUPPORTED,
            )
        positions = len(group.prompt_ids) + group.sampling.max_new_tokens
        size = positions * self._routing.bytes_per_position()
        if size > MAX_ROUTED_BYTES:
            raise InvalidArgument(
                f"return_routed_experts: a sample of {positions} positions (prompt plus max_new_tokens) has "
                f"{size} bytes of routing ({len(self._routing.layers)} MoE layers x {self._routing.top_k} experts x "
                f"2 bytes each), over the {MAX_ROUTED_BYTES} a sample may carry; send a shorter prompt or fewer "
                "max_new_tokens",
                reason=Reason.ROUTED_EXPERTS_TOO_LARGE,
            )

    def _route_prompts(self, units: list, rows: list[Row], width: int) -> None:
        """Each routed unit's prompt routing (its tokens are right-aligned in the pass's `width`
        columns, none reused) given to each of the rows made from it, in order."""
        routes = self._recorded.take(len(units), width)
        if routes is None:
            return
        k = 0
        for u, (g, _, prompt, indices) in enumerate(units):
            for _ in indices:
                if g.req.routed_experts:
                    rows[k].routes = [routes[u, width - len(prompt) :]]
                k += 1

    def _routes(self, row: Row) -> RoutedExperts | None:
        """A finished row's routing: its prompt's (and resumed tokens') then each fed token's."""
        if row.routes is None or self._routing is None:
            return None
        positions, data = encode(row.routes)
        return RoutedExperts(positions, len(self._routing.layers), self._routing.top_k, data)
