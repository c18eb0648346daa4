"""Property-based fuzzing: random and malformed messages to a real generator and a proxy.

Every request is answered with a status (never a hang, never a crash), and a good request
afterwards still succeeds on each.
"""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.processes import start_service
from support.wire import generate

from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, -1.0]))
sampling = st.builds(
    pb.SamplingParams,
    max_new_tokens=st.integers(0, 300),
    temperature=floats,
    top_p=floats,
    top_k=st.integers(0, 2**32 - 1),
    stop=st.lists(st.text(max_size=70), max_size=10),
    seed=st.integers(0, 2**64 - 1),
    ignore_eos=st.booleans(),
)
requests = st.builds(
    pb.GenerateRequest,
    request_id=st.text(max_size=100),
    text=st.text(max_size=40),
    n=st.integers(0, 70),
    sampling=sampling,
    adapter=st.builds(pb.AdapterRef, name=st.text(max_size=10), version=st.integers(0, 2**64 - 1)),
    group_key=st.text(max_size=20),
) | st.builds(
    pb.GenerateRequest,
    token_ids=st.builds(pb.TokenIds, ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20)),
    n=st.integers(0, 4),
    sampling=sampling,
)


@pytest.fixture(scope="module")
def fuzz_targets(generator, tmp_path_factory):
    """The shared replica, and a proxy in front of it: both get every fuzzed message."""
    proxy = start_service(
        ["proxy", "--port", "0", "--metrics-port", "0", "--generator", generator.target],
        tmp_path_factory.mktemp("fuzz"),
        "fuzz-proxy",
    )
    yield [generator, proxy]
    proxy.stop()


def outcome(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def still_serves(svc) -> None:
    assert svc.proc.poll() is None, "the service process died"
    assert generate(svc.target, "alive", max_new_tokens=2, ignore_eos=True).finished[0].completion_tokens == 2


@FUZZ
@given(request=requests)
def test_random_generate_requests(fuzz_targets, request):
    if request.sampling.max_new_tokens > 24:  # keep the suite quick; the limit path is still hit
        request.sampling.max_new_tokens = 201
        request.n = min(request.n, 2) if request.n else 0
    for svc in fuzz_targets:
        stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(svc.target))
        code = outcome(lambda: list(stub.Generate(request, timeout=60)))
        assert code in ACCEPTABLE, (code, request)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_malformed_bytes(fuzz_targets, raw):
    for svc in fuzz_targets:
        channel = grpc.insecure_channel(svc.target)
        gen = channel.unary_stream("/rollwire.v1.GeneratorService/Generate")
        push = channel.stream_unary("/rollwire.v1.GeneratorService/PushAdapter")
        for call in (lambda: list(gen(raw, timeout=30)), lambda: push(iter([raw, raw]), timeout=30)):
            code = outcome(call)
            assert code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), code
        channel.close()


push_parts = st.lists(
    st.one_of(
        st.builds(
            pb.PushAdapterRequest,
            manifest=st.builds(
                pb.AdapterManifest,
                name=st.text(max_size=12),
                version=st.integers(0, 5),
                base_model_fingerprint=st.text(max_size=10),
                lora_config=st.builds(
                    pb.LoraConfig,
                    r=st.integers(0, 64),
                    lora_alpha=floats,
                    target_modules=st.lists(st.text(max_size=8), max_size=3),
                ),
                byte_length=st.integers(0, 2**40),
                sha256=st.text(max_size=64),
            ),
        ),
        st.builds(pb.PushAdapterRequest, chunk=st.binary(max_size=512)),
    ),
    max_size=5,
)


@FUZZ
@given(parts=push_parts)
def test_random_push_sequences(fuzz_targets, parts):
    for svc in fuzz_targets:
        stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(svc.target))
        code = outcome(lambda: stub.PushAdapter(iter(parts), timeout=30))
        assert code in ACCEPTABLE - {grpc.StatusCode.OK}, (code, parts)


def test_services_survive_the_fuzzing(fuzz_targets):
    for svc in fuzz_targets:
        still_serves(svc)


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
