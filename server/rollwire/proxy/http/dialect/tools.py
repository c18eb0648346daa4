"""Tool calls as vLLM returns them: which requests a parser applies to, and the parse.

The parse reads the sample's text only; its token ids and logprobs are never changed (a
learner trains on the ids the model sampled, not on a re-rendering of the calls).

Invariants:
- a parser applies only where vLLM's would: `http.tool_call_parser` set (vLLM's
  `--enable-auto-tool-choice --tool-call-parser NAME`), the request has `tools`, and
  `tool_choice` is "auto" (its default when tools are sent);
- `parse_hermes` is all or nothing, as vLLM's hermes parser: every `<tool_call>` block parses
  into a call, or the sample has no calls and its whole text is the content;
- `ToolStream` sends content only while it cannot be part of a call and holds the rest until
  the sample ends, then sends what `parse_hermes` of the whole text says: the streamed deltas
  reassemble to the unstreamed answer exactly, for any split of the text into deltas.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.errors import HttpError, unsupported

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)
"""The values http.tool_call_parser takes (besides "", no parser)."""


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The call's arguments as a JSON string (json.dumps of the object the model wrote, as vLLM sends it)."""
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall]


Parser = Callable[[str], Parsed]


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


def parse_hermes(text: str) -> Parsed:
    """vLLM's hermes parse: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks
    become calls, the text before the first block the content (None when only whitespace);
    any block that is not such an object leaves the text as the content, with no calls."""
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


_PARSE: dict[str, Parser] = {"hermes": parse_hermes}


def parser_for(body: Any, setting: str) -> Parser | None:
    """The parse that applies to a chat body (check_tool_choice passed), or None."""
    if not setting or not body.tools or (body.tool_choice or "auto") != "auto":
        return None
    return _PARSE[setting]


def check_tool_choice(body: Any, setting: str) -> None:
    """vLLM's checks of `tools` and `tool_choice`, each refusal a 400 naming its field; then
    what rollwire cannot do: "auto" without a parser (as vLLM without one), and "required" or
    a named tool (vLLM forces them with a grammar; rollwire samples unconstrained)."""
    tools = body.tools
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else None)  # vLLM's default
    if tools == []:
        raise _bad("tools must not be an empty array; send at least one tool or leave tools out", "tools")
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise _bad(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad(f"tools[{i}].function.name must be a non-empty string", "tools")
    if choice is None or choice == "none":
        return
    if not tools:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, dict):
        _check_named(choice, tools)
    elif choice not in ("auto", "required"):
        raise _bad(
            f'Invalid value for `tool_choice`: {str(choice)[:80]}! Only named tools, "none", "auto" or "required" '
            "are supported.",
            "tool_choice",
        )
    if choice == "auto" and not setting:
        raise unsupported(
            "tool_choice",
            '"auto" tool choice needs a tool call parser at the door (vLLM: --enable-auto-tool-choice '
            f"--tool-call-parser): set http.tool_call_parser to one of {', '.join(PARSERS)}, or send "
            'tool_choice "none" to give the template the tools without parsing calls',
        )
    if choice != "auto":
        wanted = "required" if choice == "required" else f"function {choice['function']['name'][:80]!r}"
        raise unsupported(
            "tool_choice",
            f"{wanted} would force a tool call with a grammar, and rollwire samples without one (a sample comes "
            'from the distribution the learner is told it came from); send "auto": the calls the model makes '
            "are parsed",
        )


def _check_named(choice: dict[str, Any], tools: list[dict[str, Any]]) -> None:
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise _bad(f"Invalid value for `function` in `tool_choice`! {usage}", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"Invalid `name` in `function` in `tool_choice`! {usage}", "tool_choice.function.name")
    if all(t["function"]["name"] != name for t in tools):
        raise _bad("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")


def _bad(message: str, param: str) -> HttpError:
    return HttpError(grpc.StatusCode.INVALID_ARGUMENT, message, reason=Reason.BAD_REQUEST_BODY, param=param)


class ToolStream:
    """One streamed sample's text, split into content sent at once and the calls sent at its end."""

    def __init__(self, parse: Parser) -> None:
        self.parse = parse
        self.text = ""
        self.sent = 0
        self.first = -1
        """Where the first `<tool_call>` begins, once it has come."""
        self.blank, self.blank_upto = True, 0
        """While the content so far is whitespace only, and up to where it was checked (each delta scans only
        what is new: a sample's stream costs time linear in its length)."""
        self.called = False
        """True once the sample's calls were sent (its finish_reason is then "tool_calls")."""

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """The content to send now for `delta` of the sample's text, and, once `finished`, its
        calls as streamed `delta.tool_calls` entries (each whole: index, id, type, function)."""
        before = len(self.text)
        self.text += delta
        if self.first == -1:
            self.first = self.text.find(OPEN, max(0, before - len(OPEN) + 1))
        if not finished:
            upto = self._safe()
            content = self.text[self.sent : upto] if upto > self.sent else ""
            self.sent = max(self.sent, upto)
            return content, []
        parsed = self.parse(self.text)
        if not parsed.calls:
            content, self.sent = self.text[self.sent :], len(self.text)
            return content, []
        self.called = True
        whole = parsed.content or ""
        content = whole[self.sent :]
        self.sent = len(self.text)
        return content, [{"index": i, **call.openai()} for i, call in enumerate(parsed.calls)]

    def _safe(self) -> int:
        """How much of the text is content whatever follows: up to the first call, less an
        end that could begin one, and nothing while it is only whitespace (a content of only
        whitespace before calls is none)."""
        at = self.first if self.first != -1 else len(self.text) - _partial(self.text, OPEN)
        if self.blank and self.blank_upto < at:
            if self.text[self.blank_upto : at].strip():
                self.blank = False
            else:
                self.blank_upto = at
        return 0 if self.blank else at


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
