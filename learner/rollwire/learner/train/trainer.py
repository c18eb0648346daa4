"""The policy being trained: the base model with a PEFT LoRA adapter, AdamW, one GRPO step.

Invariants:
- logprobs are recomputed in fp32 over exactly the tokens the generator saw (the prompt
  ids as the server tokenized them, then the sampled ids), each row attending to exactly
  its own tokens from position 0 (right padding, never attended to). That is the
  generator's layout, so at staleness 0 the importance ratio is 1 up to float noise;
- environment and tool tokens of a multi-turn sample (ScoredSample.loss_mask false) are
  context the model attends to, never targets of the loss: they count in no normaliser,
  ratio or staleness, and their reported logprobs and versions are never read;
- the reference policy for the KL term is the same model with the adapter disabled: no
  second copy of the weights;
- `adapter_payload()` is what replicas load: the PEFT LoRA state dict in safetensors bytes;
  it refuses (NonFiniteWeights) to build a payload holding a NaN or an infinity, so a
  diverged run stops instead of publishing weights no replica may serve;
- an optimiser step whose gradient (or loss) is not finite is never applied: no AdamW
  update, its gradients dropped, the weights and the optimiser's state bit for bit as before.
  It is reported (StepStats.skipped, rollwire_learner_skipped_steps_total) and logged
  (`step_skipped`) with the groups behind it and the producers that sent them, and the run
  goes on with the next batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rollwire.common.lora import LoraShape
from rollwire.learner.config import TrainSection
from rollwire.learner.losses import LOSSES, LossBatch
from rollwire.learner.publish.publisher import NonFiniteWeights
from rollwire.learner.rollouts.groups import ScoredGroup
from rollwire.learner.train.grpo import group_advantages, importance_ratio, token_logprobs
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)
SKIP_REASONS = ("nonfinite_gradient", "nonfinite_loss")
"""Why a step is skipped (StepStats.skipped, the skipped-steps metric's reason)."""


@dataclass
class StepStats:
    """What one optimiser step reports."""

    loss: float
    tokens: int
    samples: int
    ratio_mean: float
    ratio_mean_fresh: float | None
    """Mean ratio over tokens sampled by exactly the weights trained (staleness 0); None if none."""
    fresh_tokens: int
    ratio_min: float
    ratio_max: float
    clip_fraction: float
    truncated_fraction: float
    kl: float
    grad_norm: float
    reward_mean: float
    reward_std: float
    accuracy: float
    seconds: float
    token_staleness_mean: float = 0.0
    """Mean (trained version - version that sampled it) over the step's completion tokens."""
    token_staleness_max: int = 0
    stale_tokens_masked: int = 0
    """Tokens masked from the loss by buffer.max_token_staleness."""
    skipped: str = ""
    """Why the step was not applied (SKIP_REASONS), or empty: it was."""


class Trainer:
    """Owns the model, the optimiser and the LoRA weights; `step` runs off the event loop."""

    def __init__(
        self, base_model: str | Path, cfg: TrainSection, temperature: float, seed: int, max_token_staleness: int = -1
    ) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(seed)
        self.cfg = cfg
        self.loss = LOSSES.load(cfg.loss)  # the one seam for another loss: losses.py
        self.temperature = temperature
        self.max_token_staleness = max_token_staleness
        self.device = torch.device(cfg.device)
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).to(self.device)  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
        self.targets = list(cfg.target_modules) or linear_targets(base)
        """The layers that get LoRA: train.target_modules, or every linear layer of this model by name."""
        self.lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,  # pyright: ignore[reportArgumentType]  # the library's annotation is narrower than what it accepts
            target_modules=self.targets,
            lora_dropout=0.0,
            bias="none",
        )
        self.model = get_peft_model(base, self.lora)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self._adapter_views = _adapter_views(self.model, params)

    @property
    def lora_shape(self) -> LoraShape:
        """The adapter's shape as the push manifest carries it."""
        return LoraShape(self.cfg.lora_r, self.cfg.lora_alpha, tuple(sorted(self.targets)))

    def adapter_payload(self) -> bytes:
        """The adapter as replicas load it: PEFT state dict keys, safetensors bytes."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save

        state = self._adapter_views or get_peft_model_state_dict(self.model)
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
        for name, value in tensors.items():
            if not bool(torch.isfinite(value).all()):
                count, version = getattr(self, "last_step", (0, 0))
                when = (
                    f"after optimiser step {count} of this run (trained at version {version})"
                    if count
                    else "before any step"
                )
                raise NonFiniteWeights(
                    f"the adapter holds NaN or infinite values in tensor {name} {when}; the run diverged and is stopped "
                    "without publishing it (lower train.lr or resume from an earlier checkpoint)"
                )
        return save(tensors)

    def load_adapter(self, payload: bytes) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load

        result = set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in load(payload).items()})
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"checkpoint adapter has tensors this model does not: {result.unexpected_keys[:3]}")

    def step(self, groups: list[ScoredGroup], version: int) -> StepStats:
        """One optimiser step on a batch of groups, trained at `version` (gradient accumulation);
        skipped, not applied, when its gradient or loss is not finite."""
        started = time.monotonic()
        self.last_step = (getattr(self, "last_step", (0, 0))[0] + 1, version)
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
        advantages = group_advantages(rewards, self.cfg.normalize_std)
        total_tokens = sum(sum(s.trained_mask) for g in groups for s in g.samples)
        self.optimizer.zero_grad(set_to_none=True)
        totals = _Totals()
        size = self.cfg.micro_batch_groups or len(groups)
        ages = [version - v for g in groups for s in g.samples for v in s.trained_versions]
        masked = sum(a > self.max_token_staleness for a in ages) if self.max_token_staleness >= 0 else 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        suspects, grad_norm = groups, math.nan
        for start in range(0, len(groups), size):
            part = groups[start : start + size]
            rows = _rows(part, advantages[start : start + size], version, self.max_token_staleness)
            terms, fresh_sum, fresh_count = self._loss(rows, normaliser=float(max(total_tokens - masked, 1)))
            terms.loss.backward()
            totals.add(terms, fresh_sum, fresh_count)
            if size < len(groups) and _skip_reason(norm := _grad_norm(params), totals.loss):
                suspects, grad_norm = part, norm  # the first micro-batch to turn the step non-finite: its groups
                break
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
        skipped = _skip_reason(grad_norm, totals.loss)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            _log_skipped(skipped, suspects, groups, version, grad_norm, totals.loss)
        else:
            self.optimizer.step()
        correct = [s.correct for g in groups for s in g.samples]
        return StepStats(
            loss=totals.loss,
            tokens=totals.tokens,
            samples=len(correct),
            ratio_mean=totals.ratio_sum / max(totals.tokens, 1),
            ratio_mean_fresh=totals.fresh_sum / totals.fresh_count if totals.fresh_count else None,
            fresh_tokens=totals.fresh_count,
            ratio_min=totals.ratio_min,
            ratio_max=totals.ratio_max,
            clip_fraction=totals.clipped / max(totals.tokens, 1),
            truncated_fraction=totals.truncated / max(totals.tokens, 1),
            kl=totals.kl_sum / max(totals.tokens, 1),
            grad_norm=grad_norm,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std(unbiased=False)),
            accuracy=sum(correct) / max(len(correct), 1),
            seconds=time.monotonic() - started,
            token_staleness_mean=sum(ages) / max(len(ages), 1),
            token_staleness_max=max(ages, default=0),
            stale_tokens_masked=masked,
            skipped=skipped,
        )

    def _loss(self, rows: _Rows, normaliser: float):
        ids, mask = rows.ids.to(self.device), rows.attention.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        targets = ids[:, 1:]
        kept = rows.kept.to(self.device) if rows.kept is not None else None
        logp = token_logprobs(logits, targets, self.temperature, kept)
        ref = rows.ref.to(self.device) if rows.ref is not None else None
        if self.cfg.kl_coef > 0 and ref is None:
            with torch.no_grad(), self.model.disable_adapter():
                ref = token_logprobs(
                    self.model(input_ids=ids, attention_mask=mask).logits[:, :-1], targets, self.temperature, kept
                )
        behaviour = rows.behaviour.to(self.device)
        batch = LossBatch(
            logp, behaviour, rows.advantages.to(self.device), rows.completion.to(self.device), ref, normaliser
        )
        terms = self.loss(batch, self.cfg)
        with torch.no_grad():
            fresh = rows.fresh.to(self.device)
            fresh_sum = float((importance_ratio(logp, behaviour) * fresh).sum())
        return terms, fresh_sum, int(fresh.sum())

    def recompute_logprobs(self, groups: list[ScoredGroup]) -> list[list[float]]:
        """Current-policy logprobs of every sample's tokens (diagnostics and tests)."""
        rows = _rows(groups, torch.zeros(len(groups), len(groups[0].samples)), version=-1)
        with torch.no_grad():
            logits = self.model(
                input_ids=rows.ids.to(self.device), attention_mask=rows.attention.to(self.device)
            ).logits
            kept = rows.kept.to(self.device) if rows.kept is not None else None
            logp = token_logprobs(logits[:, :-1], rows.ids[:, 1:].to(self.device), self.temperature, kept).cpu()
        return [logp[i][rows.completion[i] > 0].tolist() for i in range(len(logp))]


def linear_targets(model) -> list[str]:
    """The names (last dotted part) of every linear layer LoRA may target in `model`: PEFT's
    rule for "all-linear" (nn.Linear and GPT-2's Conv1D, the output head left out), without the
    MoE experts and routers that "all-linear" also adds on transformers 5 MoE models (their
    fused parameters are not linear modules, and the replicas refuse LoRA on them)."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and module is not head
    }
    return sorted(names)


def _adapter_views(model, params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """PEFT's adapter state dict, kept: its tensors are views of the trained parameters, so
    they always hold the current weights (optimiser steps and checkpoint loads write in place).

    Building it walks the whole model's state dict, which took 3 of the 5 ms of a payload
    of the tiny model, once a step. None (build it each time) if this PEFT version returns
    copies."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model)
    storages = {p.untyped_storage().data_ptr() for p in params}
    if all(t.untyped_storage().data_ptr() in storages for t in state.values()):
        return state
    return None


def _grad_norm(params: Sequence[torch.Tensor]) -> float:
    """The accumulated gradient's global norm, as clip_grad_norm_ computes it (without clipping)."""
    norms = [p.grad.detach().norm() for p in params if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _skip_reason(grad_norm: float, loss: float) -> str:
    """Why a step with this gradient norm and loss must not be applied, or "" (SKIP_REASONS)."""
    if not math.isfinite(grad_norm):
        return "nonfinite_gradient"
    if not math.isfinite(loss):
        return "nonfinite_loss"
    return ""


def _log_skipped(
    reason: str, suspects: list[ScoredGroup], batch: list[ScoredGroup], version: int, grad_norm: float, loss: float
) -> None:
    """Name the groups behind a skipped step and who sent them (an ingest producer, or the learner's own)."""
    named = [(g.producer or g.source, str(g.example.meta.get("group_id", g.example.id))) for g in suspects]
    log.error(
        "step_skipped",
        reason=reason,
        version=version,
        grad_norm=grad_norm,
        loss=loss,
        producers=sorted({p for p, _ in named}),
        groups=[f"{p}/{gid}" for p, gid in named[:32]],
        suspects=len(suspects),
        batch=len(batch),
        hint="the step was not applied; its groups are dropped and training goes on",
    )


@dataclass
class _Rows:
    """Right-padded sequences; per-token tensors are aligned with the shifted targets ids[:, 1:]."""

    ids: torch.Tensor
    attention: torch.Tensor
    completion: torch.Tensor
    behaviour: torch.Tensor
    advantages: torch.Tensor
    fresh: torch.Tensor
    """Completion tokens sampled by exactly the version being trained."""
    kept: torch.Tensor | None = None
    """[rows, T, K] kept-set ids of truncated sampling (-1 padding), or None when no sample has any."""
    ref: torch.Tensor | None = None
    """Base-model logprobs the replicas scored (ScoredSample.ref_logprobs), or None when any sample lacks them."""


def _rows(groups: list[ScoredGroup], advantages: torch.Tensor, version: int, max_token_staleness: int = -1) -> _Rows:
    """The groups as padded rows; environment tokens (a sample's loss_mask) and tokens older
    than `max_token_staleness` versions (>= 0) are left out of the completion mask, so the loss
    never sees them; their behaviour logprobs are zeroed, so no value there can reach it."""
    seqs = [
        (g.prompt_ids, s, float(advantages[gi, si])) for gi, g in enumerate(groups) for si, s in enumerate(g.samples)
    ]
    width = max(len(p) + len(s.token_ids) for p, s, _ in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    completion = torch.zeros(len(seqs), width - 1)
    behaviour = torch.zeros(len(seqs), width - 1)
    adv = torch.zeros(len(seqs), width - 1)
    fresh = torch.zeros(len(seqs), width - 1)
    scored = all(len(s.ref_logprobs) == len(s.token_ids) for _, s, _ in seqs)
    ref = torch.zeros(len(seqs), width - 1) if scored else None
    for i, (prompt, sample, a) in enumerate(seqs):
        seq = list(prompt) + list(sample.token_ids)
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        first, last = len(prompt) - 1, len(seq) - 1  # target index t-1 predicts token t
        trained = torch.tensor(sample.trained_mask, dtype=torch.float32)
        if max_token_staleness >= 0:
            completion[i, first:last] = trained * torch.tensor(
                [float(version - v <= max_token_staleness) for v in sample.token_versions]
            )
        else:
            completion[i, first:last] = trained
        behaviour[i, first:last] = torch.where(trained > 0, torch.tensor(sample.logprobs), 0.0)
        adv[i, first:last] = a
        fresh[i, first:last] = trained * torch.tensor([float(v == version) for v in sample.token_versions])
        if ref is not None:
            ref[i, first:last] = torch.where(trained > 0, torch.tensor(sample.ref_logprobs, dtype=torch.float32), 0.0)
    return _Rows(ids, attention, completion, behaviour, adv, fresh, _kept(seqs, width), ref)


def _kept(seqs: list, width: int) -> torch.Tensor | None:
    """The samples' kept sets aligned with the targets, padded with -1; None when none has one."""
    size = max((len(k) for _, s, _ in seqs for k in s.kept_tokens), default=0)
    if not size:
        return None
    kept = torch.full((len(seqs), width - 1, size), -1, dtype=torch.long)
    for i, (prompt, sample, _) in enumerate(seqs):
        for j, ids in enumerate(sample.kept_tokens):
            if ids:
                kept[i, len(prompt) - 1 + j, : len(ids)] = torch.tensor(ids)
    return kept


class _Totals:
    """Sums LossTerms over micro-batches."""

    def __init__(self) -> None:
        self.loss = self.ratio_sum = self.kl_sum = 0.0
        self.tokens = self.clipped = self.truncated = self.fresh_count = 0
        self.fresh_sum = 0.0
        self.ratio_min, self.ratio_max = float("inf"), float("-inf")

    def add(self, terms, fresh_sum: float, fresh_count: int) -> None:
        self.loss += float(terms.loss.detach())
        self.fresh_sum += fresh_sum
        self.fresh_count += fresh_count
        self.tokens += terms.tokens
        self.ratio_sum += terms.ratio_sum
        self.clipped += terms.clipped
        self.truncated += terms.truncated
        self.kl_sum += terms.kl_sum
        self.ratio_min = min(self.ratio_min, terms.ratio_min)
        self.ratio_max = max(self.ratio_max, terms.ratio_max)
