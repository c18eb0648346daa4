"""Blast radius on one replica (issue 11): one group's failure is that group's alone, in-process.

A transformers engine whose sampling is made to fail for one group (non-finite values, an
exception, a temperature that slips past the edge) ends that group with a status that names
it, while the groups sharing its forward passes finish exactly as they do alone; request ids
and clipped strings keep their bounds. The same bounds over gRPC on a real replica:
tests/integration/generator/test_row_isolation_wire.py."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import pytest_asyncio
import torch

from rollwire.common.errors import FailedPrecondition, Internal, RollwireError, clip
from rollwire.common.reasons import Reason
from rollwire.generator.engines.embedded import transformers_engine as te
from rollwire.generator.engines.embedded import transformers_sampling
from rollwire.generator.types import GroupRequest, SampleDone, SamplingParams, TokenDelta
from rollwire.runtime.logs import request_id_from
from rollwire.v1 import generator_pb2 as pb

POISON_SEED = 666_666  # groups seeded with this get NaN in one row (the test seam below)
RAISE_SEED = 777_777  # groups seeded with this raise while drawing


# -- in-process engine ------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model):
    eng = te.TransformersEngine(tiny_model, max_batch_rows=64)
    await eng.start()
    yield eng
    await eng.close()


def group(engine, text: str, n: int = 2, **sampling) -> GroupRequest:
    sampling.setdefault("max_new_tokens", 12)
    sampling.setdefault("ignore_eos", True)
    return GroupRequest(f"iso-{text}-{sampling.get('seed')}", engine.tokenize(text), n, SamplingParams(**sampling))


async def run(engine, g: GroupRequest) -> dict:
    """Tokens and logprobs per sample, and the error the group ended with (None when OK)."""
    out = {"tokens": {}, "logprobs": {}, "done": {}, "error": None}
    try:
        async for events in engine.generate(g):
            for ev in events:
                if isinstance(ev, TokenDelta):
                    out["tokens"].setdefault(ev.sample_index, []).extend(ev.token_ids)
                    out["logprobs"].setdefault(ev.sample_index, []).extend(ev.logprobs)
                else:
                    assert isinstance(ev, SampleDone)
                    out["done"][ev.sample_index] = ev
    except RollwireError as err:
        out["error"] = err
    return out


async def cobatched(engine, groups: list[GroupRequest]) -> list[dict]:
    """Run groups so that they are admitted in one prefill and decode together."""
    with engine._cv:  # the worker cannot take pending groups until every one is queued (RLock)
        tasks = [asyncio.create_task(run(engine, g)) for g in groups]
        for _ in range(len(groups) + 2):
            await asyncio.sleep(0)  # each task runs to its first await: queued
        assert len(engine._pending) == len(groups)
    return await asyncio.wait_for(asyncio.gather(*tasks), 60)


def assert_same(alone: dict, together: dict) -> None:
    assert together["error"] is None and alone["error"] is None
    assert together["tokens"] == alone["tokens"]
    for i, lps in alone["logprobs"].items():
        assert torch.allclose(torch.tensor(together["logprobs"][i]), torch.tensor(lps), atol=1e-5), i
    assert sorted(together["done"]) == sorted(alone["done"])


@pytest.fixture
def poison(monkeypatch):
    """The honest seam: the engine's own sampling_logprobs (called with each row's params for
    the whole batch), with NaN injected into one row of the groups seeded POISON_SEED from
    their `at`-th step on, and the draw raising whenever a row of a RAISE_SEED group is in it."""
    real_logprobs, real_inverse_cdf = transformers_sampling.sampling_logprobs, transformers_sampling.inverse_cdf
    steps: dict[int, int] = {}
    at = {"step": 0}

    def logprobs(logits, params):
        out = real_logprobs(logits, params)
        poisoned = [i for i, p in enumerate(params) if p.seed == POISON_SEED]
        if poisoned:
            key = id(params[poisoned[0]])
            steps[key] = steps.get(key, 0) + 1
            if steps[key] > at["step"]:
                out = out.clone()
                out[poisoned[-1], 3] = math.nan
        return out

    def inverse_cdf(lp, params, uniforms):
        if any(p.seed == RAISE_SEED for p in params):
            raise RuntimeError("injected sampling failure " + "x" * 1000)
        return real_inverse_cdf(lp, params, uniforms)

    monkeypatch.setattr(transformers_sampling, "sampling_logprobs", logprobs)
    monkeypatch.setattr(transformers_sampling, "inverse_cdf", inverse_cdf)
    return at


@pytest.mark.parametrize("step", [0, 4], ids=["at-prefill", "mid-decode"])
async def test_non_finite_row_ends_its_group_only(engine, poison, step):
    poison["step"] = step
    good = [group(engine, "The cat", n=3, seed=1), group(engine, "A dog ran", n=2, seed=2, temperature=0.7, top_k=20)]
    alone = [await run(engine, g) for g in good]
    bad = group(engine, "poisoned", n=2, seed=POISON_SEED)
    results = await cobatched(engine, [good[0], bad, good[1]])
    err = results[1]["error"]
    assert isinstance(err, FailedPrecondition) and err.reason == Reason.NON_FINITE_LOGITS, err
    assert "NaN or infinite" in err.message
    assert all(len(t) == step for t in results[1]["tokens"].values())  # the steps before the NaN went out
    assert not results[1]["done"]
    assert_same(alone[0], results[0])
    assert_same(alone[1], results[2])
    for _ in range(200):  # the worker updates its count after the step that sent the last events
        if engine.stats().running == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().running == 0


async def test_an_exception_while_sampling_ends_its_group_only(engine, poison):
    good = group(engine, "still fine", n=2, seed=5, top_p=0.9)
    alone = await run(engine, good)
    bad = group(engine, "raises", n=1, seed=RAISE_SEED)
    results = await cobatched(engine, [bad, good])
    err = results[0]["error"]
    assert isinstance(err, Internal) and err.reason == Reason.ROW_FAILED, err
    assert "injected sampling failure" in err.message and len(err.message) < 400  # clipped
    assert_same(alone, results[1])


@pytest.mark.parametrize("temperature", [1e-45, math.nan], ids=["denormal", "nan"])
async def test_temperatures_past_the_edge_fail_alone_without_a_seam(engine, temperature):
    """Defense in depth: the servicer refuses these, but an engine handed one still isolates."""
    good = group(engine, "neighbour", n=2, seed=9)
    alone = await run(engine, good)
    bad = group(engine, "frozen", n=2, seed=10, temperature=temperature)
    results = await cobatched(engine, [good, bad])
    assert results[1]["error"].reason == Reason.NON_FINITE_LOGITS
    assert_same(alone, results[0])


async def test_a_failed_prefill_spares_the_running_batch(engine, monkeypatch):
    running = group(engine, "long runner", n=2, seed=3, max_new_tokens=40)
    alone = await run(engine, running)
    real_prefill = engine._prefill
    calls = []

    def prefill(groups):
        calls.append(groups)
        if len(calls) == 2:
            raise RuntimeError("injected prefill failure")
        return real_prefill(groups)

    monkeypatch.setattr(engine, "_prefill", prefill)
    task = asyncio.create_task(run(engine, running))
    while not calls:
        await asyncio.sleep(0.005)
    late = await run(engine, group(engine, "late", n=1, seed=4))
    assert late["error"].reason == Reason.ENGINE_FAILED and late["error"].code == grpc.StatusCode.INTERNAL
    assert_same(alone, await asyncio.wait_for(task, 60))


async def test_a_failed_decode_pass_fails_its_groups_as_a_replica_fault(engine, monkeypatch):
    real_forward = engine._forward
    calls = []

    def forward(rows, **inputs):
        calls.append(len(rows))
        if len(calls) == 3:
            raise RuntimeError("injected device error")
        return real_forward(rows, **inputs)

    monkeypatch.setattr(engine, "_forward", forward)
    results = await cobatched(engine, [group(engine, "one", seed=1), group(engine, "two", seed=2)])
    assert [r["error"].reason for r in results] == [Reason.ENGINE_FAILED, Reason.ENGINE_FAILED]
    monkeypatch.setattr(engine, "_forward", real_forward)
    assert (await run(engine, group(engine, "after", n=1, seed=1, max_new_tokens=3)))["error"] is None


# -- helpers at the edge ------------------------------------------------------------------------
def test_request_ids_must_match_whole():
    assert request_id_from([("x-request-id", "abc\n")], "abc\n") not in ("abc\n", "abc")
    assert request_id_from([], "ok-id\n") != "ok-id\n"
    assert request_id_from([], "ok-id") == "ok-id"


def test_clip_bounds_and_escapes():
    assert clip("a\nb") == "'a\\nb'"
    long = clip("z" * 100_000)
    assert len(long) < 100 and "100000 characters" in long


# -- over gRPC, against a real generator --------------------------------------------------------
def request(text="ok", n=1, request_id="", group_key="", adapter="", **sampling) -> pb.GenerateRequest:
    sampling.setdefault("max_new_tokens", 2)
    req = pb.GenerateRequest(
        text=text, n=n, request_id=request_id, group_key=group_key, sampling=pb.SamplingParams(**sampling)
    )
    req.adapter.name = adapter
    return req
