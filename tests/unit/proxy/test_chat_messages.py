"""A chat's messages reach the template as vLLM hands them to it (dialect/messages.py): what a
harness sends back as history (verifiers' assistant turn of tool calls with `content: null` and
arguments as a JSON string, its `reasoning_content: null`) renders as vLLM renders it. The same
requests are held against a real vLLM server's /tokenize in tests/e2e/test_verifiers_conformance.py,
which also drives /v1/chat/completions/tokens (ChatTokensBody, here) with verifiers' training client."""

from __future__ import annotations

import json
import shutil

import pytest
from pydantic import ValidationError

from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.dialect.messages import conversation
from rollwire.proxy.http.dialect.openai import ChatBody, ChatTokensBody
from rollwire.proxy.http.dialect.tokenizer import ChatTokenizer

CALL = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
HISTORY = [
    {"role": "user", "content": "1+2=", "x-client-field": 1},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": None},
    {"role": "tool", "tool_call_id": "c1", "content": "3", "name": "add"},
]


def test_history_is_rebuilt_as_vllm_rebuilds_it():
    got = conversation(HISTORY, keep_parts=False)
    assert got == [
        {"role": "user", "content": "1+2="},  # fields vLLM does not keep are gone
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**CALL, "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"},
    ]
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'  # the request is not changed
    parts = conversation(HISTORY, keep_parts=True)
    assert [m["content"] for m in parts] == [[{"type": "text", "text": "1+2="}], [], [{"type": "text", "text": "3"}]]


@pytest.mark.parametrize(
    ("arguments", "want"),
    [
        ('{"a": 1}', {"a": 1}),
        ({"a": 1}, {"a": 1}),
        ("not json", {}),
        ("[1, 2]", {}),
        ("", {}),
        (None, {}),
        (7, {}),
        ("[" * 100_000, {}),  # a hostile nesting: the client's mistake, never the door's RecursionError (a 500)
    ],
)
def test_call_arguments_are_an_object_as_vllm_makes_them(arguments, want):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    [turn] = conversation([{"role": "assistant", "content": "x", "tool_calls": [call]}], keep_parts=False)
    assert turn["tool_calls"][0]["function"] == {"name": "f", "arguments": want}


def test_reasoning_under_both_names_empty_calls_dropped_and_bad_calls_refused():
    [turn] = conversation([{"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": []}], False)
    assert turn == {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}
    [user] = conversation([{"role": "user", "content": "u", "reasoning": "r", "tool_calls": [CALL]}], False)
    assert user == {"role": "user", "content": "u"}  # only an assistant's are kept
    for bad in ["x", {"type": "custom", "function": {}}, {"type": "function", "function": "f"}]:
        with pytest.raises(HttpError, match=r"messages\[0\]\.tool_calls\[0\]") as refused:
            conversation([{"role": "assistant", "content": None, "tool_calls": [bad]}], False)
        assert refused.value.param == "messages"


def test_the_template_renders_the_history_as_vllm_would(tiny_model, tmp_path):
    """A tool-use template (arguments through `tojson`, content printed as is) given the
    history a harness sends: the null content prints nothing (not "None") and the arguments
    print as an object (not a quoted string)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
        "{% endfor %}|{% endfor %}"
    )
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    text = ChatTokenizer(folder).render(
        HISTORY, tools=None, add_generation_prompt=False, continue_final_message=False, kwargs={}
    )
    assert text == 'user:1+2=|assistant:[add {"a": 1, "b": 2}]|tool:3|'


def test_a_chat_from_ids_takes_the_prompts_ids_and_only_that_route_does():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert ChatTokensBody(**chat, tokens=[5, 6, 7]).tokens == [5, 6, 7]
    for bad in ([], [-1], [1 << 40], None):
        with pytest.raises(ValidationError, match="tokens"):
            ChatTokensBody(**chat, tokens=bad)
    with pytest.raises(ValidationError, match="tokens"):
        ChatBody(**chat, tokens=[5])  # /v1/chat/completions refuses it by name, as it refuses any field it lacks
