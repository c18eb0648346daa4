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
