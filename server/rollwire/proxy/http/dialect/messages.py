"""A chat's messages as vLLM hands them to the chat template (its parse_chat_messages), so the
door renders the prompt vLLM renders from the same request. A harness sends its history back as
OpenAI's client serializes it (an assistant turn of tool calls with `content: null`, arguments as
a JSON string, `reasoning_content`, fields of its own); vLLM rebuilds each message before the
template sees it, and so does the door:

- `content`: text for a template that takes a string (null is "", text parts joined by newlines),
  text parts for one that loops over them (null is no part, a string is one part);
- only the fields vLLM keeps: `role` and `content`; an assistant's `tool_calls` (dropped when
  empty) and its reasoning (`reasoning`, or the deprecated `reasoning_content`, under both names);
  a tool's `tool_call_id`; a string `name` or `task`; a developer's `tools`;
- each tool call's `function.arguments` as an object, as tool-use templates expect: a JSON string
  is parsed, and one that is not JSON, or not an object, or empty, becomes {} (vLLM keeps the
  turn rather than fail every later one); a call that is not an object, or not of type
  "function", is refused, naming `messages`.
"""

from __future__ import annotations

import json
from typing import Any

from rollwire.proxy.http.dialect.errors import unsupported
from rollwire.proxy.http.dialect.openai import flatten_content


def conversation(messages: list[dict[str, Any]], keep_parts: bool) -> list[dict[str, Any]]:
    """`messages` rebuilt as vLLM's parse_chat_messages rebuilds them (`keep_parts`: the template
    loops over content parts, dialect/openai.template_takes_parts)."""
    out = []
    for i, message in enumerate(flatten_content(messages, keep_parts)):
        role, content = message.get("role"), message.get("content")
        if content is None:
            content = [] if keep_parts else ""
        elif keep_parts and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        turn: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls:
                turn["tool_calls"] = [_call(i, j, call) for j, call in enumerate(calls)]
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                turn["reasoning"] = turn["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            turn["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                turn[key] = message[key]
        if role == "developer":
            turn["tools"] = message.get("tools")
        out.append(turn)
    return out


def _call(i: int, j: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
        raise unsupported(
            "messages",
            f"messages[{i}].tool_calls[{j}] is not a call of type 'function' with a `function` object; send "
            '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}',
        )
    return {**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}}


def _arguments(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # a hostile nesting is not JSON the template can take either
            return {}
    return arguments if isinstance(arguments, dict) else {}
