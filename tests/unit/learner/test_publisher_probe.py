"""The learner's probe (publisher.probe_of): its numbers against an independent teacher-forced pass,
the model's mode left as it was, the probe pushed with its version, and a replica's proof passing
on it (the real transformers engine, in-process): what a learner with publish_probe publishes is
what an honest replica computes.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from support.engines import forward_logprobs
from support.wire import make_adapter, peft_reference

from rollwire.common import probe as probes
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.proof import Prover
from rollwire.learner.publish.publisher import Publisher, probe_of
from rollwire.learner.rollouts.buffer import Signal


@pytest.fixture(scope="module")
def learned(tiny_model):
    adapter = make_adapter(tiny_model, seed=81, r=4, scale=0.1)
    return adapter, peft_reference(tiny_model, adapter)


def test_the_probe_is_the_models_own_teacher_forced_logprobs(learned):
    _, model = learned
    model.train()  # as the trainer holds it
    probe = probe_of(model, version=3)
    assert model.training  # its mode is given back
    assert probe.seed == 3 and len(probe.sequences) == 4
    model.eval()
    for s, e in zip(probe.sequences, probe.expected, strict=True):
        want = forward_logprobs(model, list(s.prompt_token_ids), list(s.continuation_token_ids))
        assert torch.allclose(torch.tensor(list(e.logprobs)), want, atol=1e-5)
    probes.check_probe(probe)


async def test_an_honest_replica_passes_the_learners_probe(tiny_model, learned):
    adapter, model = learned
    probe = probe_of(model, version=1)
    engine = te.TransformersEngine(tiny_model, max_batch_rows=16, threads=1)
    await engine.start()
    try:
        prover = Prover(engine, GeneratorMetrics(), trusted=True, replica="r")
        registry = AdapterRegistry(engine.load_adapter, engine.unload_adapter, window=2, prove=prover.prove)
        m = Manifest("policy", 1, "fp", adapter.shape, len(adapter.payload), adapter.sha256, "k", probe=probe)
        await registry.push(m, adapter.payload)
        proof = prover.proofs[("policy", 1)]
        assert proof.outcome == probes.PASSED and proof.max_abs_gap <= 1e-4
    finally:
        await engine.close()


async def test_the_probe_goes_with_its_version_and_is_superseded_with_it():
    sent = []
    release, entered = asyncio.Event(), asyncio.Event()

    class Target:
        async def push_adapter(self, name, version, payload, lora, fingerprint, **kwargs):
            entered.set()
            await release.wait()
            sent.append((version, kwargs.get("probe")))
            return dataclasses.make_dataclass("R", ["replicas", "already_loaded"])([], False)

    pub = Publisher(Target(), "policy", "fp", LoraShape(1, 2.0, ("q_proj",)), Signal(), 0.01)
    first, second, third = (probes.build_probe([([3], [4])], [[-float(v)]], seed=v) for v in (1, 2, 3))
    await pub.publish(1, b"a", probe=first)
    await asyncio.wait_for(entered.wait(), 5)  # the worker is pushing version 1
    await pub.publish(2, b"b", probe=second)
    await pub.publish(3, b"c", probe=third)  # supersedes 2, probe and all
    release.set()
    await asyncio.wait_for(pub.wait_served(3), 5)
    assert [(v, p.seed) for v, p in sent] == [(1, 1), (3, 3)]
