"""Tool calls, token spellings and vLLM's RL route through the door over real replicas (issue 50), on
the session's door fleet (tests/support/door_fleet.py: its open proxy parses hermes calls, its
guarded one has no parser, as vLLM without --enable-auto-tool-choice). The tiny model writes no
tool calls by itself: a LoRA adapter taught here in seconds (tests/support/tool_model.py) does, so
real samples with calls are parsed, streamed, run as a Python tool in an agent loop, and their ids
and logprobs held against a teacher-forced forward. Multi-turn token reuse: turn k+1 sent as ids
is exact, the chat route re-renders. The parse and its streaming over generated texts are unit
tests (tests/unit/proxy/test_tool_calls.py)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import requests
from support.door_fleet import GENERATE_TOKEN, openai_client, post
from support.tool_model import ADD_TOOL, PAIRS, call_text, prompt_text
from support.tool_model import tool_caller as taught_tool_caller

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        text = [str(line) for line in r.iter_lines(decode_unicode=True)]
    lines = [line[6:] for line in text if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_tools_with_the_parser_leave_the_sample_as_sampled(door):
    url, model = door["proxy"].http_url, door["model"].name
    ask = {"model": model, "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 12, "seed": 5}
    ask |= {"temperature": 1.0, "logprobs": True, "return_token_ids": True}
    plain = post(url, "/v1/chat/completions", ask).json()["choices"][0]
    tooled = post(url, "/v1/chat/completions", {**ask, "tools": TOOLS}).json()["choices"][0]
    # The fleet's template ignores tools, so the prompt and the seed's sample are the same.
    assert tooled["token_ids"] == plain["token_ids"] and tooled["logprobs"] == plain["logprobs"]
    assert tooled["message"]["content"] == plain["message"]["content"] and "tool_calls" not in tooled["message"]
    assert tooled["finish_reason"] == plain["finish_reason"]
    frames = sse(url, {**ask, "tools": TOOLS, "stream": True})
    deltas = [f["choices"][0] for f in frames if f["choices"]]
    assert "".join(d["delta"].get("content", "") for d in deltas) == tooled["message"]["content"]
    assert [t for d in deltas for t in d.get("token_ids", [])] == tooled["token_ids"]
    named = post(url, "/v1/chat/completions", {**ask, "tools": TOOLS, "tool_choice": "required"})
    assert named.status_code == 400 and named.json()["error"]["param"] == "tool_choice"


def test_tool_choice_auto_without_a_parser_is_refused_as_vllm_refuses_it(door):
    url, model = door["guarded"].http_url, door["model"].name
    ask = {"model": model, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, "tools": TOOLS}
    refused = post(url, "/v1/chat/completions", ask, token=GENERATE_TOKEN)
    error = refused.json()["error"]
    assert (
        refused.status_code == 400 and error["param"] == "tool_choice" and "http.tool_call_parser" in error["message"]
    )
    templated = post(url, "/v1/chat/completions", {**ask, "tool_choice": "none"}, token=GENERATE_TOKEN)
    assert templated.status_code == 200, templated.text  # the template sees the tools; nothing is parsed


def test_tokens_as_token_ids_spell_the_sampled_ids(door):
    url, model = door["proxy"].http_url, door["model"].name
    ask = {"model": model, "max_tokens": 6, "seed": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    completion = post(url, "/v1/completions", {**ask, "prompt": "12+", "logprobs": 0}).json()["choices"][0]
    assert completion["logprobs"]["tokens"] == [f"token_id:{t}" for t in completion["token_ids"]]
    assert [list(top) for top in completion["logprobs"]["top_logprobs"]] == [
        [t] for t in completion["logprobs"]["tokens"]
    ]
    chat = post(url, "/v1/chat/completions", {**ask, "messages": [{"role": "user", "content": "1+"}], "logprobs": True})
    choice = chat.json()
    assert [e["token"] for e in choice["choices"][0]["logprobs"]["content"]] == [
        f"token_id:{t}" for t in choice["choices"][0]["token_ids"]
    ]
    assert choice["prompt_token_ids"]  # chat's prompt ids, as vLLM's return_token_ids


def test_vllm_rl_route_gives_the_completions_sample_with_its_versions(door):
    """/inference/v1/generate (vLLM 0.32's tokens-in, tokens-out route) over the same dispatch:
    the same seed gives the completions route's tokens and logprobs, whole or streamed, with
    the version that sampled them (the base model: "0") and the prompt's ids."""
    url, model = door["proxy"].http_url, door["model"].name
    prompt, sampling = [5, 6, 7, 8], {"max_tokens": 8, "seed": 9, "temperature": 1.0, "logprobs": 0}
    want = post(url, "/v1/completions", {"model": model, "prompt": prompt, **sampling, "return_token_ids": True})
    want = want.json()["choices"][0]
    ask = {"model": model, "token_ids": prompt, "sampling_params": sampling, "return_token_ids": True}
    whole = post(url, "/inference/v1/generate", ask).json()
    choice = whole["choices"][0]
    assert whole["request_id"].startswith("generate-tokens-") and whole["prompt_token_ids"] == prompt
    assert choice["token_ids"] == want["token_ids"] and choice["finish_reason"] == want["finish_reason"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == want["logprobs"]["token_logprobs"]
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": len(want["token_ids"])}]
    text = post(url, "/inference/v1/generate", {**ask, "output_mode": "text"}).json()["choices"][0]
    assert text["text"] == want["text"] and text["token_ids"] == want["token_ids"]
    with requests.post(url + "/inference/v1/generate", json={**ask, "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        lines = [str(line)[6:] for line in r.iter_lines(decode_unicode=True) if str(line).startswith("data: ")]
    chunks = [json.loads(line) for line in lines[:-1]]
    assert lines[-1] == "[DONE]" and chunks[0]["prompt_token_ids"] == prompt
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want["token_ids"]
    assert chunks[-1]["choices"][0]["weight_versions"] == choice["weight_versions"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == [
        want["finish_reason"]
    ]
    for field, value, param in [
        ("sampling_params", {**sampling, "presence_penalty": 0.5}, "sampling_params.presence_penalty"),
        ("sampling_params", {**sampling, "logprobs": 3}, "sampling_params.logprobs"),
        ("sampling_params", {**sampling, "bad_words": ["x"]}, "sampling_params.bad_words"),
        ("kv_transfer_params", {"a": 1}, "kv_transfer_params"),
        ("sampling_params", {**sampling, "max_tokens": 100000}, "sampling_params.max_tokens"),
        ("sampling_params", {**sampling, "n": 500}, "sampling_params.n"),
        ("sampling_params", {**sampling, "temperature": 0.0005}, "sampling_params.temperature"),
        ("token_ids", [5] * 100000, "token_ids"),
        ("model", "gpt-4o", "model"),
        ("token_ids", [], "token_ids"),
    ]:
        refused = post(url, "/inference/v1/generate", {**ask, field: value})
        status = 404 if field == "model" else 400
        assert refused.status_code == status and refused.json()["error"]["param"] == param, (field, refused.text)


def test_turn_k_plus_1_reuses_turn_ks_sampled_ids_exactly(door):
    """Multi-turn tokens (issue 50, item 2; docs/http.md "What is exact and what is re-rendered"): a
    harness that builds turn k+1's prompt from turn k's `prompt_token_ids` and sampled `token_ids`
    (as verifiers' renderer client bridges turns) and sends it as ids gets it back exactly, and the
    same sample as the completions route; the chat route re-renders turn k from its text, so its
    prompt holds the sampled ids only where they are the tokenization of that text (no EOS, which
    the text leaves out), and otherwise drifts from them."""
    url, model = door["proxy"].http_url, door["model"].name
    user, more = {"role": "user", "content": "12+34="}, {"role": "user", "content": "more"}
    drifted = exact = 0
    for seed in range(6):
        ask = {"model": model, "max_tokens": 6, "seed": seed, "temperature": 1.0, "return_token_ids": True}
        first = post(url, "/v1/chat/completions", {**ask, "messages": [user]}).json()
        prompt, sampled = first["prompt_token_ids"], first["choices"][0]["token_ids"]
        text = first["choices"][0]["message"]["content"]

        def ids(t: str) -> list[int]:
            return post(url, "/tokenize", {"model": model, "prompt": t, "add_special_tokens": False}).json()["tokens"]

        # The template writes turn k as "a:TEXT\n", then "u:more\na:": the harness appends the sampled ids and the
        # rendered rest, the template renders all of it from text.
        bridged = prompt + sampled + ids("\nu:more\na:")
        again = {**ask, "messages": [user, {"role": "assistant", "content": text}, more]}
        rerendered = post(url, "/v1/chat/completions", again).json()["prompt_token_ids"]
        assert rerendered == prompt + ids(text + "\nu:more\na:")
        if sampled == ids(text):
            assert rerendered == bridged
            exact += 1
        else:
            assert rerendered != bridged  # the sampled ids are not what the text tokenizes to (an EOS, most often)
            drifted += 1
        sampling = {"max_tokens": 6, "seed": seed, "temperature": 1.0, "logprobs": 0}
        second = post(
            url,
            "/inference/v1/generate",
            {"model": model, "token_ids": bridged, "sampling_params": sampling, "return_token_ids": True},
        ).json()
        assert second["prompt_token_ids"] == bridged  # exact: what was sent is what was sampled from
        want = post(url, "/v1/completions", {"model": model, "prompt": bridged, **sampling, "return_token_ids": True})
        want = want.json()["choices"][0]
        assert second["choices"][0]["token_ids"] == want["token_ids"]
        got = [e["logprob"] for e in second["choices"][0]["logprobs"]["content"]]
        assert got == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)  # either replica may serve it
    assert exact and drifted  # these seeds meet both rules (5 and 1 here)


@pytest.fixture(scope="module")
def tool_caller(door, tiny_model):
    """A LoRA adapter taught to write hermes calls (support/tool_model.py: ~10 s, once per machine),
    loaded through the door as `tool-caller`; a request naming it waits until a replica serves it."""
    folder = door["root"] / "tool-caller"
    shutil.copytree(taught_tool_caller(tiny_model), folder)
    loaded = post(
        door["proxy"].http_url, "/v1/load_lora_adapter", {"lora_name": "tool-caller", "lora_path": str(folder)}
    )
    assert loaded.status_code == 200, loaded.text
    return folder


def test_a_model_that_writes_calls_gets_them_as_tool_calls_with_its_sampled_ids(door, tool_caller, tiny_model):
    """A real sample with calls (issue 50, "Must show"): the door's hermes parse gives the call the
    adapter wrote as message.tool_calls and finish_reason tool_calls, whole and streamed alike; its
    token_ids are the sampled ones (the call's text and EOS) and its logprobs equal a teacher-forced
    forward of the PEFT model within 1e-4."""
    import torch
    from peft import PeftModel
    from support.engines import forward_logprobs
    from transformers import AutoModelForCausalLM

    url = door["proxy"].http_url
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), tool_caller).eval()

    def tokens(text: str) -> dict[str, Any]:
        return post(url, "/tokenize", {"model": "tool-caller", "prompt": text, "add_special_tokens": False}).json()

    for a, b in PAIRS[:2]:
        ask = {"model": "tool-caller", "messages": [{"role": "user", "content": f"{a}+{b}="}], "tools": [ADD_TOOL]}
        ask |= {"temperature": 0, "max_tokens": 80, "logprobs": True, "return_token_ids": True}  # greedy: as taught
        answer = post(url, "/v1/chat/completions", ask).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert call["function"] == {"name": "add", "arguments": json.dumps({"a": a, "b": b})}
        assert answer["prompt_token_ids"] == tokens(prompt_text(a, b))["tokens"]
        eos = tokens("</s>")["tokens"]
        assert choice["token_ids"] == tokens(call_text(a, b))["tokens"] + eos  # the sampled ids, EOS included
        want = forward_logprobs(reference, answer["prompt_token_ids"], choice["token_ids"])
        got = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        frames = sse(url, {**ask, "stream": True})
        deltas = [f["choices"][0] for f in frames if f["choices"]]
        streamed = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
        assert [(t["index"], t["function"]) for t in streamed] == [(0, call["function"])]
        assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
        assert [t for d in deltas for t in d.get("token_ids", [])] == choice["token_ids"]
        assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]


def test_an_agent_loop_calls_a_python_tool_through_the_openai_client(door, tool_caller):
    """What a ToolEnv does, with the `openai` client (verifiers 0.4.0 has no ToolEnv; docs/http.md): the
    model's call is run as a Python function, its result sent back as a tool message, and the next
    turn's prompt holds it as the chat template renders it."""
    client = openai_client(door["proxy"].http_url)
    tools = {"add": lambda a, b: a + b}
    messages: list[Any] = [{"role": "user", "content": "12+34="}]
    first = client.chat.completions.create(model="tool-caller", messages=messages, tools=[ADD_TOOL], temperature=0)  # pyright: ignore[reportArgumentType]  # plain dicts, as a harness sends them
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        assert call.type == "function"
        result = tools[call.function.name](**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    second = client.chat.completions.create(
        model="tool-caller",
        messages=messages,
        tools=[ADD_TOOL],  # pyright: ignore[reportArgumentType]
        temperature=0,
        max_tokens=4,
        extra_body={"return_token_ids": True},
    )
    ids = second.model_dump()["prompt_token_ids"]  # vLLM's extension field, kept by the client's model
    prompt = post(door["proxy"].http_url, "/detokenize", {"model": "tool-caller", "tokens": ids})
    assert prompt.json()["prompt"].endswith("t:46\na:")  # the tool's result, as the template writes a tool turn
