"""The HTTP door as an OpenAI or vLLM user meets it, through the official `openai` package:
refusals answered with the same status, exception type and `param` whether streamed or not;
OpenAI's content parts, explicit nulls and no-op fields; one choice per streamed chunk; the
endpoints vLLM users and TRL call; and one accounting of HTTP and gRPC requests in the
proxy's core metrics (docs/http.md, docs/metrics.md).

Runs on the session's door fleet (tests/support/door_fleet.py). Independent computations: the
gRPC path's samples for the same seed, the tokenizer's own ids for a text, and the metric
deltas the test's fixed mix of requests must produce.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import grpc
import pytest
import requests
from support.door_fleet import openai_client, post
from support.processes import wait_until
from support.wire import generate

pytestmark = pytest.mark.integration

MESSAGES: Any = [{"role": "user", "content": "12+34="}]


def refusals(model: str) -> list[tuple[str, str, type, int, str, dict[str, Any]]]:
    """(what, endpoint, openai exception, status, param, request): refused before any token."""
    import openai

    ids = [5, 6, 7]
    return [
        ("unknown model", "completions", openai.NotFoundError, 404, "model", {"model": "gpt-4o", "prompt": ids}),
        ("unknown chat model", "chat", openai.NotFoundError, 404, "model", {"model": "gpt-4o", "messages": MESSAGES}),
        ("max_tokens over the context", "completions", openai.BadRequestError, 400, "max_tokens", {"prompt": ids, "max_tokens": 300}),
        ("max_tokens over every limit", "completions", openai.BadRequestError, 400, "max_tokens", {"prompt": ids, "max_tokens": 100000}),
        ("n over the limit", "completions", openai.BadRequestError, 400, "n", {"prompt": ids, "n": 500}),
        ("tiny temperature", "completions", openai.BadRequestError, 400, "temperature", {"prompt": ids, "temperature": 0.0005}),
        ("chat n over the limit", "chat", openai.BadRequestError, 400, "n", {"messages": MESSAGES, "n": 500}),
        ("an image part", "chat", openai.BadRequestError, 400, "messages", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
        ("tool_choice required", "chat", openai.BadRequestError, 400, "tool_choice", {"messages": MESSAGES, "tool_choice": "required"}),
    ]  # fmt: skip


def create(client, endpoint: str, model: str, request: dict[str, Any], **extra):
    ask = {"model": model, "max_tokens": 4, **request, **extra}
    if endpoint == "chat":
        return client.chat.completions.create(**ask)
    return client.completions.create(**ask)


@pytest.mark.parametrize("stream", [False, True], ids=["unstreamed", "streamed"])
def test_refusals_answer_the_same_status_streamed_or_not(door, stream):
    """A streamed request is decided before its status line: the `openai` client raises the
    same typed exception, status and `param` as for the unstreamed request (issue 38)."""
    client, model = openai_client(door["proxy"].http_url), door["model"].name
    wrong = []
    for what, endpoint, kind, status, param, request in refusals(model):
        with pytest.raises(kind) as caught:
            reply = create(client, endpoint, model, request, stream=stream)
            for _ in reply:  # a stream that began is read to its end: the error must not come as an event
                pass
        error = caught.value
        body = error.body if isinstance(error.body, dict) else {}
        if (error.status_code, body.get("param"), body.get("code")) != (status, param, status):
            wrong.append(f"{what}: {error.status_code} param={body.get('param')!r} {body}")
        message = str(body.get("message", ""))
        if re.search(r"replica|push it|sampling\.|max_new_tokens|\d\.\d{8}", message):
            wrong.append(f"{what}: gRPC words or float noise in {message!r}")
    assert not wrong, "\n".join(wrong)


def test_errors_name_what_the_caller_meets(door):
    url, model = door["proxy"].http_url, door["model"].name
    context = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    prompt = [5] * (context - 20)  # leaves 20 tokens, fewer than the per-sample limit
    for max_tokens in (21, 100000):  # over the room this prompt leaves, and over every limit
        error = post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens}).json()
        assert error["error"]["message"].startswith(f"max_tokens is {max_tokens}; send at most 20 "), error
    unknown = post(url, "/v1/completions", {"model": "gpt-4o", "prompt": [5], "max_tokens": 1}).json()["error"]
    assert unknown["message"].startswith("The model `gpt-4o` does not exist") and unknown["param"] == "model"
    tiny = post(url, "/v1/completions", {"model": model, "prompt": [5], "temperature": 0.0005}).json()["error"]
    assert tiny["message"].startswith("temperature is 0.0005;") and tiny["param"] == "temperature"
    for path, method in (("/v1/embeddings", "post"), ("/v1/completions", "get"), ("/nothing", "get")):
        r = requests.request(method, url + path, timeout=10)
        error = r.json()["error"]  # the documented shape, not FastAPI's {"detail": ...}
        assert set(error) == {"message", "type", "param", "code", "reason"} and error["code"] == r.status_code
        assert r.status_code == (405 if method == "get" and path == "/v1/completions" else 404), r.text


def test_content_parts_render_as_their_text(door):
    """Text parts are flattened as vLLM does for a template that takes a string (joined by
    newlines): the prompt equals the string content's, token for token."""
    url, model = door["proxy"].http_url, door["model"].name
    asks = [
        ([{"type": "text", "text": "12+34="}], "12+34="),
        ([{"type": "text", "text": "12+"}, {"type": "text", "text": "34="}], "12+\n34="),
    ]
    for parts, text in asks:
        got = []
        for content in (parts, text):
            body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
            reply = post(url, "/v1/chat/completions", {**body, "return_token_ids": True})
            assert reply.status_code == 200, reply.text
            got.append(reply.json()["prompt_token_ids"])
        assert got[0] == got[1]


def test_nulls_and_fields_without_sampling_meaning_are_accepted(door):
    url, model = door["proxy"].http_url, door["model"].name
    nulls = {"n": None, "stream": None, "echo": None, "stream_options": None, "seed": 3, "temperature": None}
    noops = {"store": False, "metadata": {"run": "a"}, "service_tier": "auto", "user": "u1", "prompt_cache_key": "k"}
    completion = post(url, "/v1/completions", {"model": model, "prompt": [5, 6], "max_tokens": 2, **nulls, **noops})
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"]) == 1
    chat = post(
        url,
        "/v1/chat/completions",
        {"model": model, "messages": MESSAGES, "max_tokens": 2} | nulls | noops | {"logprobs": None},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    unknown = post(url, "/v1/completions", {"model": model, "prompt": [5], "frobnicate": None})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "frobnicate"  # a null is still a field


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_n_stream_carries_one_choice_per_chunk(door, endpoint):
    """The usual `chunk.choices[0]` loop sees every sample; they equal the gRPC path's."""
    client, model = openai_client(door["proxy"].http_url), door["model"].name
    ask: dict[str, Any] = {"prompt": "12+34="} if endpoint == "completions" else {"messages": MESSAGES}
    ask |= {"n": 3, "seed": 17, "max_tokens": 8, "temperature": 1.0}
    whole = create(client, endpoint, model, ask)
    want = {c.index: (c.text if endpoint == "completions" else c.message.content) for c in whole.choices}
    texts: dict[int, str] = {}
    for chunk in create(client, endpoint, model, ask, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            assert chunk.usage is not None  # the usage chunk: no choice
            continue
        assert len(chunk.choices) == 1, chunk
        choice = chunk.choices[0]
        piece = choice.text if endpoint == "completions" else (choice.delta.content or "")
        texts[choice.index] = texts.get(choice.index, "") + piece
    assert texts == want and len(want) == 3
    if endpoint == "completions":
        grpc_side = generate(door["proxy"].target, "12+34=", n=3, seed=17, max_new_tokens=8, temperature=1.0)
        assert texts == grpc_side.text


def test_models_retrieve_tokenize_and_server_info(door):
    import openai

    url, model = door["proxy"].http_url, door["model"]
    client = openai_client(url)
    base = client.models.retrieve(model.name)
    assert base.id == model.name and (base.model_extra or {})["max_model_len"] == 256
    assert client.models.retrieve(str(model)).id == model.name  # the base answers to its path too
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nobody-v3")
    assert isinstance(missing.value.body, dict) and missing.value.body["param"] == "model"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens = post(url, "/tokenize", {"model": model.name, "prompt": "12+34=", "return_token_strs": True}).json()
    assert tokens["tokens"] == tokenizer.encode("12+34=") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 256 and len(tokens["token_strs"]) == tokens["count"]
    chat = post(url, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert post(url, "/detokenize", {"tokens": tokens["tokens"]}).json() == {
        "prompt": tokenizer.decode(tokens["tokens"])
    }
    assert post(url, "/detokenize", {"tokens": [10**6]}).json()["error"]["param"] == "tokens"
    assert requests.get(url + "/version", timeout=10).json()["version"]
    info = requests.get(url + "/server_info", timeout=10).json()["vllm_config"]["model_config"]
    assert info["logprobs_mode"] == "processed_logprobs"


# -- one accounting --------------------------------------------------------------------------
def series(text: str, name: str) -> dict[frozenset, float]:
    """Every series of one metric, by its label set (a missing series is absent, never 0)."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m:
            out[frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[1] or ""))] = float(m[2])
    return out


def counts(proxy) -> dict[str, dict[frozenset, float]]:
    text = proxy.metrics()
    names = ("requests_total", "request_duration_seconds_count", "client_errors_total")
    return {n: series(text, f"rollwire_proxy_{n}") for n in names}


def test_http_and_grpc_requests_are_counted_alike(door):
    """A fixed mix of HTTP and gRPC requests, successes and refusals, streamed or not, appears
    exactly in requests_total, the duration histogram's count and client_errors_total."""
    proxy, model = door["proxy"], door["model"].name
    url, ok = proxy.http_url, {"model": model, "prompt": [5, 6, 7], "max_tokens": 3}
    before = counts(proxy)
    assert post(url, "/v1/completions", ok).status_code == 200
    assert post(url, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 3}).status_code == 200
    with requests.post(url + "/v1/completions", json={**ok, "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200 and [x for x in r.iter_lines() if x][-1] == b"data: [DONE]"
    for body, status in (({**ok, "model": "gpt-4o"}, 404), ({**ok, "model": "gpt-4o", "stream": True}, 404)):
        assert post(url, "/v1/completions", body).status_code == status
    for body in ({**ok, "n": 0}, {**ok, "frobnicate": 1}, {**ok, "n": 500, "stream": True}):
        assert post(url, "/v1/completions", body).status_code == 400  # at the edge, and by a replica
    generate(proxy.target, [5, 6, 7], max_new_tokens=3)
    with pytest.raises(grpc.RpcError) as refused:
        generate(proxy.target, [5, 6, 7], adapter=("nobody", 0), max_new_tokens=3)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND  # pyright: ignore[reportAttributeAccessIssue]
    policy = dict(next(iter(before["requests_total"])))["policy"]
    codes = {"OK": 4, "NOT_FOUND": 3, "INVALID_ARGUMENT": 3}
    want = {
        "requests_total": {frozenset({("policy", policy), ("code", c)}): n for c, n in codes.items()},
        "request_duration_seconds_count": {frozenset({("policy", policy)}): sum(codes.values())},
        "client_errors_total": {frozenset({("code", c)}): n for c, n in codes.items() if c != "OK"},
    }

    def delta() -> dict[str, dict[frozenset, float]]:
        after = counts(proxy)
        return {
            name: {k: v - before[name].get(k, 0) for k, v in after[name].items() if v != before[name].get(k, 0)}
            for name in after
        }

    wait_until(lambda: delta() == want, 10, "the mix counted")  # a stream is counted as its response ends
    assert delta() == want


def test_a_stream_refused_by_the_core_is_counted_as_its_status(door):
    """The HTTP metric sees the refusal's status, not a 200 (a streamed refusal never opens the stream)."""
    url = door["proxy"].http_url

    def refused() -> float:
        lines = [x for x in door["proxy"].metrics().splitlines() if x.startswith("rollwire_proxy_http_requests_total")]
        return sum(float(x.split()[-1]) for x in lines if 'code="404"' in x and "/v1/completions" in x)

    start = refused()
    body = {"model": "gpt-4o", "prompt": [5], "max_tokens": 1, "stream": True}
    r = requests.post(url + "/v1/completions", data=json.dumps(body), timeout=30)
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    wait_until(lambda: refused() == start + 1, 10, "the 404 counted")


# -- the CLI meets the door --------------------------------------------------------------------
def test_the_cli_names_an_http_port_and_fits_its_default_to_the_context(door):
    """`rollwire generate` refuses a URL at once, says what an HTTP port is when it meets one
    (no five-minute retry), and its default max_new_tokens fits the server's context."""
    from support.processes import run_cli

    proxy = door["proxy"]
    url = run_cli("generate", "--target", proxy.http_url, "12+34=")
    assert url.returncode == 2 and "is a URL" in url.stderr and "gRPC port" in url.stderr, url.stderr
    started = time.monotonic()
    http = run_cli("generate", "--target", f"127.0.0.1:{proxy.http_port}", "--timeout", "60", "12+34=")
    assert http.returncode == 1 and "this is an HTTP port" in http.stderr, http.stderr
    assert time.monotonic() - started < 30  # not retried until the deadline
    long = "1" * 200  # 200 tokens of a 256-token context: 128 would not fit
    fits = run_cli("generate", "--target", proxy.target, "--json", long)
    assert fits.returncode == 0, fits.stderr
    assert "max_context=256" in run_cli("status", "--target", proxy.target).stdout
