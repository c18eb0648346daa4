"""Unit tests of the SDK's pure parts; no generator, no process, no socket. The CLI's startup and
calls that reach no server: tests/integration/client/test_sdk_processes.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file
from support.peft_folders import write_peft_dir

from rollwire.client import (
    AdapterVersion,
    AsyncClient,
    Client,
    DeadlineExceeded,
    GroupAccumulator,
    Internal,
    InvalidArgument,
    LoraShape,
    LoraSpec,
    RequestError,
    ResourceExhausted,
    Restarted,
    RetryPolicy,
    Unavailable,
    cli,
    is_retryable,
    parse_adapter,
    read_peft_dir,
)
from rollwire.client._failover import DOWN_MIN_S, CallAttempts, RetryBudget, Rotation, parse_targets
from rollwire.client._push import build_manifest, push_requests
from rollwire.client._requests import DEFAULT_MAX_NEW_TOKENS, build_generate_request
from rollwire.client._results import events_from_pb
from rollwire.client._retries import Deadline
from rollwire.common.errors import RollwireError
from rollwire.v1 import generator_pb2 as pb

MiB = 1 << 20


# ---------------------------------------------------------------- request building


def test_every_parameter_lands_in_its_field():
    req = build_generate_request(
        "Hello",
        4,
        max_new_tokens=33,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        stop=["\n", "END"],
        seed=123,
        ignore_eos=True,
        adapter="lora@3",
        group_key="g1",
        request_id="r1",
    )
    assert req.WhichOneof("prompt") == "text" and req.text == "Hello"
    assert req.n == 4
    s = req.sampling
    assert s.max_new_tokens == 33
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert s.top_k == 40 and s.seed == 123 and s.ignore_eos is True
    assert list(s.stop) == ["\n", "END"]
    assert (req.adapter.name, req.adapter.version) == ("lora", 3)
    assert (req.group_key, req.request_id) == ("g1", "r1")


def test_token_id_prompt_and_unset_optionals():
    req = build_generate_request([5, 6, np.int64(7)])
    assert req.WhichOneof("prompt") == "token_ids" and list(req.token_ids.ids) == [5, 6, 7]
    assert req.n == 1 and req.sampling.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    for name in ("temperature", "top_p", "top_k", "seed"):
        assert not req.sampling.HasField(name), name
    assert not req.HasField("adapter")
    assert not req.sampling.ignore_eos and list(req.sampling.stop) == []


def test_greedy_is_distinct_from_unset_and_single_stop_is_wrapped():
    req = build_generate_request("x", temperature=0, top_k=0, stop="\n\n")
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0
    assert req.sampling.HasField("top_k")
    assert list(req.sampling.stop) == ["\n\n"]


def test_latest_adapter_is_version_zero():
    req = build_generate_request("x", adapter="lora")
    assert req.HasField("adapter") and (req.adapter.name, req.adapter.version) == ("lora", 0)
    req = build_generate_request("x", adapter=AdapterVersion("lora", 9))
    assert req.adapter.version == 9


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"n": 0}, "n must be"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"n": True}, "n must be"),
        ({"prompt": []}, "at least one"),
        ({"prompt": b"bytes"}, "prompt must be"),
        ({"prompt": 12}, "prompt must be"),
        ({"prompt": [1, 2.5]}, "token id"),
        ({"prompt": [-1]}, "token id"),
        ({"group_key": 3}, "group_key"),
    ],
)
def test_bad_requests_are_refused_before_sending(kwargs, needle):
    prompt = kwargs.pop("prompt", "hi")
    with pytest.raises(RequestError, match=needle) as info:
        build_generate_request(prompt, **kwargs)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InvalidArgument)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError):
        build_generate_request("x", temprature=1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, None),
        ("lora", AdapterVersion("lora", 0)),
        ("lora@latest", AdapterVersion("lora", 0)),
        ("lora@3", AdapterVersion("lora", 3)),
        ("my-adapter.v2_x@12", AdapterVersion("my-adapter.v2_x", 12)),
    ],
)
def test_adapter_specs(spec, expected):
    assert parse_adapter(spec) == expected


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "adapter name"),
        ("@3", "adapter name"),
        ("has space@1", "adapter name"),
        ("x" * 65, "adapter name"),
        ("lora@", "version after '@'"),
        ("lora@0", "version after '@'"),
        ("lora@-1", "version after '@'"),
        ("lora@abc", "version after '@'"),
        ("lora@3.5", "version after '@'"),
        ("a@1@2", "version after '@'"),
        (3, "must be a string"),
    ],
)
def test_bad_adapter_specs(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_adapter(spec)


def test_adapter_version_prints_as_its_spec():
    assert str(AdapterVersion("a", 2)) == "a@2" and str(AdapterVersion("a")) == "a@latest"


# ---------------------------------------------------------------- stream accumulation


def started(replica="r0", adapter=("lora", 3), prompt=(1, 2, 3), request_id="req"):
    ref = pb.AdapterRef(name=adapter[0], version=adapter[1]) if adapter else None
    return pb.GenerateResponse(
        started=pb.GenerationStarted(request_id=request_id, adapter=ref, prompt_token_ids=prompt, replica=replica)
    )


def tokens(i, ids, text, version=3, logprobs=None):
    lp = logprobs if logprobs is not None else [-0.5] * len(ids)
    return pb.GenerateResponse(
        tokens=[pb.TokenChunk(sample_index=i, token_ids=ids, logprobs=lp, text=text, adapter_version=version)]
    )


def finished(i, reason=pb.FINISH_REASON_EOS, completion=0, prompt=3):
    return pb.GenerateResponse(
        finished=[
            pb.SampleFinished(sample_index=i, finish_reason=reason, prompt_tokens=prompt, completion_tokens=completion)
        ]
    )


def restarted(attempt=2, reason="replica r0 died"):
    return pb.GenerateResponse(restarted=pb.GroupRestarted(attempt=attempt, reason=reason))


def fold(n, messages):
    group = GroupAccumulator(n)
    for message in messages:
        for event in events_from_pb(message):
            group.add(event)
    return group.result()


def test_interleaved_samples_are_assembled_and_sorted():
    result = fold(
        2,
        [
            started(),
            tokens(1, [7], "b", logprobs=[-0.1]),
            tokens(0, [4, 5], "a1", version=3, logprobs=[-1.0, -2.0]),
            tokens(1, [8], "c", version=2, logprobs=[-0.2]),
            finished(1, pb.FINISH_REASON_STOP, completion=2),
            tokens(0, [6], "a2", version=4, logprobs=[-3.0]),
            finished(0, pb.FINISH_REASON_LENGTH, completion=3),
        ],
    )
    assert (result.request_id, result.replica, result.adapter) == ("req", "r0", AdapterVersion("lora", 3))
    assert result.prompt_token_ids == [1, 2, 3] and result.restarts == 0
    s0, s1 = result.samples
    assert (s0.index, s0.token_ids, s0.text, s0.finish_reason) == (0, [4, 5, 6], "a1a2", "length")
    assert s0.logprobs == pytest.approx([-1.0, -2.0, -3.0])
    assert s0.token_versions == [3, 3, 4] and s0.adapter_version == 3
    assert (s1.token_ids, s1.text, s1.finish_reason, s1.token_versions) == ([7, 8], "bc", "stop", [3, 2])
    assert s1.adapter_version == 2  # the oldest version among its tokens
    assert (s1.adapter_name, s1.prompt_tokens, s1.completion_tokens) == ("lora", 3, 2)


def test_group_restarted_discards_every_partial_sample():
    result = fold(
        2,
        [
            started(replica="dead"),
            tokens(0, [1, 1], "old0"),
            finished(0),
            tokens(1, [2], "old1"),
            restarted(attempt=2),
            started(replica="alive"),
            tokens(1, [9], "new1"),
            tokens(0, [8], "new0"),
            finished(0),
            finished(1),
        ],
    )
    assert result.replica == "alive" and result.restarts == 1
    assert [s.text for s in result.samples] == ["new0", "new1"]
    assert [s.token_ids for s in result.samples] == [[8], [9]]


def test_base_model_samples_have_no_adapter():
    result = fold(1, [started(adapter=None), tokens(0, [3], "x", version=0), finished(0)])
    assert result.adapter is None
    assert (result.samples[0].adapter_name, result.samples[0].adapter_version) == ("", 0)


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([started(), tokens(0, [1], "a"), finished(0)], "1 of 2 samples"),
        ([started(), tokens(0, [1], "a"), restarted()], "0 of 2 samples"),
        ([tokens(0, [1], "a")], "before 'started'"),
        ([started(), started()], "second 'started'"),
        ([started(), tokens(5, [1], "a")], "sample 5"),
        ([started(), finished(0), tokens(0, [1], "a")], "sample 0"),
        ([started(), tokens(0, [1, 2], "a", logprobs=[-1.0])], "1 logprobs for 2 tokens"),
        ([started(), finished(0, reason=pb.FINISH_REASON_UNSPECIFIED)], "without a finish reason"),
        ([pb.GenerateResponse()], "no event"),
    ],
)
def test_stream_contract_violations_are_errors_not_results(messages, needle):
    with pytest.raises(Internal, match=needle):
        fold(2, messages)


# ---------------------------------------------------------------- push: manifest and chunks


def test_chunks_follow_the_manifest_and_rebuild_the_payload():
    payload = os.urandom(2 * MiB + MiB // 2 + 3)
    manifest = build_manifest("lora", 7, payload, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, "sha256:abc")
    messages = list(push_requests(manifest, payload))
    first = messages[0]
    assert first.WhichOneof("part") == "manifest"
    assert first.manifest.sha256 == hashlib.sha256(payload).hexdigest()
    assert first.manifest.byte_length == len(payload)
    m = first.manifest
    assert (m.name, m.version, m.base_model_fingerprint) == ("lora", 7, "sha256:abc")
    assert first.manifest.lora_config.r == 4 and list(first.manifest.lora_config.target_modules) == ["q_proj"]
    chunks = [m.chunk for m in messages[1:]]
    assert all(m.WhichOneof("part") == "chunk" for m in messages[1:])
    assert len(chunks) == 3 and all(0 < len(c) <= MiB for c in chunks)
    assert b"".join(chunks) == payload


def test_small_chunk_size_and_limits():
    payload = bytes(range(256)) * 10
    manifest = build_manifest("a", 1, payload, LoraShape(1, 1.0, ("all-linear",)), "fp")
    chunks = [m.chunk for m in list(push_requests(manifest, payload, chunk_size=1000))[1:]]
    assert [len(c) for c in chunks] == [1000, 1000, 560] and b"".join(chunks) == payload
    with pytest.raises(RequestError, match="chunk_size"):
        list(push_requests(manifest, payload, chunk_size=MiB + 1))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("bad name", 1, b"x", "fp"), "adapter name"),
        (("a", 0, b"x", "fp"), "version"),
        (("a", 1, b"", "fp"), "non-empty bytes"),
        (("a", 1, b"x", ""), "base_model_fingerprint"),
    ],
)
def test_manifest_refuses_what_the_server_would(args, needle):
    name, version, payload, fp = args
    with pytest.raises(RequestError, match=needle):
        build_manifest(name, version, payload, LoraShape(8, 16.0, ("q_proj",)), fp)


# ---------------------------------------------------------------- PEFT folders


def test_read_peft_dir(tmp_path):
    folder = write_peft_dir(tmp_path / "adapter")
    adapter = read_peft_dir(folder)
    raw = (folder / "adapter_model.safetensors").read_bytes()
    assert adapter.payload == raw and adapter.sha256 == hashlib.sha256(raw).hexdigest()
    assert adapter.lora == LoraShape(r=8, lora_alpha=16.0, target_modules=("q_proj", "v_proj"), use_rslora=True)
    assert adapter.base_model_name_or_path == "org/some-hub-model"
    wire = adapter.lora.to_pb()
    assert (wire.r, wire.lora_alpha, wire.use_rslora) == (8, 16.0, True)
    assert list(wire.target_modules) == ["q_proj", "v_proj"]


def test_read_peft_dir_refusals(tmp_path):
    with pytest.raises(RequestError, match="adapter_config.json"):
        read_peft_dir(tmp_path / "missing")
    folder = write_peft_dir(tmp_path / "bin")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(RequestError, match="safe_serialization"):
        read_peft_dir(folder)
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(RequestError, match="not a valid safetensors"):
        read_peft_dir(folder)
    with pytest.raises(RequestError, match="pattern"):
        read_peft_dir(write_peft_dir(tmp_path / "regex", target_modules=".*proj"))
    with pytest.raises(RequestError, match="IA3"):
        read_peft_dir(write_peft_dir(tmp_path / "ia3", peft_type="IA3"))
    with pytest.raises(RequestError, match="target_modules"):
        read_peft_dir(write_peft_dir(tmp_path / "none", target_modules=None))


def test_lora_shape_from_a_peft_like_object():
    assert LoraSpec is LoraShape  # the SDK's first name, kept for existing callers
    spec = LoraShape.from_peft(
        SimpleNamespace(r=4, lora_alpha=8, target_modules={"k_proj", "o_proj"}, use_rslora=False)
    )
    assert spec == LoraShape(4, 8.0, ("k_proj", "o_proj"), False)
    spec = LoraShape.from_peft({"r": 2, "lora_alpha": 2, "target_modules": "all-linear"})
    assert spec.target_modules == ("all-linear",)


# ---------------------------------------------------------------- retries


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_only_unavailable_before_any_response_is_retried(code):
    error = RollwireError("x", code=code)
    assert is_retryable(error, received_response=False) is (code == grpc.StatusCode.UNAVAILABLE)
    assert is_retryable(error, received_response=True) is False


def test_backoff_is_jittered_exponential_and_capped():
    policy = RetryPolicy(max_attempts=10, initial_backoff_s=0.1, max_backoff_s=1.0)
    assert policy.backoff_s(1, rand=lambda: 0.0) == pytest.approx(0.05)
    assert policy.backoff_s(1, rand=lambda: 1.0) == pytest.approx(0.1)
    assert policy.backoff_s(3, rand=lambda: 1.0) == pytest.approx(0.4)
    assert policy.backoff_s(9, rand=lambda: 1.0) == pytest.approx(1.0)
    assert policy.backoff_s(1, hint_s=0.7, rand=lambda: 0.0) == pytest.approx(0.7)  # server's RetryInfo wins
    delays = {policy.backoff_s(2) for _ in range(20)}
    assert len(delays) > 1 and all(0.1 <= d <= 0.2 for d in delays)


class FakeRpcError(grpc.RpcError):
    """A status as gRPC reports it: from the transport (no reason) or from a rollwire server
    (its ErrorInfo reason in the trailers)."""

    def __init__(self, code: grpc.StatusCode, reason: str = "") -> None:
        self._code = code
        self._trailers = ()
        if reason:
            from rollwire.common.errors import to_status

            status = to_status(RollwireError(self.details(), code=code, reason=reason))
            self._trailers = status.trailing_metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"{self._code.name} from the test"

    def trailing_metadata(self):
        return self._trailers


class ScriptedCall:
    """A server-streaming call double: yields messages, raising any exception in the script."""

    def __init__(self, script):
        self.script, self.cancelled = script, False

    def __iter__(self):
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item

    def cancel(self):
        self.cancelled = True


class StubDouble:
    """Stands in for GeneratorServiceStub: replays one outcome per call and records the call."""

    def __init__(self, outcomes):
        self.outcomes, self.calls = list(outcomes), []

    def GetStatus(self, request, *, timeout, metadata):
        self.calls.append((timeout, metadata))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def Generate(self, request, *, timeout, metadata):
        self.calls.append((timeout, metadata))
        call = ScriptedCall(self.outcomes.pop(0))
        self.last_call = call
        return call


def client_with(outcomes, **kwargs):
    client = Client("127.0.0.1:1", token="s3cret", **kwargs)
    client._stubs = [StubDouble(outcomes)]
    client._stub = client._stubs[0]  # the test's handle on it
    return client


def test_unary_call_retries_unavailable_with_token_and_shrinking_deadline():
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    client = client_with([unavailable, unavailable, pb.GetStatusResponse(role="generator")], timeout=20)
    assert client.get_status().role == "generator"
    calls = client._stub.calls
    assert len(calls) == 3
    assert all(meta == (("authorization", "Bearer s3cret"),) for _, meta in calls)
    timeouts = [t for t, _ in calls]
    assert 0 < timeouts[2] < timeouts[1] < timeouts[0] <= 20


def test_retries_are_bounded_and_other_codes_are_final():
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    client = client_with([unavailable] * 5, max_attempts=2)
    with pytest.raises(Unavailable, match="from the test"):
        client.get_status()
    assert len(client._stub.calls) == 2
    client = client_with([FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED)])
    with pytest.raises(ResourceExhausted):
        client.get_status()
    assert len(client._stub.calls) == 1


def test_generate_hides_restarts_and_retries_only_before_the_first_message():
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    script = [started(), tokens(0, [1], "x"), restarted(), started(replica="r1"), tokens(0, [2], "y"), finished(0)]
    client = client_with([[unavailable], script])
    result = client.generate("hi")
    assert len(client._stub.calls) == 2 and result.restarts == 1
    assert result.replica == "r1" and result.samples[0].text == "y"

    # a server's own UNAVAILABLE after the first message (it names a reason) is final: the
    # proxy already spent its attempts, the SDK does not multiply them
    exhausted = FakeRpcError(grpc.StatusCode.UNAVAILABLE, reason="ATTEMPTS_EXHAUSTED")
    client = client_with([[started(), exhausted], [started(), finished(0)]])
    with pytest.raises(Unavailable):
        client.generate("hi")
    assert len(client._stub.calls) == 1


def test_closing_a_stream_early_cancels_the_rpc():
    client = client_with([[started(), tokens(0, [1], "x"), tokens(0, [2], "y"), finished(0)]])
    stream = client.generate_stream("hi")
    assert next(stream).replica == "r0"
    stream.close()
    assert client._stub.last_call.cancelled

    client = client_with([[started(), tokens(0, [1, 2], "x", logprobs=[-1.0]), finished(0)]])
    with pytest.raises(Internal, match="logprobs"):
        client.generate("hi")
    assert client._stub.last_call.cancelled


# ---------------------------------------------------------------- outliving a proxy (_failover.py)


def test_targets_are_one_address_several_or_a_grpc_name():
    assert parse_targets("a:1") == ("a:1",)
    assert parse_targets(" a:1, b:2 ,a:1") == ("a:1", "b:2")  # spaces and duplicates dropped
    assert parse_targets(["a:1", "[::1]:2"]) == ("a:1", "[::1]:2")
    assert parse_targets("dns:///proxy.ns.svc:50050") == ("dns:///proxy.ns.svc:50050",)
    assert parse_targets("ipv4:10.0.0.1:1,10.0.0.2:1") == ("ipv4:10.0.0.1:1,10.0.0.2:1",)  # gRPC's own list
    for bad in ("", " , ", [], [b"a:1"], 5, None):
        with pytest.raises(RequestError, match="target"):
            parse_targets(bad)
    for url in ("http://127.0.0.1:8000", "https://proxy:443", "grpc://a:1"):  # refused at once, never dialled
        with pytest.raises(RequestError, match="is a URL; .* gRPC port"):
            parse_targets(url)
    assert parse_targets("unix:///run/rollwire.sock") == ("unix:///run/rollwire.sock",)


def test_an_http_port_is_named_and_not_retried():
    """grpc's own sentence for an address that answers HTTP/1 (the door, a metrics port)."""
    error = RollwireError(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8000: Trying to connect an http1.x "
        "server",
        code=grpc.StatusCode.UNAVAILABLE,
    )
    assert is_retryable(error, received_response=False) is False
    final = CallAttempts(Rotation(["127.0.0.1:8000"]), RetryPolicy(), Deadline(5)).final(error)
    assert "this is an HTTP port" in final.message and "use the gRPC port" in final.message


def test_rotation_takes_turns_and_puts_failed_addresses_last_for_a_doubling_while():
    now = [100.0]
    rotation = Rotation(["a", "b", "c"], clock=lambda: now[0])
    assert [rotation.order()[0] for _ in range(4)] == [0, 1, 2, 0]
    rotation.failed(1)
    assert rotation.order() == [2, 0, 1]  # b's turn, but it failed a moment ago
    now[0] += DOWN_MIN_S
    assert [rotation.order() for _ in range(3)] == [[2, 0, 1], [0, 1, 2], [1, 2, 0]]  # back in turn after its pause
    rotation.failed(1)
    rotation.failed(1)  # second failure in a row: 2 x DOWN_MIN_S; a third: 4 x
    rotation.failed(1)
    now[0] += 3.5 * DOWN_MIN_S
    assert rotation.order() == [2, 0, 1] and rotation.order() == [0, 2, 1]  # still paused
    rotation.succeeded(1)
    assert rotation.order() == [1, 2, 0]


def test_call_attempts_try_every_address_at_once_then_back_off_within_the_deadline():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0)
    refused = Unavailable("failed to connect to all addresses")
    attempts = CallAttempts(Rotation(["a", "b"]), policy, Deadline(30), rand=lambda: 1.0)
    assert attempts.target == "a"
    assert attempts.next(refused, received=False) == 0.0 and attempts.target == "b"  # no wait: b is untried
    assert attempts.next(refused, received=False) == pytest.approx(0.1)  # a whole round failed: back off
    assert attempts.next(refused, received=False) == 0.0
    assert attempts.next(refused, received=False) == pytest.approx(0.2)
    assert attempts.attempt == 5

    # a server's UNAVAILABLE (it names a reason) is retried, its hint respected, the address not marked down
    attempts = CallAttempts(Rotation(["a"]), policy, Deadline(30), rand=lambda: 0.0)
    no_replica = Unavailable("no replica", reason="NO_REPLICA", retry_after_s=0.7)
    assert attempts.next(no_replica, received=False) == pytest.approx(0.7)
    assert attempts.rotation.order() == [0]

    # after a response: only a broken connection restarts, and only where the call allows it
    broken = Unavailable("Stream removed")
    for error, restartable, expect in (
        (broken, True, True),
        (broken, False, False),
        (Unavailable("given up", reason="ATTEMPTS_EXHAUSTED"), True, False),
        (DeadlineExceeded("Deadline Exceeded"), True, False),
    ):
        attempts = CallAttempts(Rotation(["a", "b"]), policy, Deadline(30))
        assert (attempts.next(error, received=True, restartable=restartable) is not None) is expect

    # never past the deadline, never past max_attempts
    attempts = CallAttempts(Rotation(["a"]), policy, Deadline(0.05), rand=lambda: 1.0)
    assert attempts.next(refused, received=False) is None
    attempts = CallAttempts(Rotation(["a", "b"]), RetryPolicy(max_attempts=1), Deadline(30))
    assert attempts.next(refused, received=False) is None


def test_a_proxys_fleet_fault_is_tried_once_more_at_most_and_retries_draw_on_a_budget():
    policy = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.01)
    no_replica = Unavailable("no replica", reason="NO_REPLICA", retry_after_s=0.01)
    exhausted = Unavailable("given up", reason="ATTEMPTS_EXHAUSTED")
    # the proxy already spent its attempts: one more try (the other proxy first), never two
    attempts = CallAttempts(Rotation(["a", "b"]), policy, Deadline(30))
    assert attempts.next(exhausted, received=False) == 0.0 and attempts.target == "b"
    assert attempts.next(no_replica, received=False) is None
    # every server-decided failure of any call takes a token; such retries stop below half the bucket
    budget = RetryBudget(max_tokens=10, ratio=0.1)
    changed = Unavailable("spool changed", reason="SPOOL_CHANGED")
    attempts = CallAttempts(Rotation(["a"]), policy, Deadline(30), budget=budget)
    assert [attempts.next(changed, received=False) is not None for _ in range(5)] == [True] * 4 + [False]
    fresh = CallAttempts(Rotation(["a"]), policy, Deadline(30), budget=budget)
    assert fresh.next(changed, received=False) is None  # another call of the same client: still throttled
    for _ in range(30):  # answered attempts give tokens back, slowly (0.1 each)
        CallAttempts(Rotation(["a"]), policy, Deadline(30), budget=budget).responded()
    assert CallAttempts(Rotation(["a"]), policy, Deadline(30), budget=budget).next(changed, False) is not None
    # a connection failure reached no server: it is bounded by the deadline, never by the budget
    refused = Unavailable("failed to connect to all addresses")
    drained = RetryBudget(max_tokens=10)
    drained.tokens = 0
    attempts = CallAttempts(Rotation(["a"]), policy, Deadline(30), budget=drained)
    assert all(attempts.next(refused, received=False) is not None for _ in range(5))


def test_a_stream_cut_mid_group_is_started_again_and_announced_like_a_proxy_restart():
    cut = FakeRpcError(grpc.StatusCode.UNAVAILABLE)  # no reason: the connection broke
    client = client_with(
        [[started(), tokens(0, [1], "x"), cut], [started(replica="r1"), tokens(0, [2], "y"), finished(0)]]
    )
    events = list(client.generate_stream("hi"))
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Started", "Tokens", "Restarted", "Started", "Tokens", "Finished"]
    restart = events[2]
    assert isinstance(restart, Restarted) and restart.attempt == 2 and "discard the partial samples" in restart.reason

    client = client_with(
        [[started(), tokens(0, [1], "x"), cut], [started(replica="r1"), tokens(0, [2], "y"), finished(0)]]
    )
    result = client.generate("hi")
    assert result.restarts == 1 and result.replica == "r1" and result.samples[0].token_ids == [2]


def test_a_dead_address_costs_one_refusal_and_later_calls_skip_it():
    refused = FakeRpcError(grpc.StatusCode.UNAVAILABLE)
    client = Client(["127.0.0.1:1", "127.0.0.1:2"], timeout=20)
    dead, alive = StubDouble([refused] * 5), StubDouble([pb.GetStatusResponse(role="proxy")] * 5)
    client._stubs = [dead, alive]
    start = time.monotonic()
    for _ in range(4):
        assert client.get_status().role == "proxy"
    assert time.monotonic() - start < 0.5  # no backoff: the other address was tried at once
    assert len(dead.calls) == 1 and len(alive.calls) == 4  # the dead one was tried once, then skipped
    client.close()


async def test_async_requests_are_validated_when_called():
    client = AsyncClient("127.0.0.1:1")
    with pytest.raises(RequestError):
        client.generate_stream("x", n=0)
    with pytest.raises(RequestError, match="adapter"):
        await client.generate("x", adapter="a@b")
    await client.close()


# ---------------------------------------------------------------- command line


def test_bad_usage_exits_2(capsys):
    for argv in (
        [],
        ["generate", "hi"],
        ["generate", "--target", "x:1", "--adapter", "lora@0", "hi"],
        ["generate", "--target", "x:1", "-n", "0", "hi"],
    ):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2, argv
    assert "version after '@'" in capsys.readouterr().err


def test_request_refused_by_the_sdk_exits_2(capsys):
    assert cli.main(["generate", "--target", "127.0.0.1:1", "--top-p", "2", "hi"]) == 2
    assert capsys.readouterr().err.startswith("error: INVALID_ARGUMENT: top_p")


def test_an_unreadable_ca_file_or_prompt_ids_that_are_not_numbers_exit_2_naming_them(tmp_path, capsys):
    missing = tmp_path / "ca.pem"
    assert cli.main(["status", "--target", "127.0.0.1:1", "--tls-ca", str(missing)]) == 2
    assert capsys.readouterr().err == f"error: cannot read {missing}: No such file or directory\n"
    assert cli.main(["generate", "--target", "127.0.0.1:1", "--token-ids", "5, 6 x"]) == 2
    assert "PROMPT must be whole numbers" in capsys.readouterr().err


def test_empty_token_file_exits_2(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("\n")
    assert cli.main(["status", "--target", "127.0.0.1:1", "--token-file", str(token)]) == 2
    assert "empty" in capsys.readouterr().err


def test_push_without_a_known_base_model_exits_2(tmp_path, capsys):
    folder = write_peft_dir(tmp_path / "adapter")
    argv = ["push-adapter", "--target", "127.0.0.1:1", "--name", "lora", "--version", "1", str(folder)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--base-model" in err and "--base-fingerprint" in err and "org/some-hub-model" in err
    assert cli.main([*argv[:-1], "--base-model", str(tmp_path), str(folder)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_base_fingerprint_resolution(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": np.ones((2, 2), dtype=np.float32)}, str(model / "model.safetensors"))
    from rollwire.common.fingerprint import model_fingerprint

    adapter = read_peft_dir(write_peft_dir(tmp_path / "a", base_model_name_or_path=str(model)))
    assert cli.base_fingerprint(adapter, None, "sha256:given") == "sha256:given"
    assert cli.base_fingerprint(adapter, None, None) == model_fingerprint(model)
    assert cli.base_fingerprint(adapter, str(model), None) == model_fingerprint(model)


def test_json_result_shape():
    result = fold(1, [started(), tokens(0, [4, 5], "ok", logprobs=[-0.25, -0.5]), finished(0, completion=2)])
    data = json.loads(json.dumps(cli.result_to_json(result)))
    assert set(data) == {"request_id", "replica", "adapter", "prompt_token_ids", "samples"}
    assert data["adapter"] == {"name": "lora", "version": 3} and data["prompt_token_ids"] == [1, 2, 3]
    assert data["samples"] == [
        {
            "index": 0,
            "text": "ok",
            "token_ids": [4, 5],
            "logprobs": [-0.25, -0.5],
            "finish_reason": "eos",
            "adapter_version": 3,
            "token_versions": [3, 3],
        }
    ]


def test_kept_token_sets_fold_into_samples_and_json():
    from rollwire.common import kept

    chunk = tokens(0, [4, 5], "ok", logprobs=[-0.25, -0.5])
    chunk.tokens[0].kept_tokens.extend([kept.encode([4, 9, 300]), b""])
    result = fold(1, [started(), chunk, finished(0, completion=2)])
    assert result.samples[0].kept_tokens == [(4, 9, 300), ()]
    assert cli.result_to_json(result)["samples"][0]["kept_token_ids"] == [[4, 9, 300], []]
    short = tokens(0, [4, 5], "ok", logprobs=[-0.25, -0.5])
    short.tokens[0].kept_tokens.append(kept.encode([4]))  # one set for two tokens: a broken stream
    with pytest.raises(Internal):
        fold(1, [started(), short, finished(0, completion=2)])


def test_printed_stream_restarts_cleanly(capsys):
    import io

    events = [
        e
        for m in [
            started(),
            tokens(0, [1], "par"),
            restarted(),
            started(),
            tokens(0, [1], "Hel"),
            tokens(0, [2], "lo"),
            finished(0, completion=2),
        ]
        for e in events_from_pb(m)
    ]
    out, info = io.StringIO(), io.StringIO()
    result = cli.print_stream(events, 1, out, info)
    assert out.getvalue() == "par\nHello\n" and result.samples[0].text == "Hello"
    assert "restarted" in info.getvalue() and "eos, 2 tokens" in info.getvalue()

    events = [
        e
        for m in [started(), tokens(1, [1], "one"), tokens(0, [2], "zero"), finished(1), finished(0)]
        for e in events_from_pb(m)
    ]
    out = io.StringIO()
    cli.print_stream(events, 2, out, io.StringIO())
    text = out.getvalue()
    assert text.index("sample 1") < text.index("one") < text.index("sample 0") < text.index("zero")


def test_status_table():
    status = pb.GetStatusResponse(
        role="proxy",
        replica="proxy-0",
        model_fingerprint="sha256:ab",
        engine="transformers",
        in_flight=3,
        queue_depth=1,
        server_version="0.1.0",
        adapters=[pb.LoadedAdapter(name="lora", versions=[4, 5], signers={5: "learner-2026"})],
        limits=pb.Limits(max_n=64, max_new_tokens=512, max_prompt_tokens=2048, max_adapter_bytes=MiB, adapter_window=2),
        replicas=[
            pb.ReplicaStatus(
                address="10.0.0.1:50051",
                replica="gen-a",
                healthy=False,
                draining=True,
                in_flight=2,
                detail="ejected after errors",
                adapters=[pb.LoadedAdapter(name="lora", versions=[5])],
            )
        ],
    )
    text = cli.format_status(status)
    for needle in (
        "proxy-0",
        "sha256:ab",
        "transformers",
        "max_n=64",
        "adapter_window=2",
        "4,5",
        "10.0.0.1:50051",
        "gen-a",
        "lora@5",
        "ejected after errors",
        "SIGNED BY",
        "learner-2026",
    ):
        assert needle in text, needle
    assert re.search(r"^queue depth +1$", text, re.M)
    assert "(none)" in cli.format_status(pb.GetStatusResponse(role="generator"))
    assert "max_context=64" in cli.format_status(pb.GetStatusResponse(limits=pb.Limits(max_context=64)))
    assert "replicas: (listed for an admin token only)" in cli.format_status(pb.GetStatusResponse(role="proxy"))
    from google.protobuf import json_format

    data = cli.numbers_as_numbers(status, json_format.MessageToDict(status, preserving_proto_field_name=True))
    assert data["limits"]["max_adapter_bytes"] == MiB and data["adapters"][0]["versions"] == [4, 5]
    assert data["replicas"][0]["adapters"][0]["versions"] == [5]


def test_the_cli_default_max_new_tokens_fits_the_servers_context():
    class Server:
        def __init__(self, **limits: int) -> None:
            self.limits = pb.Limits(**limits)

        def get_status(self) -> pb.GetStatusResponse:
            return pb.GetStatusResponse(limits=self.limits)

    fit = cli.fitting_max_new_tokens
    assert fit(Server(max_new_tokens=1024, max_context=64), "12+34=") == 64 - 6 - 2  # the demo model's context
    assert fit(Server(max_new_tokens=1024, max_context=64), [5, 6, 7]) == 61
    assert fit(Server(max_new_tokens=32, max_context=4096), "x") == 32
    assert fit(Server(max_new_tokens=1024), "x") == DEFAULT_MAX_NEW_TOKENS  # no context reported
    assert fit(Server(max_new_tokens=1024, max_context=8), "a long prompt") == 1  # the server will say why


def test_one_message_may_carry_several_samples_and_their_finishes():
    both = pb.GenerateResponse(
        tokens=[
            pb.TokenChunk(sample_index=1, token_ids=[7], logprobs=[-0.7], text="b", adapter_version=3),
            pb.TokenChunk(sample_index=0, token_ids=[5, 6], logprobs=[-0.5, -0.6], text="aa", adapter_version=3),
        ],
        finished=[
            pb.SampleFinished(
                sample_index=1, finish_reason=pb.FINISH_REASON_LENGTH, prompt_tokens=3, completion_tokens=1
            )
        ],
    )
    events = events_from_pb(both)
    assert [type(e).__name__ for e in events] == ["Tokens", "Tokens", "Finished"]
    result = fold(2, [started(), both, tokens(0, [8], "c"), finished(0, completion=3)])
    assert [s.token_ids for s in result.samples] == [[5, 6, 8], [7]]
    assert result.samples[1].finish_reason == "length"
