"""The sampling transform, in one place, and the logprob it reports.

For temperature T > 0 the distribution sampled from is
    p = softmax(mask(logits / T))
where mask keeps the top-k logits (k > 0) and then the smallest set of most likely tokens
whose probability under softmax(logits / T) reaches top_p (the most likely token is always
kept), setting the rest to -inf. The reported logprob of a sampled token is log p[token]:
exactly the distribution it was drawn from. With T = 1, top_k = 0, top_p = 1 this is the
model's plain log-softmax, which is what a learner recomputes. For T = 0 the token is the
argmax and the reported logprob is the untempered log_softmax(logits)[token].

Every function takes one SamplingParams for all rows or one per row, so an engine samples
all the rows of a batch (rows of different requests with different params) in one call.
Rows never mix: each row's result is the same float operations on that row alone, so a
row's logprobs and token do not depend on what else is in the call.

Drawing (`draw`): a row with T > 0 takes one uniform u in [0, 1) per token (and nothing
else) from its own
generator (`sample_generator`: Python's Mersenne Twister seeded with sample_seed(s, i) for
sample i of a group seeded s) and
picks the token whose interval of the cumulative distribution (float64) holds u·total, so
a token of probability 0 is never drawn. Greedy rows draw nothing. Which token a seed gives
depends only on the row's own distribution and generator, never on batching. So a sample
continued after k tokens (`skip_draws`) draws on exactly as it would have unsplit.

Bounds (checked at the edge by the servicer, documented in docs/protocol.md): temperature
is 0 or in [MIN_TEMPERATURE, MAX_TEMPERATURE] (a tiny T overflows logits / T to inf in
float32 and the distribution becomes NaN, as 1e-45 did; below 1e-3 sampling is greedy in
all but name, so ask for 0); top_p is finite and in (0, 1]; top_k
is 0 (off) up to the vocabulary size; any uint64 seed (sample_seed reduces it below 2**63,
so every engine's seeding, SGLang's included, takes it). The engine still checks what it samples
from (`nonfinite_rows`), so a value that slips past the edge fails its own group only.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from rollwire.generator.types import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams  # noqa: F401 (the bounds)

Params = SamplingParams | Sequence[SamplingParams]  # one for every row, or one per row


def _per_row(params: Params, rows: int) -> Sequence[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * rows
    if len(params) != rows:
        raise ValueError(f"{len(params)} sampling params for {rows} rows")
    return params


def _shared(params: Params) -> SamplingParams | None:
    """The params every row shares (the common case: one call, scalar arithmetic), else None."""
    if isinstance(params, SamplingParams):
        return params
    first = params[0]
    key = (first.temperature, first.top_p, first.top_k)
    for p in params:
        if p is not first and (p.temperature, p.top_p, p.top_k) != key:
            return None
    return first


def sampling_logprobs(logits: torch.Tensor, params: Params) -> torch.Tensor:
    """Log-probabilities [rows, vocab] of the distribution actually sampled from."""
    logits = logits.float()
    if not len(logits):
        return torch.log_softmax(logits, dim=-1)
    shared = _shared(params)
    if shared is not None:
        return _logprobs(logits, shared)
    return _logprobs_per_row(logits, _per_row(params, len(logits)))


def _logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        scaled = scaled.masked_fill(_outside_top_p(scaled, torch.tensor(params.top_p)), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def _logprobs_per_row(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`_logprobs` with each row's own params: the same float operations, row by row."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, device=logits.device)
        values = torch.topk(scaled, max(top_k), dim=-1).values
        kth = values.gather(-1, (k - 1).clamp(min=0)[:, None])
        kth = kth.masked_fill((k == 0)[:, None], float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    if bool((top_p < 1.0).any()):
        drop = _outside_top_p(scaled, top_p[:, None]) & (top_p < 1.0)[:, None]
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.where(greedy[:, None], torch.log_softmax(logits, dim=-1), torch.log_softmax(scaled, dim=-1))


def _outside_top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens past the smallest most-likely set whose mass reaches top_p (the top one stays)."""
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def finite(logprobs: torch.Tensor) -> bool:
    """Whether a distribution can be sampled from: no NaN and no +inf (-inf = masked)."""
    return not bool(nonfinite_rows(logprobs).any())


def nonfinite_rows(logprobs: torch.Tensor) -> torch.Tensor:
    """[rows] bool: the rows whose distribution holds NaN or +inf (nothing can be drawn)."""
    return (torch.isnan(logprobs) | torch.isposinf(logprobs)).any(dim=-1)


def row_uniforms(params: Params, generators: Sequence[random.Random]) -> torch.Tensor:
    """[rows] float64: one uniform from each sampling row's own generator; greedy rows get 0
    and leave their generator untouched (so greedy steps do not shift a seeded stream)."""
    rows = _per_row(params, len(generators))
    values = [g.random() if p.temperature != 0 else 0.0 for p, g in zip(rows, generators, strict=True)]
    return torch.tensor(values, dtype=torch.float64)


def skip_draws(params: SamplingParams, generator: random.Random, steps: int) -> random.Random:
    """Advance a row's generator past `steps` sampling steps, as `row_uniforms` would have:
    one uniform a step for a row with T > 0, none for a greedy one. A sample resumed after k
    tokens (GenerateRequest.resume) then draws exactly the uniforms an uninterrupted row
    draws from its (k+1)-th token on. Mersenne Twister has no jump for random(), so this is k
    draws (~50 ns each: 4096 tokens cost ~0.2 ms, once per resumed sample)."""
    if params.temperature != 0:
        for _ in range(steps):
            generator.random()
    return generator


def sample_generator(seed: int, index: int) -> random.Random:
    """The generator of sample `index` in a group seeded with `seed`. Python guarantees that
    random.Random(int).random() yields the same sequence in every version, so a seed means
    the same draws on every replica; it costs ~50 ns a draw, against ~2 us for a torch one."""
    return random.Random(sample_seed(seed, index))


def inverse_cdf(logprobs: torch.Tensor, params: Params, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows] token ids: argmax for greedy rows, else the token whose slice of the row's
    cumulative distribution holds uniform·total. A token of probability 0 owns an empty
    slice, so it is never returned while the row has any mass."""
    rows = _per_row(params, len(logprobs))
    greedy = [p.temperature == 0 for p in rows]
    argmax = torch.argmax(logprobs, dim=-1)
    if all(greedy):
        return argmax
    cdf = torch.cumsum(logprobs.double().exp(), dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.to(cdf.device)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=logprobs.shape[-1] - 1)
    if any(greedy):
        tokens = torch.where(torch.tensor(greedy, device=tokens.device), argmax, tokens)
    return tokens


def draw(logprobs: torch.Tensor, params: Params, generators: Sequence[random.Random]) -> torch.Tensor:
    """One token per row; row i draws its uniform from generators[i] (see the module docstring)."""
    return inverse_cdf(logprobs, params, row_uniforms(params, generators))


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` in a group seeded with `seed` (stable, documented)."""
    return (seed * 1_000_003 + index) % (2**63 - 1)


def sample_seeds(seed: int | None, per_sample: Sequence[int], n: int) -> list[int] | None:
    """The seed of each of a group's n samples: sample_seed(seed, i), or with per-sample seeds
    (SamplingParams.sample_seeds) sample_seed(per_sample[i], 0), so each draws as it would
    alone; None when the group is unseeded."""
    if per_sample:
        return [sample_seed(s, 0) for s in per_sample]
    return None if seed is None else [sample_seed(seed, i) for i in range(n)]
