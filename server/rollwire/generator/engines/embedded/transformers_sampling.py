"""Sampling one step of the transformers engine's batch: every row at once, and, when that
raises, group by group with the same uniforms (so the groups that do not raise get exactly
the tokens they would have had; see transformers_engine.py's docstring).

`sample` is pure given the uniforms (drawn before it), so a retry of some rows gives them
the same tokens.
"""

from __future__ import annotations

import torch

from rollwire.common import kept
from rollwire.generator.sampling import inverse_cdf, nonfinite_rows, sampling_logprobs
from rollwire.generator.types import SamplingParams


def sample_by_group(
    rows: list, logits: torch.Tensor, params: list, uniforms: torch.Tensor, failed: dict
) -> tuple[list[int], list[float], list[str | None], list[bytes]]:
    """The whole-batch sampling raised: sample each group alone (same uniforms, so the
    groups that do not raise get the tokens they would have had), and record the ones
    that raise in `failed`."""
    tokens, chosen = [0] * len(rows), [0.0] * len(rows)
    broken: list[str | None] = [None] * len(rows)
    kept_sets = [b""] * len(rows)
    by_group: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_group.setdefault(id(r.group), []).append(i)
    for key, idxs in by_group.items():
        index = torch.tensor(idxs, device=logits.device)
        try:
            t, c, b, ks = sample(logits[index], [params[i] for i in idxs], uniforms[idxs])
        except Exception as exc:
            failed[key] = exc
            continue
        for k, i in enumerate(idxs):
            tokens[i], chosen[i], broken[i], kept_sets[i] = t[k], c[k], b[k], ks[k]
    return tokens, chosen, broken, kept_sets


def sample(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> tuple[list[int], list[float], list[str | None], list[bytes]]:
    """One token per row: the tokens, their logprobs, per row None or where it met NaN/+inf,
    and each row's kept set (`_kept_sets`).

    Pure (the uniforms are drawn before), so a retry of some of the rows gives them the
    same tokens."""
    logprobs = sampling_logprobs(logits, params)
    bad_distribution = nonfinite_rows(logprobs)
    tokens = inverse_cdf(logprobs, params, uniforms)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    bad_token = ~torch.isfinite(chosen)
    broken: list[str | None] = [None] * len(tokens)
    if bool(bad_distribution.any()) or bool(bad_token.any()):
        for i, (dist, tok) in enumerate(zip(bad_distribution.tolist(), bad_token.tolist(), strict=True)):
            if dist:
                broken[i] = "the sampling distribution"
            elif tok:
                broken[i] = "the sampled token's logprob"
    return tokens.tolist(), chosen.tolist(), broken, kept_sets(logprobs, params)


def kept_sets(logprobs: torch.Tensor, params: list[SamplingParams]) -> list[bytes]:
    """Per row that asked for it (return_kept) and was truncated (top-k or top-p, not greedy):
    the ids its distribution kept (finite logprobs), encoded; b"" otherwise (the whole vocabulary)."""
    out = [b""] * len(params)
    for i, p in enumerate(params):
        if p.return_kept and p.temperature > 0 and (p.top_k or p.top_p < 1.0):
            out[i] = kept.encode(torch.isfinite(logprobs[i]).nonzero()[:, 0].tolist())
    return out
