"""vLLM's `qwen3_xml` and `qwen3_coder` parsers (one engine in vLLM 0.32, Qwen3EngineToolParser):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

as grammar.py reads it with vLLM's transitions: a `<function=` without `<tool_call>` begins a
call too, several functions may share one `<tool_call>`, an unclosed last call counts; each
parameter's value loses one leading and one trailing newline, is text, and is then read as the
tool's schema types (a later parameter of the same key wins); a call needs a name. `<think>`
and `</think>` are text (no reasoning parser at the door).
"""

from __future__ import annotations

import json
import re

from rollwire.proxy.http.dialect.toolcalls.base import Format
from rollwire.proxy.http.dialect.toolcalls.grammar import ARG, ARGS, CONTENT, NAME, START, Grammar

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END, PARAM, PARAM_END = "<function=", "</function>", "<parameter=", "</parameter>"
PREAMBLE, BETWEEN = "TOOL_PREAMBLE", "TOOL_BETWEEN"

_PARAM = re.compile(
    r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))",
    re.DOTALL,
)


def _trim(value: str) -> str:
    """One leading and one trailing newline off (the template's markup)."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def arguments(raw: str) -> str:
    return json.dumps({m.group(1): _trim(m.group(2)) for m in _PARAM.finditer(raw)}, ensure_ascii=False)


def _nameless(raw: str) -> tuple[str, str]:
    """vLLM's fallback for a call with arguments and no name: the body as a JSON envelope."""
    body = raw.strip()
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return "", body
    if not isinstance(parsed, dict):
        return "", body
    name = parsed.get("name", "")
    for key in ("arguments", "parameters"):
        if key in parsed:
            value = parsed[key]
            return name, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return name, json.dumps({k: v for k, v in parsed.items() if k != "name"}, ensure_ascii=False)


GRAMMAR = Grammar(
    terminals=("<think>", "</think>", TOOL_START, TOOL_END, FUNC, FUNC_END, PARAM, PARAM_END, ">"),
    transitions={
        (CONTENT, TOOL_START): (PREAMBLE, (START,)),
        (CONTENT, FUNC): (NAME, (START,)),
        (PREAMBLE, TOOL_END): (CONTENT, ()),
        (PREAMBLE, FUNC): (NAME, ()),
        (NAME, ">"): (ARGS, ()),
        (NAME, FUNC_END): (BETWEEN, ()),
        (ARGS, FUNC_END): (BETWEEN, ()),
        (ARGS, PARAM): (ARGS, (ARG,)),
        (ARGS, PARAM_END): (ARGS, (ARG,)),
        (BETWEEN, TOOL_END): (CONTENT, ()),
        (BETWEEN, TOOL_START): (PREAMBLE, (START,)),
        (BETWEEN, FUNC): (NAME, (START,)),
    },
    arguments=arguments,
    nameless=_nameless,
    accept=bool,
)

QWEN3_XML = Format("qwen3_xml", GRAMMAR.parse, openers=(TOOL_START, FUNC), strip=True)
