"""The HTTP door's pure rules, without processes: what a request counts as (accounting.py),
the limits the door reports without a model folder, the core's refusals in the caller's
words (vocabulary.py), pydantic locations as field names, nulls and content parts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from rollwire.common.errors import InvalidArgument, NotFound, ResourceExhausted
from rollwire.common.reasons import Reason
from rollwire.proxy.accounting import outcome
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.http.dialect.errors import HttpError, field_name
from rollwire.proxy.http.dialect.openai import ChatBody, CompletionBody, flatten_content, template_takes_parts
from rollwire.proxy.http.dialect.vocabulary import Asked, in_http_terms
from rollwire.proxy.http.door import Door
from rollwire.v1 import generator_pb2 as pb

C = grpc.StatusCode
LIMITS = pb.Limits(max_n=16, max_new_tokens=1024, max_prompt_tokens=4096, max_context=64)
"""The demo model's replicas: a 64-token context under generous per-request limits."""


def door_without_a_model(limits: pb.Limits = LIMITS) -> Door:
    core = SimpleNamespace(status=lambda: pb.GetStatusResponse(limits=limits))
    return Door(ProxyConfig(), core, None, None, None, "base", frozenset({"base"}), 0)  # pyright: ignore[reportArgumentType]


def test_without_a_model_folder_the_door_reports_what_the_replicas_serve():
    door = door_without_a_model()
    assert door.max_model_len() == 64  # the replicas' context, not max_prompt_tokens + max_new_tokens (5120)
    assert door.default_max_tokens(6) == 58  # chat's default: what the context leaves after the prompt
    assert door_without_a_model(pb.Limits(max_new_tokens=8, max_prompt_tokens=16)).max_model_len() == 24


@pytest.mark.parametrize(
    ("exc", "edge", "want"),
    [
        (None, False, (C.OK, False)),
        (InvalidArgument("x", reason=Reason.BAD_REQUEST_BODY), True, (C.INVALID_ARGUMENT, True)),  # at the door
        (ResourceExhausted("x", reason=Reason.CLIENT_LIMIT), False, (C.RESOURCE_EXHAUSTED, True)),
        (ResourceExhausted("x", reason=Reason.PROXY_QUEUE_FULL), False, (C.RESOURCE_EXHAUSTED, False)),  # backpressure
        (NotFound("x", reason=Reason.ADAPTER_UNLOADED), False, (C.NOT_FOUND, False)),  # the core's, not relayed
        (NotFound("x", reason=Reason.ADAPTER_NOT_FOUND), False, (C.NOT_FOUND, True)),  # a replica's rule
        (asyncio.CancelledError(), False, (C.CANCELLED, False)),
        (RuntimeError("bug"), True, (C.UNKNOWN, False)),
    ],
)
def test_what_a_request_counts_as(exc, edge, want):
    assert outcome(exc, edge) == want


def test_a_replicas_refusal_reworded_still_counts_as_the_clients():
    asked = Asked(CompletionBody(model="gpt-4o", prompt=[5]), 4, 1, lambda: LIMITS)
    relayed = in_http_terms(NotFound("no adapter ... on this replica; push it first", reason=Reason.ADAPTER_NOT_FOUND), asked, relayed=True)  # fmt: skip
    assert relayed.message.startswith("The model `gpt-4o` does not exist") and relayed.param == "model"
    assert outcome(relayed) == (C.NOT_FOUND, True)


def test_refusals_in_the_callers_words():
    def words(reason: str, message: str, body, prompt_tokens=None, max_tokens=100000):
        return in_http_terms(
            InvalidArgument(message, reason=reason), Asked(body, max_tokens, prompt_tokens, lambda: LIMITS)
        )

    ids = CompletionBody(model="m", prompt=[5, 6, 7, 8], max_tokens=100000)
    over = words(Reason.BAD_MAX_NEW_TOKENS, "sampling.max_new_tokens is 100000; it must be between 1 and 1024", ids, 4)
    assert (over.param, over.message) == ("max_tokens", "max_tokens is 100000; send at most 60 (this prompt (4 tokens) leaves that much of the model's context of 64 tokens)")  # fmt: skip
    text = CompletionBody(model="m", prompt="1+1=", max_tokens=61)
    context = words(Reason.CONTEXT_TOO_LONG, "prompt (4 tokens) plus max_new_tokens (61) exceeds the model's context of 64 tokens", text, max_tokens=61)  # fmt: skip
    assert "send at most 60" in context.message  # the prompt's length read from the replica's sentence
    chat = ChatBody(
        model="m", messages=[{"role": "user", "content": "1"}], max_completion_tokens=99, temperature=0.0005
    )
    assert words(Reason.BAD_MAX_NEW_TOKENS, "x", chat, 3, 99).param == "max_completion_tokens"
    tiny = words(Reason.BAD_TEMPERATURE, "sampling.temperature is 0.0005000000237487257; use 0", chat)
    assert tiny.message.startswith("temperature is 0.0005;") and tiny.param == "temperature"
    assert (
        words(Reason.PROMPT_TOO_LONG, "the prompt has 9 tokens; this replica accepts at most 8", chat).param
        == "messages"
    )
    assert (
        "replica"
        not in words(Reason.PROMPT_TOO_LONG, "the prompt has 9 tokens; this replica accepts at most 8", ids).message
    )


def test_pydantic_locations_are_the_fields_a_caller_wrote():
    assert field_name("messages.0.content") == "messages[0].content"
    assert field_name("tool_choice.literal['none','auto']") == "tool_choice"
    assert field_name("prompt.list[int].3") == "prompt[3]"
    assert field_name("stream_options.include_usage") == "stream_options.include_usage"


def test_nulls_are_the_field_left_out():
    body = ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "1"}], "n": None, "stream": None, "logprobs": None, "store": None})  # fmt: skip
    assert (body.n, body.stream, body.logprobs) == (1, False, False)
    assert CompletionBody.model_validate({"model": "m", "prompt": [1], "max_tokens": None}).max_tokens == 16
    with pytest.raises(ValueError, match="model"):
        CompletionBody.model_validate({"model": None, "prompt": [1]})


def test_content_parts_are_text_as_vllm_renders_them():
    parts = [{"role": "user", "content": [{"type": "text", "text": "12+"}, {"type": "text", "text": "34="}]}]
    assert flatten_content(parts, keep_parts=False) == [{"role": "user", "content": "12+\n34="}]
    assert flatten_content(parts, keep_parts=True) == parts
    assert flatten_content([{"role": "user", "content": "x"}], keep_parts=False) == [{"role": "user", "content": "x"}]
    with pytest.raises(HttpError, match="'image_url'") as refused:
        flatten_content([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], False)
    assert refused.value.param == "messages"
    assert template_takes_parts("{% for part in message['content'] %}{{ part.text }}{% endfor %}")
    assert not template_takes_parts("{% for m in messages %}{{ m['content'] }}{% endfor %}")
