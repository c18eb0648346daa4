"""Texts a hermes tool-call parser meets: hand-written hostile ones (malformed JSON, nested
braces, several calls, unclosed blocks, unicode, tags inside strings) and generated mixtures of
text and calls. Shared by the parse's unit tests (tests/unit/proxy/test_tool_calls.py) and its
parity with vLLM's own parser (tests/e2e/test_vllm_tool_parser_parity.py)."""

from __future__ import annotations

import json
import random
from typing import Any


def call(name: str, arguments: Any, pad: str = "") -> str:
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': arguments})}{pad}</tool_call>"


TEXTS = [
    "no call at all",
    "",
    call("add", {"a": 1, "b": 2}),
    "Let me add. " + call("add", {"a": 1}),
    "\n  " + call("add", {"a": 1}, pad="\n"),
    call("add", {"a": 1}) + "\n" + call("mul", {"x": [1, {"y": "}{"}]}) + " trailing",
    call("ünïcode", {"q": "日本語 😀", "nested": {"a": {"b": {"c": "}}}"}}}}),
    '<tool_call>{"name": "add", "arguments": {"a": 1}}',  # unclosed, complete JSON: a call
    '<tool_call>{"name": "add", "arguments": {"a": 1}',  # unclosed, incomplete: no call
    "text <tool_call>not json</tool_call>",
    call("add", {"a": 1}) + "<tool_call>{broken</tool_call>",  # one bad block: no call at all
    '<tool_call>{"name": "add"}</tool_call>',  # no arguments
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    "<tool_call>[1, 2]</tool_call>",
    "<tool_call></tool_call>",
    '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',  # the tag inside a string
    "<tool_call>" + "[" * 100000 + "</tool_call>",
    "almost <tool_cal",
    "<tool_call",
    "a < b and <tool> and </tool_call> alone",
]


def generated(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 3)):
        kind = rng.random()
        if kind < 0.4:
            parts.append(rng.choice(["hi ", "a<b ", " \n", "日本 ", "<tool", "}{", "😀"]))
        elif kind < 0.9:
            args = {rng.choice("abc"): rng.choice([1, "x}", [1, {"d": None}], "ü"])}
            parts.append(call(rng.choice(["f", "g_2", "ß"]), args, pad=rng.choice(["", " ", "\n"])))
        else:
            parts.append('<tool_call>{"name": "f", "argu')
    return "".join(parts)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "s": {"type": "string"},
                    "o": {"type": "object", "properties": {"k": {"type": "number"}}},
                    "b": {"type": "boolean"},
                    "n": {"type": ["number", "null"]},
                    "l": {"type": "array", "items": {"type": "integer"}},
                    "e": {"enum": ["x", 1, None]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "g"}},
    {
        "type": "function",
        "function": {"name": "ß x", "parameters": {"type": "object", "properties": {"q": {"type": "str"}}}},
    },
]
"""Tools whose schemas name every type the engine parsers read values as (tool_calls' schema.py)."""

_TEXT = ["hi ", "a<b ", " \n", "日本 ", "}{", "😀", "{", "[", "<", ">", "; ", "\n\n", "<think>", "</think>"]
_VALUES = [1, "x}", [1, {"d": None}], "ü", "12", "true", "1.5", "null", {"k": "2"}, ["3", 4], "[1]", "", "a\nb", 0]
_NAMES = ["f", "g", "ß x", "f ", "", "nope"]


def _args(rng: random.Random) -> dict[str, Any]:
    return {rng.choice("asobnlezq"): rng.choice(_VALUES) for _ in range(rng.randint(0, 3))}


def _cut(rng: random.Random, text: str) -> str:
    """A sample's text, sometimes ended early (max_tokens) at any place."""
    return text[: rng.randint(0, len(text))] if text and rng.random() < 0.25 else text


def llama3(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 3)):
        kind = rng.random()
        if kind < 0.3:
            parts.append(rng.choice([*_TEXT, "<|python_tag|>"]))
        else:
            call: dict[str, Any] = {"name": rng.choice([*_NAMES, 7])}
            key = rng.choice(["arguments", "parameters", "arguments", "args"])
            call[key] = rng.choice([_args(rng), "s", None, 2])
            parts.append(json.dumps(call, ensure_ascii=rng.random() < 0.5))
            parts.append(rng.choice(["; ", "", " ", ";"]))
    return _cut(rng, "".join(parts))


def _qwen3_call(rng: random.Random) -> str:
    nl = rng.choice(["\n", "", "\n\n"])
    params = "".join(
        f"<parameter={key}>{nl}{value if isinstance(value, str) else json.dumps(value)}{nl}"
        + rng.choice(["</parameter>", "</parameter>", ""])
        + nl
        for key, value in _args(rng).items()
    )
    head = rng.choice(["<tool_call>" + nl, "<tool_call>" + nl, ""])
    tail = rng.choice(["</function>" + nl + "</tool_call>", "</function>", "</tool_call>", ""])
    return f"{head}<function={rng.choice(_NAMES)}>{nl}{params}{tail}"


def qwen3(rng: random.Random) -> str:
    parts = [rng.choice(_TEXT) if rng.random() < 0.35 else _qwen3_call(rng) for _ in range(rng.randint(0, 3))]
    return _cut(rng, rng.choice(["", "\n", " "]).join(parts))


def mistral(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.3:
            parts.append(rng.choice([*_TEXT, "[ARGS]"]))
            continue
        args = rng.choice([json.dumps(_args(rng)), "[1, 2]", '"s"', "not json", "", '{"a": '])
        sep = rng.choice(["[ARGS]", "[ARGS]", "", " [ARGS] "])
        parts.append(f"[TOOL_CALLS]{rng.choice(_NAMES)}{sep}{args}{rng.choice(['', ' trailing', '{}'])}")
    return _cut(rng, "".join(parts))


def mistral_pre_v11(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 2)):
        if rng.random() < 0.2:
            parts.append(rng.choice(_TEXT))
            continue
        entries = [
            {"name": rng.choice([*_NAMES, 5]), "arguments": rng.choice([_args(rng), "raw", None])}
            for _ in range(rng.randint(1, 2))
        ]
        body = rng.choice([json.dumps(entries), json.dumps(entries[0]) if entries else "{}", "not json", '[{"x": 1}]'])
        parts.append(f"[TOOL_CALLS]{rng.choice(['', ' ', '[TOOL_CALLS]'])}{body}{rng.choice(['', ' tail'])}")
    return _cut(rng, "".join(parts))
