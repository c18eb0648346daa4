"""Every bad input gets its own status and sentence, and the replica keeps serving."""

from __future__ import annotations

import grpc
import pytest
from safetensors.torch import save
from support.wire import fingerprint, generate, make_adapter, push, push_messages, stub

from rollwire.common.errors import from_rpc_error
from rollwire.v1 import generator_pb2 as pb

BAD_REQUESTS = {
    "empty prompt": (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    "no prompt": (dict(text=None), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    "token id outside vocab": (
        dict(token_ids=pb.TokenIds(ids=[5, 100000])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside the vocabulary",
    ),
    "n of 0": (dict(n=0), grpc.StatusCode.INVALID_ARGUMENT, "n is 0"),
    "n above limit": (dict(n=17), grpc.StatusCode.INVALID_ARGUMENT, "between 1 and 16"),
    "max_new_tokens 0": (dict(max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens is 0"),
    "max_new_tokens above limit": (dict(max_new_tokens=201), grpc.StatusCode.INVALID_ARGUMENT, "between 1 and 200"),
    "negative temperature": (dict(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature is -0.5"),
    "top_p of 0": (dict(top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "unknown adapter": (
        dict(adapter=pb.AdapterRef(name="nobody")),
        grpc.StatusCode.NOT_FOUND,
        "no adapter named 'nobody'",
    ),
}


def build(text="ok", token_ids=None, n=1, max_new_tokens=4, temperature=None, top_p=None, adapter=None, **_):
    req = pb.GenerateRequest(n=n, sampling=pb.SamplingParams(max_new_tokens=max_new_tokens))
    if token_ids is not None:
        req.token_ids.CopyFrom(token_ids)
    elif text is not None:
        req.text = text
    if temperature is not None:
        req.sampling.temperature = temperature
    if top_p is not None:
        req.sampling.top_p = top_p
    if adapter is not None:
        req.adapter.CopyFrom(adapter)
    return req


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_generate_request(generator, case):
    fields, code, words = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as err:
        list(stub(generator.target).Generate(build(**fields), timeout=30))
    assert err.value.code() == code
    assert words in err.value.details()
    assert from_rpc_error(err.value).reason  # machine-readable ErrorInfo travels too
    assert (
        generate(generator.target, "still serving", max_new_tokens=2, ignore_eos=True).finished[0].completion_tokens
        == 2
    )


@pytest.fixture(scope="module")
def adapter(tiny_model):
    return make_adapter(tiny_model, seed=7, r=4)


def expect_push_error(target, messages, code, words):
    with pytest.raises(grpc.RpcError) as err:
        stub(target).PushAdapter(iter(messages), timeout=30)
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details()
    assert generate(target, "still serving", max_new_tokens=2, ignore_eos=True).finished[0].completion_tokens == 2


def test_wrong_digest(generator, adapter):
    m = adapter.manifest("bad-digest", 1, fingerprint(generator.target), sha256="0" * 64)
    expect_push_error(generator.target, push_messages(m, adapter.payload), grpc.StatusCode.INVALID_ARGUMENT, "sha256")


def test_truncated_upload(generator, adapter):
    m = adapter.manifest("truncated", 1, fingerprint(generator.target))
    msgs = list(push_messages(m, adapter.payload[:-100], chunk=4096))
    expect_push_error(generator.target, msgs, grpc.StatusCode.INVALID_ARGUMENT, "truncated")


def test_chunk_over_the_limit(generator, adapter):
    payload = adapter.payload + b"\0" * (2 << 20)
    m = adapter.manifest("big-chunk", 1, fingerprint(generator.target), byte_length=len(payload))
    msgs = [pb.PushAdapterRequest(manifest=m), pb.PushAdapterRequest(chunk=payload[: (1 << 20) + 1])]
    expect_push_error(generator.target, msgs, grpc.StatusCode.INVALID_ARGUMENT, "1 MiB")


def test_wrong_tensor_shapes(generator, adapter):
    state = dict(adapter.state_dict)
    key = next(k for k in state if k.endswith("q_proj.lora_A.weight"))
    state[key] = state[key][:, :-1].contiguous()  # one input feature short
    payload = save(state)
    import hashlib

    m = adapter.manifest(
        "bad-shape",
        1,
        fingerprint(generator.target),
        byte_length=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    expect_push_error(generator.target, push_messages(m, payload), grpc.StatusCode.INVALID_ARGUMENT, "shape")


def test_rank_in_manifest_disagrees_with_tensors(generator, adapter):
    m = adapter.manifest("bad-rank", 1, fingerprint(generator.target))
    m.lora_config.r = 8
    expect_push_error(generator.target, push_messages(m, adapter.payload), grpc.StatusCode.INVALID_ARGUMENT, "shape")


def test_wrong_base_model(generator, adapter):
    m = adapter.manifest("other-base", 1, "sha256:" + "ab" * 16)
    expect_push_error(
        generator.target, push_messages(m, adapter.payload), grpc.StatusCode.FAILED_PRECONDITION, "base model"
    )


def test_version_below_newest(generator, adapter):
    fp = fingerprint(generator.target)
    push(generator.target, adapter.manifest("mono", 5, fp), adapter.payload)
    m = adapter.manifest("mono", 4, fp)
    expect_push_error(
        generator.target, push_messages(m, adapter.payload), grpc.StatusCode.FAILED_PRECONDITION, "only increase"
    )


def test_same_version_other_digest(generator, adapter, tiny_model):
    fp = fingerprint(generator.target)
    push(generator.target, adapter.manifest("immutable", 1, fp), adapter.payload)
    other = make_adapter(tiny_model, seed=8, r=4)
    m = other.manifest("immutable", 1, fp)
    expect_push_error(
        generator.target, push_messages(m, other.payload), grpc.StatusCode.FAILED_PRECONDITION, "different digest"
    )


def test_chunk_before_manifest(generator, adapter):
    msgs = [pb.PushAdapterRequest(chunk=b"abc")]
    expect_push_error(
        generator.target, msgs, grpc.StatusCode.INVALID_ARGUMENT, "first PushAdapter message must be the manifest"
    )


def test_bad_adapter_name(generator, adapter):
    m = adapter.manifest("no spaces/allowed", 1, fingerprint(generator.target))
    expect_push_error(
        generator.target, push_messages(m, adapter.payload), grpc.StatusCode.INVALID_ARGUMENT, "adapter name"
    )


def test_not_safetensors(generator, adapter):
    import hashlib

    payload = b"this is not a safetensors file at all"
    m = adapter.manifest(
        "garbage",
        1,
        fingerprint(generator.target),
        byte_length=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    expect_push_error(
        generator.target, push_messages(m, payload), grpc.StatusCode.INVALID_ARGUMENT, "not a safetensors"
    )


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast


def test_a_group_the_engine_can_never_serve_is_refused_before_its_stream_starts(tiny_model, tmp_path):
    """Too big for the KV budget of 200 tokens: a status and nothing else, no GenerationStarted
    first. Checked on the group as it would run: 8 x 43 tokens; a new session's turn of 3 + 200;
    a later turn whose new tokens fit but whose history does not (103 + 3 + 100). A refused turn
    counts as refused, not failed, and leaves its session as it was, even one sent with end."""
    from support.processes import start_generator
    from support.wire import metric_value

    svc = start_generator(tiny_model, tmp_path, "small-kv", "--set", "transformers.max_batch_tokens=200")

    def turn(tokens: int, session: str | None = None, n: int = 1, end: bool = False) -> pb.GenerateRequest:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5, 17, 33]),
            n=n,
            sampling=pb.SamplingParams(max_new_tokens=tokens, ignore_eos=True),
        )
        if session is not None:
            request.session.CopyFrom(pb.SessionTurn(id=session, end=end))
        return request

    def refused(request: pb.GenerateRequest) -> None:
        received: list[pb.GenerateResponse] = []
        with pytest.raises(grpc.RpcError) as err:
            received.extend(stub(svc.target).Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert from_rpc_error(err.value).reason == "KV_BUDGET" and "KV cache" in str(err.value.details())
        assert received == []

    def prompt_of(request: pb.GenerateRequest) -> list[int]:
        started = [m.started for m in stub(svc.target).Generate(request, timeout=60) if m.HasField("started")]
        assert len(started) == 1
        return list(started[0].prompt_token_ids)

    try:
        refused(turn(40, n=8))
        refused(turn(200, session="agent-1"))
        assert prompt_of(turn(100, session="agent-1")) == [5, 17, 33]  # the refused first turn left nothing
        refused(turn(100, session="agent-1", end=True))  # 103 held + 3 new + 100 > 200
        again = prompt_of(turn(50, session="agent-1"))  # the session is still there, as it was
        assert len(again) == 106 and again[:3] == again[-3:] == [5, 17, 33]
        metrics = svc.metrics()
        assert metric_value(metrics, "rollwire_generator_requests_total", 'code="INVALID_ARGUMENT"') == 3
        assert metric_value(metrics, "rollwire_generator_requests_total", 'code="OK"') == 2
        turns = "rollwire_generator_session_turns_total"
        outcomes = ("completed", "refused", "failed")
        assert [metric_value(metrics, turns, f'outcome="{o}"') for o in outcomes] == [2, 2, 0]
    finally:
        svc.stop()
