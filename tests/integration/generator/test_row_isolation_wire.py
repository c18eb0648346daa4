"""Blast radius on one replica (issue 11), over gRPC against a real replica: sampling params
out of their documented bounds, oversized strings and a 7 MiB prompt are refused with
INVALID_ARGUMENT and a reason, at once, while a small request beside them completes; random
params never get anything but OK or INVALID_ARGUMENT. In-process failures of one group:
tests/unit/generator/test_row_isolation.py."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.wire import generate, stub

from rollwire.common.errors import RollwireError, from_rpc_error
from rollwire.common.reasons import Reason
from rollwire.v1 import generator_pb2 as pb


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
