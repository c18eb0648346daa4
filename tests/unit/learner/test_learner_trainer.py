"""The trainer's step on the tiny model: ratios, accumulation, the adapter it pushes."""

from __future__ import annotations

import pytest
import torch

from rollwire.learner.config import TrainSection
from rollwire.learner.rollouts.groups import ScoredGroup, ScoredSample
from rollwire.learner.tasks.task import Example
from rollwire.learner.train.trainer import Trainer


def groups(trainer: Trainer | None, count=2, n=4) -> list[ScoredGroup]:
    out = []
    for g in range(count):
        samples = [
            ScoredSample([40 + i, 41 + g, 2], [-1.0] * 3, [1, 1, 1], "x", "eos", float((i + g) % 2), False)
            for i in range(n)
        ]
        out.append(ScoredGroup(Example(g, "p", "a"), [10 + g, 11, 12, 13], samples, 1))
    if trainer is not None:  # behaviour logprobs = the trainer's own: the on-policy case
        for g, lps in zip(out, _chunks(trainer.recompute_logprobs(out), n), strict=False):
            for s, lp in zip(g.samples, lps, strict=False):
                s.logprobs = lp
    return out


def _chunks(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


def make(tiny_model, **kw) -> Trainer:
    return Trainer(tiny_model, TrainSection(**{"lr": 1e-2, "groups_per_step": 2, **kw}), 1.0, seed=0)


def test_on_policy_ratio_is_one_and_a_step_changes_the_adapter(tiny_model):
    trainer = make(tiny_model)
    before = trainer.adapter_payload()
    stats = trainer.step(groups(trainer), version=1)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert stats.ratio_mean_fresh == pytest.approx(1.0, abs=1e-5)
    assert stats.fresh_tokens == stats.tokens == 2 * 4 * 3
    assert stats.grad_norm > 0
    assert trainer.adapter_payload() != before


def test_gradient_accumulation_matches_one_big_batch(tiny_model):
    whole, split = make(tiny_model, micro_batch_groups=2), make(tiny_model, micro_batch_groups=1)
    data = groups(whole)
    start = {name: p.detach().clone() for name, p in whole.model.named_parameters() if p.requires_grad}
    whole.step(data, version=1)
    split.step(data, version=1)
    moved = 0.0
    for (name, a), (other, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        assert name == other
        if a.requires_grad:
            assert torch.allclose(a, b, atol=1e-6), name
            moved = max(moved, float((a.detach() - start[name]).abs().max()))
    # the step moved the adapter by far more than the tolerance (a step that did nothing would pass above)
    assert moved > 1e-3, moved


def test_adapter_payload_has_peft_keys_and_round_trips(tiny_model):
    from safetensors.torch import load

    trainer = make(tiny_model)
    trainer.step(groups(trainer), version=1)
    tensors = load(trainer.adapter_payload())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    other = make(tiny_model)
    other.load_adapter(trainer.adapter_payload())
    assert other.adapter_payload() == trainer.adapter_payload()


def test_the_payload_holds_the_weights_after_every_step_as_peft_reads_them(tiny_model):
    """The trainer keeps PEFT's adapter state dict between payloads: it must follow the
    optimiser's in-place updates, step after step."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load

    trainer = make(tiny_model)
    assert trainer._adapter_views is not None  # else the kept views are not what is tested here
    seen = set()
    for version in (1, 2, 3):
        trainer.step(groups(trainer), version=version)
        sent = load(trainer.adapter_payload())
        fresh = get_peft_model_state_dict(trainer.model)
        assert sent.keys() == fresh.keys()
        assert all(torch.equal(sent[k], fresh[k]) for k in fresh)
        seen.add(trainer.adapter_payload())
    assert len(seen) == 3


def test_kl_is_zero_before_training_and_positive_after(tiny_model):
    trainer = make(tiny_model, kl_coef=0.1)
    first = trainer.step(groups(trainer), version=1)
    assert first.kl == pytest.approx(0.0, abs=1e-7)  # LoRA B starts at zero: policy == reference
    second = trainer.step(groups(trainer), version=2)
    assert second.kl > 0


def test_tokens_older_than_the_token_limit_never_reach_the_loss(tiny_model):
    """buffer.max_token_staleness masks a following sample's old tokens, whatever their
    behaviour logprobs say: the step equals the step on the same samples with their fresh
    tokens only, and its stats count what was masked."""

    def followed(behaviour_of_old: float) -> list[ScoredGroup]:
        data = groups(None)
        for g in data:
            for s in g.samples:
                s.token_versions = [1, 5, 5]  # the first token came from version 1, the rest from 5
                s.logprobs = [behaviour_of_old, -1.0, -1.0]
        return data

    def step(behaviour_of_old: float):
        trainer = Trainer(tiny_model, TrainSection(lr=1e-2, groups_per_step=2), 1.0, seed=0, max_token_staleness=2)
        stats = trainer.step(followed(behaviour_of_old), version=5)
        return stats, trainer.adapter_payload()

    (a, payload_a), (b, payload_b) = step(-1.0), step(-9.0)
    assert a.stale_tokens_masked == b.stale_tokens_masked == 2 * 4
    assert a.token_staleness_max == 4 and a.token_staleness_mean == pytest.approx(4 / 3)
    assert a.loss == pytest.approx(b.loss, abs=1e-7) and payload_a == payload_b
    unmasked = Trainer(tiny_model, TrainSection(lr=1e-2, groups_per_step=2), 1.0, seed=0).step(
        followed(-9.0), version=5
    )
    assert unmasked.stale_tokens_masked == 0 and unmasked.loss != pytest.approx(a.loss, abs=1e-4)


def test_a_token_one_version_past_the_token_limit_never_reaches_the_loss(tiny_model):
    """The limit's edge: with buffer.max_token_staleness 2 and the batch trained at version 5, a
    token of version 3 (2 behind) is trained, one of version 2 (3 behind: one past the limit)
    is not, whatever its behaviour logprob says."""

    def step(past: float, edge: float):
        data = groups(None)
        for g in data:
            for s in g.samples:
                s.token_versions = [2, 3, 5]
                s.logprobs = [past, edge, -1.0]
        trainer = Trainer(tiny_model, TrainSection(lr=1e-2, groups_per_step=2), 1.0, seed=0, max_token_staleness=2)
        stats = trainer.step(data, version=5)
        return stats, trainer.adapter_payload()

    (a, payload_a), (b, payload_b), (c, payload_c) = step(-1.0, -1.0), step(-9.0, -1.0), step(-1.0, -9.0)
    assert a.stale_tokens_masked == b.stale_tokens_masked == 2 * 4  # one token of each sample
    assert a.loss == pytest.approx(b.loss, abs=1e-7) and payload_a == payload_b  # version 2 reaches nothing
    assert c.loss != pytest.approx(a.loss, abs=1e-4) and payload_c != payload_a  # version 3 is trained


def test_the_default_targets_are_every_linear_layer_of_each_architecture(tmp_path):
    """train.target_modules [] (the default): the learner's adapter covers each zoo model's own linear
    layers (GPT-2's Conv1D, fused projections; a MoE model's attention only), nothing the replicas
    refuse: the adapter it would push passes the push checks against the layers the replica derives."""
    import hashlib

    from support.zoo import MOE

    from rollwire.common.manifest import Manifest
    from rollwire.demo.zoo import build_zoo
    from rollwire.generator.shapes import base_linear_shapes
    from rollwire.push.checks import check_payload

    zoo = build_zoo(tmp_path)
    expected = {"llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}
    expected |= {
        "gpt2": {"c_attn", "c_proj", "c_fc"},
        "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
    }
    for name, folder in zoo.items():
        trainer = Trainer(folder, TrainSection(), 1.0, seed=0)
        targets = set(trainer.targets)
        assert targets and "lm_head" not in targets and "embed_out" not in targets, (name, targets)
        if name in expected:
            assert targets == expected[name], (name, targets)
        if name in MOE:
            assert not targets & {"gate", "experts", "router"}, targets
        payload = trainer.adapter_payload()
        manifest = Manifest(name, 1, "fp", trainer.lora_shape, len(payload), hashlib.sha256(payload).hexdigest())
        check_payload(manifest, payload, base_linear_shapes(folder))
