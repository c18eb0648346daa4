"""vLLM's `hermes` parser: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

All or nothing, as vLLM's Hermes2ProToolParser: every block parses into a call, or the
sample has no calls and its whole text is the content. An unclosed last block counts when
its JSON is complete; text after the first block is not content (vLLM drops it too).
"""

from __future__ import annotations

import json

from rollwire.proxy.http.dialect.toolcalls.base import Format, Parsed, ToolCall, Tools

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _blocks(text: str) -> list[str]:
    """The bodies of the `<tool_call>` blocks in `text`; an unclosed last one runs to the end."""
    bodies, at = [], text.find(OPEN)
    while at != -1:
        start = at + len(OPEN)
        end = text.find(CLOSE, start)
        if end == -1:
            bodies.append(text[start:])
            break
        bodies.append(text[start:end])
        at = text.find(OPEN, end + len(CLOSE))
    return bodies


def parse(text: str, tools: Tools = ()) -> Parsed:
    """The calls, and the text before the first block as the content (None when only whitespace)."""
    first = text.find(OPEN)
    if first == -1:
        return Parsed(text, [])
    calls = []
    try:
        for body in _blocks(text):
            call = json.loads(body)
            name = call["name"]
            if not isinstance(name, str):
                raise TypeError("a tool call's name is a string")
            calls.append(ToolCall(name, json.dumps(call["arguments"], ensure_ascii=False)))
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return Parsed(text, [])
    content = text[:first]
    return Parsed(content if content.strip() else None, calls)


HERMES = Format("hermes", parse, openers=(OPEN,))
