"""The KL term's reference from the replicas (train.kl_reference = "replicas"): the trainer uses
the base-model logprobs it is given exactly as it would use its own, and what config allows."""

from __future__ import annotations

import pytest
import torch
from test_learner_trainer import groups, make
from transformers import AutoModelForCausalLM

from rollwire.learner.config import LearnerConfig
from rollwire.learner.rollouts.groups import ScoredGroup
from rollwire.learner.train.reference import MAX_SEQUENCES, MAX_TOKENS, packed


def base_logprobs(tiny_model, data: list[ScoredGroup]) -> list[list[float]]:
    """Each sample's tokens' logprobs under the plain base model (no PEFT at all): the
    independent computation a replica's Score stands for."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for g in data:
            for s in g.samples:
                ids = torch.tensor([list(g.prompt_ids) + list(s.token_ids)])
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                first = len(g.prompt_ids) - 1
                out.append([float(logp[first + j, t]) for j, t in enumerate(s.token_ids)])
    return out


def stepped_twice(tiny_model, reference: str, wrong: bool = False):
    trainer = make(tiny_model, kl_coef=0.5)
    stats = []
    for version in (1, 2):
        data = groups(trainer)
        if reference == "given":
            scored = iter(base_logprobs(tiny_model, data))
            for g in data:
                for s in g.samples:
                    s.ref_logprobs = [v - 5.0 for v in next(scored)] if wrong else next(scored)
        stats.append(trainer.step(data, version=version))
    return stats, trainer.adapter_payload()


def test_given_base_logprobs_train_exactly_as_the_learners_own(tiny_model):
    (own1, own2), _ = stepped_twice(tiny_model, "own")
    (given1, given2), _ = stepped_twice(tiny_model, "given")
    assert own2.kl > 0  # the second step has a policy apart from the base: the KL term is live
    assert given1.kl == pytest.approx(own1.kl, abs=1e-6) and given2.kl == pytest.approx(own2.kl, rel=1e-4)
    assert given2.loss == pytest.approx(own2.loss, rel=1e-4, abs=1e-6)
    # and the given values are what the loss reads: a reference 5 nats off changes the KL
    (_, wrong2), _ = stepped_twice(tiny_model, "given", wrong=True)
    assert abs(wrong2.kl - own2.kl) > 1.0


def test_a_sample_without_given_logprobs_makes_the_trainer_compute_them(tiny_model):
    (_, own2), own_payload = stepped_twice(tiny_model, "own")
    trainer = make(tiny_model, kl_coef=0.5)
    for version in (1, 2):
        data = groups(trainer)
        data[0].samples[0].ref_logprobs = [-50.0] * len(data[0].samples[0].token_ids)  # one sample only: unused
        last = trainer.step(data, version=version)
    assert last.kl == pytest.approx(own2.kl, rel=1e-4)
    assert trainer.adapter_payload() == own_payload


@pytest.mark.parametrize("field,value", [("temperature", 0.7), ("top_k", 5), ("top_p", 0.9)])
def test_replicas_reference_needs_untempered_untruncated_rollouts(field, value):
    with pytest.raises(ValueError, match="kl_reference = 'replicas' needs rollout.temperature = 1"):
        LearnerConfig(base_model="/m", train={"kl_reference": "replicas"}, rollout={field: value})
    assert LearnerConfig(base_model="/m", train={"kl_reference": "replicas"}).train.kl_reference == "replicas"


def test_requests_stay_within_the_replicas_score_limits():
    class S:
        def __init__(self, n):
            self.token_ids = [1] * n

    samples = [([1] * p, S(t)) for p, t in [(10, 20)] * 70 + [(4000, 9000), (3000, 100)] + [(2, 2)] * 5]
    chunks = packed(samples)
    assert [x for c in chunks for x in c] == samples  # every sample once, in order
    for c in chunks:
        assert 1 <= len(c) <= MAX_SEQUENCES
        assert sum(len(p) + len(s.token_ids) for p, s in c) <= MAX_TOKENS or len(c) == 1
