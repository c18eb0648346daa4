"""The learner's probe (publisher.probe_of): its numbers against an independent teacher-forced pass,
the model's mode left as it was, the probe pushed with its version, and a replica's proof passing
on it (the real transformers engine, in-process): what a learner with publish_probe publishes is
what an honest replica computes, from the run's first version (its starting weights) on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from typing import cast

import pytest
import torch
from support.engines import forward_logprobs
from support.fake_target import FakeTarget
from support.wire import make_adapter, peft_reference

from rollwire.client import AsyncClient
from rollwire.common import probe as probes
from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.lora import LoraShape
from rollwire.common.manifest import Manifest, manifest_from_pb
from rollwire.generator.adapters import AdapterRegistry
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.metrics import GeneratorMetrics
from rollwire.generator.proof import Prover
from rollwire.learner.config import LearnerConfig
from rollwire.learner.publish.publisher import Publisher, probe_of
from rollwire.learner.rollouts.buffer import Signal
from rollwire.learner.run.loop import train
from rollwire.learner.run.wiring import open_session
from rollwire.learner.tasks.task import Example, write_jsonl
from rollwire.runtime.config import load_config


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


async def test_a_learner_run_publishes_every_version_from_the_first_with_a_probe_a_replica_proves(tiny_model, tmp_path):
    """A run with publish_probe (through wiring.open_session and the loop, against support/fake_target.py,
    which keeps each push's manifest as the SDK builds it): the starting weights (v1, publish_start)
    carry their probe as the trained version (v2) does, and a real transformers replica's registry
    proves both within its 1e-4 before serving them."""
    examples = [Example(i, f"q{i}", str(i % 7)) for i in range(8)]
    write_jsonl(tmp_path / "train.jsonl", examples)
    answers = {e.prompt: e.answer for e in examples}
    cfg = load_config(
        LearnerConfig,
        None,
        [
            f"base_model={tiny_model}",
            "target=127.0.0.1:1",  # never dialled: the session is given the fake as its client
            f"run_dir={tmp_path / 'run'}",
            "adapter_name=policy",
            "publish_probe=true",
            "max_steps=1",
            "task.kind=jsonl",
            f"task.train_path={tmp_path / 'train.jsonl'}",
            "train.threads=1",
            "train.groups_per_step=2",
            "rollout.n=2",
            "rollout.groups_in_flight=2",
            "eval.at_start=false",
            "eval.at_end=false",
        ],
    )
    target = FakeTarget(model_fingerprint(tiny_model), lambda prompt: [answers[prompt], "wrong"])
    session = await open_session(cfg, False, client=cast(AsyncClient, target))
    try:
        await train(session)
    finally:
        await session.close()
    assert target.pushed == [1, 2]
    for version, sent in target.manifests.items():
        assert sent.HasField("probe"), f"version {version} was pushed without its probe"
        assert sent.probe.seed == version and len(sent.probe.sequences) == 4
    engine = te.TransformersEngine(tiny_model, max_batch_rows=16, threads=1)
    await engine.start()
    try:
        prover = Prover(engine, GeneratorMetrics(), trusted=False, replica="r")
        registry = AdapterRegistry(engine.load_adapter, engine.unload_adapter, window=2, prove=prover.prove)
        for version in (1, 2):
            payload = target.payloads[version]
            m = dataclasses.replace(  # the receiver names the sha256 of an unsigned version from the bytes
                manifest_from_pb(target.manifests[version]), sha256=hashlib.sha256(payload).hexdigest()
            )
            await registry.push(m, payload)
            proof = prover.proofs[("policy", version)]
            assert proof.outcome == probes.PASSED and proof.max_abs_gap <= 1e-4, (version, proof)
        assert registry.loaded() == {"policy": [1, 2]}
    finally:
        await engine.close()
