"""Blast radius on one replica (issue 11): one group's failure is that group's alone.

In-process: a transformers engine whose sampling is made to fail for one group (non-finite
values, an exception, a temperature that slips past the edge) ends that group with a status
that names it, while the groups sharing its forward passes finish exactly as they do alone.
Over gRPC: sampling params out of their documented bounds, oversized strings and a 7 MiB
prompt are refused with INVALID_ARGUMENT and a reason, at once, while a small request
beside them completes; random params never get anything but OK or INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import pytest_asyncio
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.wire import generate, stub

from rollwire.common.errors import FailedPrecondition, Internal, RollwireError, clip, from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.generator.engines import transformers_engine as te
from rollwire.generator.engines import transformers_sampling
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


REFUSED = {
    "denormal temperature": (request(temperature=1e-45), Reason.BAD_TEMPERATURE),
    "temperature 1e-4": (request(temperature=1e-4), Reason.BAD_TEMPERATURE),
    "inf temperature": (request(temperature=math.inf), Reason.BAD_TEMPERATURE),
    "nan temperature": (request(temperature=math.nan), Reason.BAD_TEMPERATURE),
    "negative temperature": (request(temperature=-1.0), Reason.BAD_TEMPERATURE),
    "temperature 101": (request(temperature=101.0), Reason.BAD_TEMPERATURE),
    "nan top_p": (request(top_p=math.nan), Reason.BAD_TOP_P),
    "zero top_p": (request(top_p=0.0), Reason.BAD_TOP_P),
    "top_p 1.5": (request(top_p=1.5), Reason.BAD_TOP_P),
    "huge top_k": (request(top_k=2**32 - 1), Reason.BAD_TOP_K),
    "top_k past the vocabulary": (request(top_k=101), Reason.BAD_TOP_K),
    "empty stop string": (request(stop=[""]), Reason.BAD_STOP),
    "64 KiB stop string": (request(stop=["y" * 65536]), Reason.BAD_STOP),
    "a thousand stop strings": (request(stop=["x"] * 1000), Reason.BAD_STOP),
    "7 MiB text prompt": (request(text="9" * (7 << 20)), Reason.PROMPT_TOO_LONG),
    "a million token ids": (
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5] * 1_000_000), n=1, sampling=pb.SamplingParams(max_new_tokens=1)
        ),
        Reason.PROMPT_TOO_LONG,
    ),
    "64 KiB adapter name": (request(adapter="a" * 65536), Reason.BAD_ADAPTER_NAME),
    "adapter name with a newline": (request(adapter="lora\n"), Reason.BAD_ADAPTER_NAME),
    "1 MiB group key": (request(group_key="k" * (1 << 20)), Reason.BAD_GROUP_KEY),
}


def refusal(call) -> tuple[RollwireError | None, float]:
    start = time.monotonic()
    try:
        call()
    except grpc.RpcError as exc:
        return from_rpc_error(exc), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("case", list(REFUSED))
def test_out_of_bounds_is_refused_at_once_and_alone(generator, case):
    req, reason = REFUSED[case]
    s = stub(generator.target)
    with ThreadPoolExecutor(1) as pool:
        probe_started = threading.Event()

        def probe() -> float:
            probe_started.set()
            t = time.monotonic()
            generate(generator.target, "small", n=2, max_new_tokens=3, ignore_eos=True, timeout=10)
            return time.monotonic() - t

        probe_future = pool.submit(probe)
        probe_started.wait(5)
        err, seconds = refusal(lambda: list(s.Generate(req, timeout=20)))
        probe_seconds = probe_future.result(timeout=20)
    assert err is not None and err.code == grpc.StatusCode.INVALID_ARGUMENT, (case, err)
    assert err.reason == reason, (case, err.reason, err.message)
    assert len(err.message) < 400, "a client's string came back unclipped"
    assert seconds < 1.0, f"{case}: refused after {seconds:.2f}s"
    assert probe_seconds < 2.0, f"{case}: a small request beside it took {probe_seconds:.2f}s"


def test_a_long_text_is_tokenized_off_the_event_loop(generator):
    """Under the byte cap but over the token limit: tokenized on a thread, then refused."""
    s = stub(generator.target)
    with ThreadPoolExecutor(4) as pool:
        big = [pool.submit(refusal, lambda: list(s.Generate(request(text="7" * 8000), timeout=20))) for _ in range(3)]
        t = time.monotonic()
        generate(generator.target, "small", max_new_tokens=2, ignore_eos=True, timeout=10)
        assert time.monotonic() - t < 2.0
        for f in big:
            err, seconds = f.result()
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == Reason.PROMPT_TOO_LONG, err
            assert seconds < 1.0


def test_a_request_id_with_a_newline_is_replaced_not_forwarded(generator):
    g = None
    for msg in stub(generator.target).Generate(request(request_id="abc\n"), timeout=10):
        g = g or msg.started
    assert g.request_id not in ("abc\n", "abc") and len(g.request_id) == 16


def test_extreme_valid_params_are_served(generator):
    for sampling in (
        dict(temperature=1e-3, seed=2**64 - 1),
        dict(temperature=100.0, top_k=100, top_p=1e-30),
        dict(temperature=0.0, stop=["z" * 64] * 8),
        dict(temperature=-0.0),
    ):
        g = generate(generator.target, "edge", n=2, max_new_tokens=3, ignore_eos=True, timeout=10, **sampling)
        assert all(f.completion_tokens == 3 for f in g.finished.values()), sampling
        assert all(math.isfinite(lp) for lps in g.logprobs.values() for lp in lps), sampling


RANDOM = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
floats = st.one_of(
    st.floats(width=32),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-4, 9.99e-4, 1e-3, 1.0, 100.0, 100.01, 1e30]),
    st.floats(1e-4, 200.0),
)


@RANDOM
@given(
    temperature=floats,
    top_p=floats,
    top_k=st.integers(0, 2**32 - 1) | st.integers(0, 120),
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=70), max_size=10),
    n=st.integers(1, 3),
)
def test_random_sampling_params_get_ok_or_invalid_argument(generator, temperature, top_p, top_k, seed, stop, n):
    req = request(n=n, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, max_new_tokens=2)
    if seed is not None:
        req.sampling.seed = seed
    logprobs = []

    def call():
        for msg in stub(generator.target).Generate(req, timeout=20):
            logprobs.extend(lp for t in msg.tokens for lp in t.logprobs)

    err, seconds = refusal(call)
    if err is None:
        assert all(math.isfinite(lp) for lp in logprobs)
    else:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason, (err, req.sampling)
        assert seconds < 1.0
