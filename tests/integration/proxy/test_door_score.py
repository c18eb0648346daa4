"""Scoring through the HTTP door: OpenAI's `echo` with `max_tokens` 0 answered by one Score
(server/rollwire/proxy/http/echo.py), on the session's door fleet.

Independent computations: a teacher-forced forward pass of the base model in this process
(support.engines.forward_logprobs), the tokenizer's own ids for a text prompt, and the metric
deltas the requests must produce.
"""

from __future__ import annotations

import pytest
import torch
from support.door_fleet import post
from support.engines import forward_logprobs
from support.wire import metric_value
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.integration
PROMPTS = [[5, 9, 12, 7, 30, 2], [40, 41], [17]]


@pytest.fixture(scope="module")
def base(door):
    return AutoModelForCausalLM.from_pretrained(door["model"], torch_dtype=torch.float32).eval()


def counts(door) -> tuple[float, float]:
    text = door["proxy"].metrics()
    scores = metric_value(text, 'rollwire_proxy_score_requests_total{code="OK"}', default=0.0)
    generations = sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("rollwire_proxy_requests_total{")
    )
    return scores, generations


def test_echo_with_no_new_tokens_returns_each_prompt_tokens_logprob(door, base):
    before = counts(door)
    reply = post(
        door["proxy"].http_url,
        "/v1/completions",
        {"model": door["model"].name, "prompt": PROMPTS, "max_tokens": 0, "echo": True, "logprobs": 0},
    )
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["finish_reason"] == "length" for c in choices)
    for ids, choice in zip(PROMPTS, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing conditions the first
        if len(ids) > 1:
            want = forward_logprobs(base, ids[:1], ids[1:])
            assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-5), (ids, lp)
        assert choice["text"] == "".join(lp["tokens"])
    assert reply.json()["usage"] == {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}
    after = counts(door)
    assert after[0] - before[0] == 1  # one Score for the two prompts with something to score
    assert after[1] == before[1]  # and no generation request


def test_echo_top_logprobs_hold_the_k_most_likely_and_a_text_prompt_is_tokenized_here(door, base):
    text = "12+34=46"
    ids = AutoTokenizer.from_pretrained(door["model"]).encode(text, add_special_tokens=False)
    reply = post(
        door["proxy"].http_url,
        "/v1/completions",
        {"model": door["model"].name, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 3},
    )
    assert reply.status_code == 200, reply.text
    lp = reply.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    want = forward_logprobs(base, ids[:1], ids[1:])
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), want, atol=1e-5)
    with torch.no_grad():
        logits = base(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    best = torch.topk(torch.log_softmax(logits, -1), 3, dim=-1)
    for j, top in enumerate(lp["top_logprobs"][1:]):
        assert len(top) == 3 and max(top.values()) >= lp["token_logprobs"][j + 1] - 1e-5
        assert torch.allclose(torch.tensor(sorted(top.values(), reverse=True)), best.values[j], atol=1e-5)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": [5, 6], "max_tokens": 4, "echo": True}, "echo"),
        ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [5, 6], "max_tokens": 0, "echo": True, "n": 2}, "n"),
        ({"prompt": [5, 6], "max_tokens": 0, "echo": True, "stream": True}, "stream"),
        ({"prompt": [5, 6], "max_tokens": 0, "echo": True, "logprobs": 20, "model": "nope"}, "model"),
        ({"prompt": [5, 100000], "max_tokens": 0, "echo": True, "logprobs": 0}, None),
    ],
)
def test_a_scoring_request_that_cannot_be_served_is_refused_by_name(door, body, param):
    reply = post(door["proxy"].http_url, "/v1/completions", {"model": door["model"].name, **body})
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    assert error["message"], error
