"""vLLM's `llama3_json` parser (also its `llama4_json`): JSON objects `{"name": ..., "arguments"
(or "parameters"): ...}` anywhere in the text, `<|python_tag|>` before them or not.

As vLLM's Llama3JsonToolParser: each `{` not inside an object already read begins an object
(Python's JSON decoder from there, so what follows it is not read); every such object must
have a string `name` and `arguments` or `parameters`, else the sample has no calls and its
whole text is the content. With calls, the content is None: text around the objects is not
content (vLLM drops it). A `{` right where an object ends counts as inside it (vLLM's
bound), so `{...}{...}` is no call; `{...}; {...}` is two.
"""

from __future__ import annotations

import json

from rollwire.proxy.http.dialect.toolcalls.base import Format, Parsed, ToolCall, Tools

BOT = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def parse(text: str, tools: Tools = ()) -> Parsed:
    if BOT not in text and "{" not in text:
        return Parsed(text, [])
    calls, end, at = [], -1, text.find("{")
    while at != -1:
        if at > end:
            try:
                obj, end = _DECODER.raw_decode(text, at)
                name = obj["name"]
                arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
                if not isinstance(name, str):
                    raise TypeError("a tool call's name is a string")
                calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
            except (ValueError, TypeError, KeyError, RecursionError):
                return Parsed(text, [])
        at = text.find("{", at + 1)
    return Parsed(None, calls) if calls else Parsed(text, [])


LLAMA3_JSON = Format("llama3_json", parse, hold_all=True, needs=(BOT,))
