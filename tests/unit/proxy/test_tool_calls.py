"""Tool calls at the door (issue 50, item 1): the hermes parse over generated and hostile texts,
the streamed split of a sample's text into content and calls at every byte position, the
refusals of tools and tool_choice by name, and whole answers and SSE frames built from the
core's messages: the streamed deltas reassemble to the unstreamed answer, the ids and logprobs
are the sampled ones. The door over a real fleet: tests/integration/proxy/test_door_tools.py."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import pytest
from support import tool_texts
from support.tool_texts import TEXTS, call, generated
from support.tool_texts import TOOLS as SCHEMA_TOOLS

from rollwire.proxy.http.dialect import convert
from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.dialect.openai import ChatBody
from rollwire.proxy.http.dialect.tokenizer import ChatTokenizer
from rollwire.proxy.http.dialect.toolcalls import format_for
from rollwire.proxy.http.dialect.toolcalls.hermes import HERMES
from rollwire.proxy.http.dialect.tools import Parser, ToolStream, check_tool_choice, parse_hermes, parser_for
from rollwire.proxy.http.stream import _Events
from rollwire.v1 import generator_pb2 as pb

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_hermes_calls_are_parsed_as_vllm_parses_them():
    one = parse_hermes("Let me add. " + call("add", {"a": 1}))
    assert one.content == "Let me add. " and [(c.name, c.arguments) for c in one.calls] == [("add", '{"a": 1}')]
    two = parse_hermes(TEXTS[5])
    assert [c.name for c in two.calls] == ["add", "mul"] and two.content is None
    assert json.loads(two.calls[1].arguments) == {"x": [1, {"y": "}{"}]}
    uni = parse_hermes(TEXTS[6]).calls[0]
    assert uni.name == "ünïcode" and "日本語 😀" in uni.arguments  # not \\u-escaped (ensure_ascii=False)
    assert parse_hermes(TEXTS[4]).content is None  # only whitespace before the call
    assert [c.name for c in parse_hermes(TEXTS[7]).calls] == ["add"]
    assert parse_hermes(TEXTS[15]).calls[0].arguments == '"a string"'
    ids = {c.id for c in two.calls}
    assert len(ids) == 2 and all(i.startswith("chatcmpl-tool-") for i in ids)


@pytest.mark.parametrize("text", [TEXTS[i] for i in (0, 1, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20)])
def test_text_that_is_not_all_calls_stays_the_content(text):
    parsed = parse_hermes(text)
    assert parsed.calls == [] and parsed.content == text


def reassemble(deltas: list[tuple[str, list[dict[str, Any]]]]) -> tuple[str | None, list[tuple[str, str]]]:
    content = "".join(c for c, _ in deltas)
    calls = [(t["function"]["name"], t["function"]["arguments"]) for _, ts in deltas for t in ts]
    return content or None, calls


def unstreamed(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    parsed = parse_hermes(text)
    return parsed.content or None, [(c.name, c.arguments) for c in parsed.calls]


def streamed(pieces: list[str]) -> list[tuple[str, list[dict[str, Any]]]]:
    stream = ToolStream(parse_hermes)
    out = [stream.feed(p, False) for p in pieces]
    out.append(stream.feed("", True))
    for content, _ in out[:-1]:
        assert "<tool_call>" not in content
    return out


def test_streamed_calls_reassemble_to_the_unstreamed_answer_at_every_split():
    rng = random.Random(50)
    texts = [t for t in TEXTS if len(t) < 1000] + [generated(rng) for _ in range(150)]
    for text in texts:
        want = unstreamed(text)
        for cut in range(len(text) + 1):  # two deltas, split at every position
            assert reassemble(streamed([text[:cut], text[cut:]])) == want, (text, cut)
        assert reassemble(streamed(list(text))) == want, text  # one character a delta
        pieces, at = [], 0
        while at < len(text):  # random pieces
            size = rng.randint(1, 7)
            pieces.append(text[at : at + size])
            at += size
        assert reassemble(streamed(pieces)) == want, text


FORMATS = {
    "llama3_json": (format_for("llama3_json", ["<|python_tag|>"]), tool_texts.llama3),
    "qwen3_xml": (format_for("qwen3_xml"), tool_texts.qwen3),
    "mistral": (format_for("mistral", ["[TOOL_CALLS]", "[ARGS]"]), tool_texts.mistral),
    "mistral_pre_v11": (format_for("mistral", ["[TOOL_CALLS]"]), tool_texts.mistral_pre_v11),
}


@pytest.mark.parametrize("key", list(FORMATS))
def test_every_format_streams_to_its_unstreamed_answer_at_every_split(key):
    """Each format's stream (content while settled, then the calls at the end) reassembles to its
    whole answer, for texts split in two at every place, one character a delta and in random pieces;
    content sent before the end never holds a call's opener."""
    fmt, generate = FORMATS[key]
    parse = Parser(fmt, SCHEMA_TOOLS)
    rng = random.Random(key)
    texts = [generate(rng) for _ in range(120)] + ["plain text, no call", "  lead", "tail  ", ""]
    early = 0
    for text in texts:
        whole = parse(text)
        want = (whole.content or None, [(c.name, c.arguments) for c in whole.calls])
        cuts = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]
        for pieces in cuts:
            stream = ToolStream(parse)
            out = [stream.feed(p, False) for p in pieces]
            early += sum(len(c) for c, _ in out)
            for content, _ in out:
                assert not any(o in content for o in fmt.openers), (text, pieces)
            out.append(stream.feed("", True))
            assert reassemble(out) == want, (key, text, pieces)
            assert stream.called is bool(whole.calls)
    assert (early > 0) is not fmt.hold_all  # content streams before the end unless the format holds it all


def test_content_before_a_call_streams_before_the_sample_ends():
    stream = ToolStream(parse_hermes)
    assert stream.feed("Let me ", False) == ("Let me ", [])
    assert stream.feed("add <tool", False) == ("add ", [])  # "<tool" could begin a call: held
    assert stream.feed('_call>{"name": "add", "arguments": {}}</tool_call>', False) == ("", [])
    content, calls = stream.feed("", True)
    assert content == "" and [c["function"]["name"] for c in calls] == ["add"] and calls[0]["index"] == 0
    assert stream.called and calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")


def body(**kw) -> ChatBody:
    return ChatBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})


@pytest.mark.parametrize(
    ("ask", "setting", "param", "words"),
    [
        ({"tools": []}, "hermes", "tools", "must not be an empty array"),
        ({"tools": [{"type": "function"}]}, "hermes", "tools", "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "hermes", "tools", "tools[0].function.name"),
        ({"tool_choice": "auto"}, "hermes", "tool_choice", "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": "always"}, "hermes", "tool_choice", "Invalid value for `tool_choice`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "hermes", "tool_choice.function", "Correct usage"),
        ({"tools": TOOLS, "tool_choice": {"function": {}}}, "hermes", "tool_choice.function.name", "Correct usage"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "mul"}}}, "hermes", "tool_choice", "does not match"),
        ({"tools": TOOLS}, "", "tool_choice", "http.tool_call_parser"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "", "tool_choice", "http.tool_call_parser"),
        ({"tools": TOOLS, "tool_choice": "required"}, "hermes", "tool_choice", "without one"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "add"}}}, "hermes", "tool_choice", "'add'"),
    ],
)
def test_tools_and_tool_choice_are_refused_by_name(ask, setting, param, words):
    with pytest.raises(HttpError) as caught:
        check_tool_choice(body(**ask), setting)
    assert caught.value.param == param and words in caught.value.message, caught.value.message


def test_a_parser_applies_only_to_tools_with_tool_choice_auto():
    for ask, setting, applies in [
        ({"tools": TOOLS}, "hermes", True),
        ({"tools": TOOLS, "tool_choice": "auto"}, "hermes", True),
        ({"tools": TOOLS, "tool_choice": "none"}, "hermes", False),
        ({"tools": TOOLS, "tool_choice": "none"}, "", False),
        ({}, "hermes", False),
    ]:
        check_tool_choice(body(**ask), setting)  # accepted
        assert (parser_for(body(**ask), HERMES if setting else None) is not None) is applies, ask


TEXT = "I will add. " + call("add", {"a": 1, "b": "日本"}) + call("add", {"a": 2})


def messages(text: str, step: int) -> list[pb.GenerateResponse]:
    """The core's messages for one sample of `text`, one character a token, `step` tokens a message."""
    first = pb.GenerateResponse()
    first.started.prompt_token_ids.extend([1, 2, 3])
    out = [first]
    for at in range(0, len(text), step):
        m = pb.GenerateResponse()
        piece = text[at : at + step]
        ids = [ord(ch) for ch in piece]
        m.tokens.add(sample_index=0, token_ids=ids, logprobs=[-0.5 - i for i in ids], text=piece, adapter_version=3)
        out.append(m)
    end = pb.GenerateResponse()
    end.finished.add(sample_index=0, finish_reason=pb.FINISH_REASON_EOS, completion_tokens=len(text))
    return [*out, end]


def test_the_whole_answer_carries_the_calls_and_the_sampled_ids():
    ask = body(tools=TOOLS, logprobs=True, return_token_ids=True, return_tokens_as_token_ids=True)
    group = convert.Group(1, [])
    for m in messages(TEXT, 5):
        group.apply(m)
    choice = convert.chat_response(ask, group, "m", "r", chr, Parser(HERMES, TOOLS))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I will add. "
    assert [json.loads(t["function"]["arguments"]) for t in choice["message"]["tool_calls"]] == [
        {"a": 1, "b": "日本"},
        {"a": 2},
    ]
    assert choice["token_ids"] == [ord(ch) for ch in TEXT]  # the parse reads the text; the ids are the sampled ones
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{ord(ch)}" for ch in TEXT]
    assert [e["logprob"] for e in content] == [-0.5 - ord(ch) for ch in TEXT]
    assert content[12]["bytes"] == list(TEXT[12].encode())  # the token's own bytes, as vLLM's
    plain = convert.chat_response(body(tools=TOOLS), group, "m", "r", chr, None)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": TEXT} and plain["finish_reason"] == "stop"


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64])
def test_the_sse_frames_reassemble_to_the_whole_answer(step):
    door = SimpleNamespace(tool_format=HERMES, token_text=chr)
    ask = body(tools=TOOLS, stream=True, return_token_ids=True)
    events = _Events(door, ask, pb.GenerateRequest(), "c", "chat.completion.chunk", "r", "")  # pyright: ignore[reportArgumentType]
    frames = [f for m in messages(TEXT, step) for f in events.payloads(m)]
    deltas = [f["choices"][0] for f in frames]
    content = "".join(d["delta"].get("content", "") for d in deltas)
    calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    ids = [t for d in deltas for t in d.get("token_ids", [])]
    group = convert.Group(1, [])
    for m in messages(TEXT, step):
        group.apply(m)
    whole = convert.chat_response(body(tools=TOOLS), group, "m", "r", chr, Parser(HERMES, TOOLS))["choices"][0]
    assert content == whole["message"]["content"]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in whole["message"]["tool_calls"]
    ]
    assert [t["index"] for t in calls] == [0, 1] and ids == [ord(ch) for ch in TEXT]
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]


def test_a_parser_the_tokenizer_cannot_serve_is_refused_by_name(tiny_model, tmp_path):
    """As vLLM refuses to start: llama3_json without `<|python_tag|>`, mistral without `[TOOL_CALLS]`; and
    a tag the replicas' text would leave out (a special token)."""
    plain = ChatTokenizer(tiny_model).vocabulary()
    for parser, token in [("llama3_json", "<|python_tag|>"), ("mistral", "[TOOL_CALLS]")]:
        with pytest.raises(
            ValueError, match=f"{parser} cannot be used.*no {token!r}".replace("[", r"\[").replace("|", r"\|")
        ):
            format_for(parser, *plain)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer.save_pretrained(tmp_path / "special")
    with pytest.raises(ValueError, match="is a special token"):
        format_for("mistral", *ChatTokenizer(tmp_path / "special").vocabulary())
    assert format_for("qwen3_xml", *plain).name == "qwen3_xml" and format_for("hermes", *plain).name == "hermes"
