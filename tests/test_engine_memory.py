"""Memory as the replica's load, never its fault: KV-token admission and out-of-memory.

The transformers engine in-process on the tiny model. Out-of-memory is injected (a CPU has
no CUDA allocator to exhaust): the engine's forward raises torch.OutOfMemoryError at the
step a test chooses, part-way through the model for a decode step (as a real OOM leaves
its keys and values appended to the cache). Independent computation: the same seeded
groups run alone, without any injection.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
import torch
from support.engines import collect

from rollwire.common.errors import InvalidArgument, ResourceExhausted
from rollwire.generator.engines import transformers_engine as te
from rollwire.generator.types import GroupRequest, SamplingParams, TokenDelta

pytestmark = pytest.mark.asyncio(loop_scope="module")


def group(rid: str, n: int = 2, tokens: int = 12, seed: int = 1) -> GroupRequest:
    return GroupRequest(rid, [5, 17, 33], n, SamplingParams(max_new_tokens=tokens, seed=seed, ignore_eos=True))


async def started(engine, g: GroupRequest):
    """Start `g` and return once its first tokens came (it is admitted and decoding), with a
    task that collects the rest: tokens per sample."""
    stream = engine.generate(g)
    first = await anext(stream)
    tokens: dict[int, list[int]] = {}

    async def rest() -> dict[int, list[int]]:
        for events in [first, *[e async for e in stream]]:
            for ev in events:
                if isinstance(ev, TokenDelta):
                    tokens.setdefault(ev.sample_index, []).extend(ev.token_ids)
        return tokens

    return asyncio.create_task(rest())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model):
    eng = te.TransformersEngine(tiny_model, max_batch_rows=64, max_batch_tokens=200, threads=1)
    await eng.start()
    yield eng
    await eng.close()


async def test_a_group_that_can_never_fit_is_refused_up_front_and_others_wait_for_room(engine):
    with pytest.raises(InvalidArgument, match="KV cache") as err:
        await collect(engine, group("huge", n=8, tokens=40))  # 8 x 43 > 200
    assert err.value.reason == "KV_BUDGET"
    # 4 groups of 2 x 15 = 30 tokens each fit 6 at a time: all complete, whatever waits.
    results = await asyncio.gather(*(collect(engine, group(f"g{i}", seed=i)) for i in range(8)))
    assert all(len(r["tokens"][i]) == 12 for r in results for i in range(2))


async def test_out_of_memory_ends_only_the_groups_admitted_last(engine, monkeypatch):
    alone = {seed: await collect(engine, group(f"alone{seed}", seed=seed, tokens=20)) for seed in (1, 2)}
    real_forward = engine._forward
    armed = {"decode_rows": None}

    def forward(adapters, **inputs):
        rows = len(adapters)
        if inputs["input_ids"].shape[1] == 1 and rows == armed["decode_rows"]:
            armed["decode_rows"] = None  # once
            # the step appends its keys and values to the cache, then memory runs out
            out = real_forward(adapters, **inputs)
            del out
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_forward(adapters, **inputs)

    monkeypatch.setattr(engine, "_forward", forward)
    armed["decode_rows"] = 4  # the first decode step that carries both groups' rows
    first = await started(engine, group("first", seed=1, tokens=20))  # admitted before the second
    second = asyncio.create_task(collect(engine, group("second", seed=2, tokens=20)))
    with pytest.raises(ResourceExhausted) as err:
        await second
    assert err.value.reason == "ENGINE_OOM" and err.value.retry_after_s
    # The group admitted earlier went on as if nothing happened: the same tokens as alone.
    assert await first == alone[1]["tokens"]
    monkeypatch.setattr(engine, "_forward", real_forward)
    after = await collect(engine, group("after", seed=2, tokens=20))  # the engine is healthy
    assert after["tokens"] == alone[2]["tokens"]


async def test_out_of_memory_in_a_prefill_ends_only_that_prefills_groups(engine, monkeypatch):
    real_forward = engine._forward

    def forward(adapters, **inputs):
        if inputs["input_ids"].shape[1] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_forward(adapters, **inputs)

    running = await started(engine, group("running", seed=3, tokens=30))
    monkeypatch.setattr(engine, "_forward", forward)
    with pytest.raises(ResourceExhausted):
        await collect(engine, group("doomed", seed=4))
    monkeypatch.setattr(engine, "_forward", real_forward)
    assert all(len(t) == 30 for t in (await running).values())
