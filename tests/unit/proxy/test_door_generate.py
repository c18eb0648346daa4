"""vLLM's tokens-in, tokens-out route at the door (issue 50, item 3), as pure logic: a body read
as the completions body of the same token ids, its refusals by name, and the weight-version
spans of a sample. The route over real replicas: tests/integration/proxy/test_door_tools.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.edge.bodies import parse_body
from rollwire.proxy.http.generate import GenerateBody, _completion, spans


def body(**kw: Any) -> GenerateBody:
    return GenerateBody.model_validate({"model": "m", "token_ids": [1, 2], **kw})


def test_versions_become_vllms_spans():
    assert spans([]) == []
    assert spans([3, 3, 3]) == [{"version": "3", "start": 0, "end": 3}]
    assert spans([0, 4, 4, 5]) == [
        {"version": "0", "start": 0, "end": 1},
        {"version": "4", "start": 1, "end": 3},
        {"version": "5", "start": 3, "end": 4},
    ]


def test_sampling_params_become_the_completions_body():
    sp = {"n": 3, "temperature": 0.5, "top_k": -1, "seed": 7, "stop": ["x"], "max_tokens": 9, "logprobs": 0}
    c = _completion(body(sampling_params=sp, stream=True, return_sampling_mask=True))
    assert (c.n, c.temperature, c.top_k, c.seed, c.stop, c.max_tokens, c.logprobs) == (3, 0.5, -1, 7, ["x"], 9, 0)
    assert c.prompt == [1, 2] and c.stream and c.return_token_ids and c.return_kept_tokens
    plain = _completion(body(sampling_params={"detokenize": True, "flat_logprobs": True, "stream_interval": 4}))
    assert plain.temperature is None and plain.logprobs is None  # vLLM's defaults: temperature 1


@pytest.mark.parametrize(
    ("ask", "param"),
    [
        ({"sampling_params": {"presence_penalty": 0.5}}, "sampling_params.presence_penalty"),
        ({"sampling_params": {"stop_token_ids": [3]}}, "sampling_params.stop_token_ids"),
        ({"sampling_params": {"logprobs": 2}}, "sampling_params.logprobs"),
        ({"sampling_params": {"logprobs": -1}}, "sampling_params.logprobs"),
        ({"sampling_params": {"allowed_token_ids": [1]}}, "sampling_params.allowed_token_ids"),
        ({"sampling_params": {"extra_args": {"a": 1}}}, "sampling_params.extra_args"),
        ({"sampling_params": {"detokenize": False}, "output_mode": "text"}, "output_mode"),
        ({"output_mode": "text", "stream": True}, "output_mode"),
        ({"content_parts": [{"type": "image_url"}]}, "content_parts"),
        ({"cache_salt": "s"}, "cache_salt"),
        ({"priority": 2}, "priority"),
    ],
)
def test_what_no_replica_honours_is_refused_by_name(ask, param):
    with pytest.raises(HttpError) as caught:
        _completion(body(**ask))
    assert caught.value.param == param, caught.value.message


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"model": "m", "token_ids": []}, "token_ids"),
        ({"model": "m", "token_ids": [-1]}, "token_ids.0"),
        ({"model": "m", "token_ids": [1 << 40]}, "token_ids.0"),
        ({"model": "m", "token_ids": [1], "sampling_params": {"frob": 1}}, "sampling_params.frob"),
        ({"model": "m", "token_ids": [1], "sampling_params": "hot"}, "sampling_params"),
        ({"model": "m", "token_ids": [1], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"model": "m", "token_ids": [1], "sampling_params": {"seed": -1}}, "sampling_params.seed"),
        ({"model": "m", "token_ids": [1], "output_mode": "bytes"}, "output_mode"),
        ({"token_ids": [1]}, "model"),
    ],
)
def test_a_malformed_body_names_its_field(raw, param):
    with pytest.raises(HttpError) as caught:
        asyncio.run(parse_body(json.dumps(raw).encode(), GenerateBody))
    assert caught.value.param == param, caught.value.message
