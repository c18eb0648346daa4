"""The transformers engine's Score in-process (transformers_score.py): its logprobs and top-k
against an independent teacher-forced forward pass of the tiny model and of a local PEFT model,
however its sequences are packed into passes, and a Score between the decode steps of running
groups changing nothing about their samples.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from support.engines import collect, forward_logprobs, manifest_for
from support.wire import make_adapter, peft_reference

from rollwire.common.errors import InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.engines.embedded.transformers_score import plan_passes
from rollwire.generator.types import AdapterSelection, GroupRequest, SamplingParams, ScoreJob

EXACT = 1e-5
"""The engine's float32 pass against the reference's: batching and padding move the sums by ulps."""
ADAPTER_SCALE = 0.1
"""LoRA weights drawn at this scale change the logprobs by ~0.1-1 yet keep the activations at the
base model's size; at support.wire's default 0.5 they reach ~4000 after one layer, and float32
rounding of those (PEFT's summation order against the engine's) alone moves logprobs by up to 2e-4
(measured on the tiny model, 2026-12-06), whatever computes them."""


@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model):
    eng = te.TransformersEngine(tiny_model, max_batch_rows=64, threads=1, score_batch_tokens=40)
    await eng.start()
    yield eng
    await eng.close()


def sequences(engine) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Sequences of unequal lengths: with score_batch_tokens 40 they need several passes, padded."""
    texts = [("12+34=", "46"), ("a", "bcdefghij"), ("hello there ", "x"), ("7*8=", "56 and more")]
    return tuple((tuple(engine.tokenize(p)), tuple(engine.tokenize(c))) for p, c in texts)


def reference_top(model, prompt, continuation, k):
    ids = torch.tensor([[*prompt, *continuation]])
    with torch.no_grad():
        lsm = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    return lsm.topk(k, -1)


def test_passes_hold_every_sequence_once_within_the_bound():
    lengths = [5, 30, 12, 12, 50, 1, 7]
    passes = plan_passes(lengths, 40)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    for p in passes:
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 40
    assert [4] in passes  # longer than the bound: a pass of its own


async def test_base_logprobs_and_top_k_equal_a_teacher_forced_pass(engine, reference_model):
    seqs = sequences(engine)
    assert len(plan_passes([len(p) + len(c) for p, c in seqs], 40)) > 1
    scores = await engine.score(ScoreJob("score-base", seqs, top_k=3))
    for (prompt, continuation), got in zip(seqs, scores, strict=True):
        want = forward_logprobs(reference_model, list(prompt), list(continuation))
        assert torch.allclose(torch.tensor(got.logprobs), want, atol=EXACT), (prompt, continuation)
        values, index = reference_top(reference_model, prompt, continuation, 3)
        assert got.top_ids == index.tolist()
        assert torch.allclose(torch.tensor(got.top_logprobs), values, atol=EXACT)
    assert all(s.top_ids == [] for s in await engine.score(ScoreJob("score-no-top", seqs[:1])))


async def test_adapter_logprobs_equal_a_teacher_forced_peft_pass(engine, tiny_model):
    a = make_adapter(tiny_model, seed=37, r=4, scale=ADAPTER_SCALE)
    await engine.load_adapter("sc-a", manifest_for(a, "sc", 1), a.payload)
    try:
        seqs = sequences(engine)
        scores = await engine.score(ScoreJob("score-adapter", seqs, adapter=AdapterSelection("sc", 1, "sc-a")))
        peft = peft_reference(tiny_model, a)
        for (prompt, continuation), got in zip(seqs, scores, strict=True):
            want = forward_logprobs(peft, list(prompt), list(continuation))
            assert torch.allclose(torch.tensor(got.logprobs), want, atol=EXACT)
        base = await engine.score(ScoreJob("score-base-again", seqs))
        assert any(  # the adapter really changed the numbers
            not torch.allclose(torch.tensor(b.logprobs), torch.tensor(s.logprobs), atol=1e-3)
            for b, s in zip(base, scores, strict=True)
        )
    finally:
        await engine.unload_adapter("sc-a")


async def test_a_score_between_decode_steps_changes_no_running_sample(engine):
    g = GroupRequest("score-beside", engine.tokenize("abc"), 2, SamplingParams(100, seed=5, ignore_eos=True))
    alone = await collect(engine, g)
    running = asyncio.create_task(collect(engine, g))

    async def decoding() -> None:  # the engine's own count: no event to await
        while not engine.stats().running:
            await asyncio.sleep(0.001)

    await asyncio.wait_for(decoding(), 30)
    scores = await asyncio.wait_for(engine.score(ScoreJob("score-during", sequences(engine) * 3)), 60)
    beside = await asyncio.wait_for(running, 60)
    assert len(scores) == 12
    assert beside["tokens"] == alone["tokens"]
    for i, lps in alone["logprobs"].items():
        assert torch.allclose(torch.tensor(beside["logprobs"][i]), torch.tensor(lps), atol=EXACT)


async def test_a_sequence_over_the_kv_budget_is_refused_before_any_work(engine, monkeypatch):
    monkeypatch.setattr(engine, "max_batch_tokens", 8)
    with pytest.raises(InvalidArgument) as refused:
        await engine.score(ScoreJob("score-big", ((tuple(range(1, 6)), tuple(range(1, 6))),)))
    assert refused.value.reason == Reason.KV_BUDGET
    assert not engine._scores
