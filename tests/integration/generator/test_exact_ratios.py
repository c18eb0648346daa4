"""Exact importance ratios under top-k/top-p: a real replica reports each token's kept set
(TokenChunk.kept_tokens), and the learner computes its logprob over that same set.

Independent computations: the kept sets against a teacher-forced forward pass with top-k
then top-p applied as docs/protocol.md states; the ratio pi/mu of a learner at the same
weights (staleness 0), which must be 1 over the kept set and is biased over the whole
vocabulary (the naive ratio).
"""

from __future__ import annotations

import math

import pytest
import torch

from rollwire.client import Client
from rollwire.learner.config import TrainSection
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.tasks.task import Example

pytestmark = pytest.mark.integration
TOP_P, TOP_K = 0.8, 20
PROMPTS = ["12+34=", "7+8=", "40+2=", "3+55=", "21+21=", "9+9="]


def kept_by_hand(logits: torch.Tensor, top_k: int, top_p: float) -> list[int]:
    """The ids top-k then top-p keep from one position's logits (temperature 1)."""
    order = torch.argsort(logits, descending=True)[:top_k]
    probs = torch.softmax(logits[order], -1)
    keep, mass = [], 0.0
    for rank, token in enumerate(order.tolist()):
        if rank > 0 and mass >= top_p:
            break
        keep.append(token)
        mass += float(probs[rank])
    return sorted(keep)


@pytest.fixture(scope="module")
def groups(generator):
    with Client(generator.target, timeout=60) as client:
        return [
            client.generate(
                p, 8, max_new_tokens=12, temperature=1.0, top_p=TOP_P, top_k=TOP_K, seed=i, return_kept_tokens=True
            )
            for i, p in enumerate(PROMPTS)
        ]


def test_kept_sets_are_the_truncated_distributions_support(groups, reference_model):
    checked = 0
    for result in groups:
        for sample in result.samples:
            assert len(sample.kept_tokens) == len(sample.token_ids)
            ids = torch.tensor([result.prompt_token_ids + sample.token_ids])
            with torch.no_grad():
                logits = reference_model(input_ids=ids).logits[0, len(result.prompt_token_ids) - 1 : -1]
            for t, (token, kept) in enumerate(zip(sample.token_ids, sample.kept_tokens, strict=True)):
                assert list(kept) == kept_by_hand(logits[t], TOP_K, TOP_P)
                assert token in kept
                renormalised = torch.log_softmax(logits[t][list(kept)], -1)[list(kept).index(token)]
                assert sample.logprobs[t] == pytest.approx(float(renormalised), abs=1e-4)
                checked += 1
    assert checked > 200


def test_the_learners_ratio_is_exact_over_the_kept_set_and_biased_without(groups, tiny_model):
    from rollwire.learner.train.trainer import Trainer

    trainer = Trainer(tiny_model, TrainSection(threads=1), temperature=1.0, seed=0)  # LoRA B = 0: the base model

    def scored(result, with_kept: bool) -> ScoredGroup:
        samples = [
            ScoredSample(
                s.token_ids,
                s.logprobs,
                s.token_versions,
                s.text,
                s.finish_reason,
                0.0,
                False,
                [list(k) for k in s.kept_tokens] if with_kept else [],
            )
            for s in result.samples
        ]
        return ScoredGroup(Example(0, "", ""), result.prompt_token_ids, samples, 0)

    def ratios(with_kept: bool) -> list[float]:
        out = []
        for result in groups:
            group = scored(result, with_kept)
            for sample, logp in zip(group.samples, trainer.recompute_logprobs([group]), strict=True):
                out += [math.exp(p - mu) for p, mu in zip(logp, sample.logprobs, strict=True)]
        return out

    exact, naive = ratios(True), ratios(False)
    assert abs(sum(exact) / len(exact) - 1) < 1e-3
    assert max(abs(r - 1) for r in exact) < 1e-2
    # Over the whole vocabulary pi puts mass on tokens mu never samples: every ratio is < 1.
    assert sum(naive) / len(naive) < 0.95 and max(naive) < 1


def test_served_tokens_are_counted_by_how_stale_their_version_was(generator, tiny_model):
    """rollwire_generator_served_tokens_total: tokens of v1 served after v2 landed are one behind."""
    from support.wire import fingerprint, generate, make_adapter, metric_value, push

    fp = fingerprint(generator.target)
    for version in (1, 2):
        adapter = make_adapter(tiny_model, seed=version, r=2)
        push(generator.target, adapter.manifest("served-staleness", version, fp), adapter.payload)

    def served(behind: str, **default: float) -> float:
        return metric_value(
            generator.metrics(),
            "rollwire_generator_served_tokens_total",
            f'adapter="served-staleness",behind="{behind}"',
            **default,
        )

    # nothing of this adapter was served yet: its labelled series are created by their first token
    before = {b: served(b, default=0.0) for b in ("0", "1")}
    old = generate(generator.target, [5, 6, 7], n=2, adapter=("served-staleness", 1), max_new_tokens=5, ignore_eos=True)
    new = generate(generator.target, [5, 6, 7], n=2, adapter=("served-staleness", 2), max_new_tokens=5, ignore_eos=True)
    assert old.versions == {0: {1}, 1: {1}} and new.versions == {0: {2}, 1: {2}}
    assert served("1") - before["1"] == 10 and served("0") - before["0"] == 10
