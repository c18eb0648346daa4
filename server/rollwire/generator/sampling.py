"""The sampling transform, in one place, and the logprob it reports.

For temperature T > 0 the distribution sampled from is
    p = softmax(mask(logits / T))
where mask keeps the top-k logits (k > 0) and then the smallest set of most likely tokens
whose probability under softmax(logits / T) reaches top_p (the most likely token is always
kept), setting the rest to -inf. The reported logprob of a sampled token is log p[token]:
exactly the distribution it was drawn from. With T = 1, top_k = 0, top_p = 1 this is the
model's plain log-softmax, which is what a learner recomputes. For T = 0 the token is the
argmax and the reported logprob is the untempered log_softmax(logits)[token].

Bounds (checked at the edge by the servicer, documented in docs/protocol.md): temperature
is 0 or in [MIN_TEMPERATURE, MAX_TEMPERATURE] (a tiny T overflows logits / T to inf in
float32 and the distribution becomes NaN, as 1e-45 did; below 1e-3 sampling is greedy in
all but name, so ask for 0); top_p is finite and in (0, 1]; top_k
is 0 (off) up to the vocabulary size; any uint64 seed (sample_seed reduces it below 2**63,
so torch.Generator.manual_seed never overflows). The engine still checks what it samples
from (`finite`), so a value that slips past the edge fails its own group only.
"""

from __future__ import annotations

import torch

from rollwire.generator.types import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams  # noqa: F401 (the bounds)


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [rows, vocab] of the distribution actually sampled from."""
    logits = logits.float()
    if params.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def finite(logprobs: torch.Tensor) -> bool:
    """Whether a distribution can be sampled from: no NaN and no +inf (-inf = masked)."""
    return not bool((torch.isnan(logprobs) | torch.isposinf(logprobs)).any())


def draw(logprobs: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row; row i uses generators[i] so samples do not depend on batching."""
    if params.temperature == 0:
        return torch.argmax(logprobs, dim=-1)
    probs = logprobs.exp()
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` in a group seeded with `seed` (stable, documented)."""
    return (seed * 1_000_003 + index) % (2**63 - 1)
