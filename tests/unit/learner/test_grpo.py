"""GRPO arithmetic against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rollwire.learner.config import TrainSection
from rollwire.learner.train.grpo import LOG_RATIO_BOUND, group_advantages, importance_ratio, policy_loss, token_logprobs


def test_advantages_are_centred_and_std_normalised_per_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 2.0]])
    centred = group_advantages(rewards, normalize_std=False)
    assert centred.tolist() == [[0.5, -0.5, -0.5, 0.5], [-1.0, 0.0, 1.0, 0.0]]
    normalised = group_advantages(rewards, normalize_std=True)
    # group 1: population std 0.5; group 2: std sqrt(0.5)
    assert normalised[0].tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    s = math.sqrt(0.5)
    assert normalised[1].tolist() == pytest.approx([-1 / s, 0, 1 / s, 0], abs=1e-5)


def test_equal_rewards_give_zero_advantage_even_normalised():
    assert group_advantages(torch.tensor([[3.0, 3.0, 3.0]]), normalize_std=True).tolist() == [[0.0, 0.0, 0.0]]


def test_token_logprobs_use_fp32_log_softmax_with_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float16)
    tokens = torch.tensor([[1]])
    assert token_logprobs(logits, tokens).item() == pytest.approx(math.log(0.75), abs=1e-3)
    # temperature 2: softmax([0, ln3 / 2]) -> p1 = sqrt(3) / (1 + sqrt(3))
    expected = math.log(math.sqrt(3) / (1 + math.sqrt(3)))
    fp32 = torch.tensor([[[0.0, math.log(3.0)]]])
    assert token_logprobs(fp32, tokens, temperature=2.0).item() == pytest.approx(expected, abs=1e-6)


def one_token(ratio: float, advantage: float, **kw):
    """A single token with importance ratio `ratio`; returns (terms, d loss / d logp)."""
    behaviour = torch.tensor([[math.log(0.4)]])
    logp = (behaviour + math.log(ratio)).requires_grad_(True)
    terms = policy_loss(
        logp, behaviour, torch.tensor([[advantage]]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2, ratio_cap=4.0, **kw
    )
    terms.loss.backward()
    return terms, logp.grad.item()


@pytest.mark.parametrize(
    "ratio, advantage, loss, grad, clipped, truncated",
    [
        (1.0, 1.0, -1.0, -1.0, 0, 0),  # on-policy: plain policy gradient, -A * rho
        (1.5, 1.0, -1.2, 0.0, 1, 0),  # moved up too far on a good token: clipped at 1 + 0.2, no gradient
        (0.5, 1.0, -0.5, -0.5, 0, 0),  # moved down on a good token: unclipped branch is smaller, keeps gradient
        (0.5, -1.0, 0.8, 0.0, 1, 0),  # moved down on a bad token: clipped at 1 - 0.2
        (1.5, -1.0, 1.5, 1.5, 0, 0),  # moved up on a bad token: rho * A is the min, gradient -A * rho
        (5.0, -1.0, 4.0, 0.0, 0, 1),  # far up on a bad token: importance weight truncated at ratio_cap
    ],
)
def test_clipped_truncated_surrogate_on_one_token(ratio, advantage, loss, grad, clipped, truncated):
    terms, g = one_token(ratio, advantage)
    assert terms.loss.item() == pytest.approx(loss, abs=1e-5)
    assert g == pytest.approx(grad, abs=1e-5)
    assert (terms.clipped, terms.truncated) == (clipped, truncated)
    assert terms.ratio_sum == pytest.approx(ratio, rel=1e-5)


def test_loss_is_summed_over_masked_tokens_and_divided_by_the_normaliser():
    behaviour = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]]))
    ratios = torch.tensor([[1.0, 1.1, 9.0], [0.9, 1.0, 9.0]])  # the 9s are padding
    logp = behaviour + torch.log(ratios)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    terms = policy_loss(logp, behaviour, adv, mask, clip_low=0.2, clip_high=0.2, ratio_cap=4.0)
    # per token -min(rho A, clip(rho) A): -1.0, -1.1, +1.8, +2.0 -> sum 1.7, over 4 tokens
    assert terms.loss.item() == pytest.approx(1.7 / 4, abs=1e-5)
    assert terms.tokens == 4
    assert (terms.ratio_min, terms.ratio_max) == (pytest.approx(0.9), pytest.approx(1.1))
    accumulated = policy_loss(logp, behaviour, adv, mask, clip_low=0.2, clip_high=0.2, ratio_cap=4.0, normaliser=10.0)
    assert accumulated.loss.item() == pytest.approx(1.7 / 10, abs=1e-5)


def test_kl_to_the_reference_uses_the_k3_estimator():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    terms = policy_loss(logp, logp, torch.zeros(1, 2), torch.ones(1, 2), ref_logp=ref, kl_coef=0.5)
    k3 = 0.5 - math.log(0.5) - 1  # exp(ref - logp) - (ref - logp) - 1 with ref - logp = ln 0.5; 0 for token 2
    assert terms.kl_sum == pytest.approx(k3, abs=1e-6)
    assert terms.loss.item() == pytest.approx(0.5 * k3 / 2, abs=1e-6)


def test_the_log_ratio_clamp_keeps_every_ratio_and_its_report_finite_in_float32():
    """The bound sits below float32's exp overflow (log of its largest value, ~88.72), so a
    log-ratio of any size gives a finite ratio, and not below log of the largest train.ratio_cap,
    so the clamp changes nothing the surrogate uses (grpo.py's docstring)."""
    (cap_bound,) = [m.le for m in TrainSection.model_fields["ratio_cap"].metadata if hasattr(m, "le")]
    assert math.log(cap_bound) <= LOG_RATIO_BOUND < math.log(torch.finfo(torch.float32).max)
    gaps = torch.tensor([-1e4, -1000.0, -100.0, -89.0, -LOG_RATIO_BOUND, 0.0, LOG_RATIO_BOUND, 89.0, 100.0, 1e4])
    ratio = importance_ratio(gaps, torch.zeros_like(gaps))
    assert ratio.dtype == torch.float32 and bool(torch.isfinite(ratio).all()) and bool((ratio > 0).all())
    assert ratio.max().item() == pytest.approx(math.exp(LOG_RATIO_BOUND), rel=1e-6)
    terms = policy_loss(
        gaps.unsqueeze(0), torch.zeros(1, len(gaps)), torch.ones(1, len(gaps)), torch.ones(1, len(gaps))
    )
    assert math.isfinite(terms.ratio_max) and math.isfinite(terms.ratio_sum) and math.isfinite(terms.loss.item())
