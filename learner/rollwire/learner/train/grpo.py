"""The pure GRPO arithmetic: group-relative advantages and the clipped, truncated surrogate.

No model, no I/O: tensors in, tensors out, so every formula is unit-tested by hand.

- Advantage of sample i in a group: A_i = r_i - mean(r), divided by (std(r) + eps) when
  `normalize_std` (population std, ddof 0). A group whose rewards are all equal has A = 0.
- Per completion token t, with the behaviour logprob mu_t reported by the generator that
  sampled it: rho_t = exp(logp_t - mu_t). The surrogate is PPO's
  min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A); for A < 0 it is also bounded below
  by ratio_cap * A (dual clip), which truncates the importance weight, so a token the policy
  has moved far towards since it was sampled cannot dominate the step.
- Optional KL to the reference (base) policy, per token, k3 estimator:
  exp(ref - logp) - (ref - logp) - 1 (non-negative, unbiased under the current policy).
- Aggregation is per token: the sum over every completion token of the batch divided by
  the batch's token count (`normaliser`), so micro-batches accumulate to the full-batch loss.

`train.loss` selects the loss by name (losses.py); "clipped" is `clipped_loss`, the above.

Invariants (float32 arithmetic, whatever a trajectory carried):
- the log-ratio logp - mu is clamped to +-LOG_RATIO_BOUND before the exp, so rho is finite
  and so is its gradient (an infinite rho times the zero gradient the clip gives it would be
  NaN). The clamp changes nothing the surrogate uses: above log(ratio_cap) (<= 1e6 < e^20,
  config.py) and above log(1 + clip_high) the surrogate is a constant either way, and below
  -20 the gradient it drops is at most e^-20 |A| per token;
- advantages are computed in float64 and are finite in float32 for any finite rewards that
  float32 can hold: centred rewards, divided by the std when `normalize_std` (then each is
  at most sqrt(n) in size).
"""

from __future__ import annotations

import torch

from rollwire.learner.losses import LossBatch, LossSettings, LossTerms

LOG_RATIO_BOUND = 20.0
"""|logp - mu| is clamped to this before the exp: e^20 ~ 4.9e8 is above any useful ratio (train.ratio_cap <= 1e6)
and far inside float32 (whose exp overflows past ~88.7)."""


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """[groups, n] rewards -> [groups, n] float32 advantages, centred per group.

    In float64, so neither the mean's sum nor the std's squares overflow for rewards float32
    can hold; the result is cast back to float32 (the loss's dtype)."""
    rewards = rewards.double()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.float()


def importance_ratio(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """rho = exp(logp - mu), the log-ratio clamped to +-LOG_RATIO_BOUND: finite, with a finite gradient."""
    return torch.exp((logp - behaviour_logp.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, kept: torch.Tensor | None = None
) -> torch.Tensor:
    """log p(token) under softmax(logits / T), in fp32: [B, T, V], [B, T] -> [B, T].

    `kept` [B, T, K] (token ids, -1 padding) renormalises over each position's kept set
    instead of the whole vocabulary: the truncated distribution top-k/top-p sampled from. A
    position whose row is all -1 keeps the whole vocabulary."""
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    norm = torch.logsumexp(scaled, dim=-1)
    if kept is not None and kept.numel():
        present = kept >= 0
        gathered = scaled.gather(-1, kept.clamp(min=0)).masked_fill(~present, float("-inf"))
        norm = torch.where(present.any(-1), torch.logsumexp(gathered, dim=-1), norm)
    return picked - norm


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ratio_cap: float = 4.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    normaliser: float | None = None,
) -> LossTerms:
    """Clipped, truncated surrogate (+ optional KL), summed over masked tokens / normaliser.

    All tensors are [B, T]; `advantages` is the sample's advantage repeated on its tokens.
    """
    mask = mask.float()
    advantages = advantages.float()
    ratio = importance_ratio(logp, behaviour_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    surrogate = torch.min(unclipped, clipped)
    surrogate = torch.where(advantages < 0, torch.max(surrogate, ratio_cap * advantages), surrogate)
    per_token = -surrogate
    kl = torch.zeros_like(per_token)
    if ref_logp is not None and kl_coef > 0:
        log_ref_ratio = ref_logp.float() - logp
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        per_token = per_token + kl_coef * kl
    count = float(mask.sum())
    denominator = normaliser if normaliser is not None else max(count, 1.0)
    loss = (per_token * mask).sum() / denominator
    with torch.no_grad():
        real = mask > 0
        r = ratio[real]
        a = advantages[real]
        was_clipped = ((a > 0) & (r > 1 + clip_high)) | ((a < 0) & (r < 1 - clip_low))
        was_truncated = (a < 0) & (r > ratio_cap)
    return LossTerms(
        loss=loss,
        tokens=int(count),
        ratio_sum=float(r.sum()) if r.numel() else 0.0,
        ratio_min=float(r.min()) if r.numel() else 1.0,
        ratio_max=float(r.max()) if r.numel() else 1.0,
        clipped=int(was_clipped.sum()),
        truncated=int(was_truncated.sum()),
        kl_sum=float((kl * mask).sum().detach()),
    )


def clipped_loss(batch: LossBatch, cfg: LossSettings) -> LossTerms:
    """The loss registered as "clipped": `policy_loss` with the run's clip, cap and KL weight."""
    return policy_loss(
        batch.logp,
        batch.behaviour_logp,
        batch.advantages,
        batch.mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        ratio_cap=cfg.ratio_cap,
        ref_logp=batch.ref_logp,
        kl_coef=cfg.kl_coef,
        normaliser=batch.normaliser,
    )
