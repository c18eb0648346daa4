"""Tool calls as vLLM returns them: which requests a parser applies to, and the streamed split of
a sample's text into content and calls. The formats themselves are toolcalls/, one module each.

The parse reads the sample's text only; its token ids and logprobs are never changed (a
learner trains on the ids the model sampled, not on a re-rendering of the calls).

Invariants:
- a parser applies only where vLLM's would: `http.tool_call_parser` set (vLLM's
  `--enable-auto-tool-choice --tool-call-parser NAME`), the request has `tools`, and
  `tool_choice` is "auto" (its default when tools are sent);
- `ToolStream` sends content only while it is settled (toolcalls/base.py: content whatever
  follows) and holds the rest until the sample ends, then sends what the format's parse of the
  whole text says: the streamed deltas reassemble to the unstreamed answer exactly, for any
  split of the text into deltas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.errors import HttpError, unsupported
from rollwire.proxy.http.dialect.toolcalls import NAMES, Format, Parsed, ToolCall
from rollwire.proxy.http.dialect.toolcalls.base import partial
from rollwire.proxy.http.dialect.toolcalls.hermes import HERMES

PARSERS = NAMES
"""The values http.tool_call_parser takes (besides "", no parser)."""

__all__ = ["PARSERS", "Parsed", "Parser", "ToolCall", "ToolStream", "check_tool_choice", "parse_hermes", "parser_for"]


class Parser:
    """A format bound to one request's tools: called with a sample's whole text."""

    def __init__(self, fmt: Format, tools: Any) -> None:
        self.format, self.tools = fmt, tools or []

    def __call__(self, text: str) -> Parsed:
        return self.format.parse(text, self.tools)


def parse_hermes(text: str) -> Parsed:
    return HERMES.parse(text, ())


def parser_for(body: Any, fmt: Format | None) -> Parser | None:
    """The parse that applies to a chat body (check_tool_choice passed), or None."""
    if fmt is None or not body.tools or (body.tool_choice or "auto") != "auto":
        return None
    return Parser(fmt, body.tools)


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

    def __init__(self, parse: Parser | Callable[[str], Parsed], fmt: Format = HERMES) -> None:
        self.parse = parse
        self.format = parse.format if isinstance(parse, Parser) else fmt
        self.text = ""
        self.sent = 0
        self.first = -1
        """Where the first opener of a call begins, once one has come."""
        self.longest = max((len(o) for o in self.format.openers), default=1)
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
            since = max(0, before - self.longest + 1)
            found = [i for i in (self.text.find(o, since) for o in self.format.openers) if i != -1]
            self.first = min(found, default=-1)
        if not finished:
            upto = self._settled()
            content = self.text[self.sent : upto] if upto > self.sent else ""
            self.sent = max(self.sent, upto)
            return content, []
        parsed = self.parse(self.text)
        whole = parsed.content or ""
        content, self.sent = whole[self.sent :], len(self.text)
        if not parsed.calls:
            return content, []
        self.called = True
        return content, [{"index": i, **call.openai()} for i, call in enumerate(parsed.calls)]

    def _settled(self) -> int:
        """How much of the text is content whatever follows (toolcalls/base.py, Format): up to the
        first call, less an end that could begin one; nothing while it is only whitespace (hermes:
        such content before calls is none) or, where content with calls is stripped, while it
        begins with whitespace, and never its trailing whitespace."""
        fmt = self.format
        if fmt.hold_all or not self.text:
            return 0
        at = self.first
        if at == -1:
            at = len(self.text) - max(partial(self.text, o) for o in fmt.openers)
        if fmt.strip:
            if self.text[0].isspace():
                return 0
            while at > 0 and self.text[at - 1].isspace():  # scans only the trailing whitespace, never copies
                at -= 1
            return at
        if self.blank and self.blank_upto < at:
            if self.text[self.blank_upto : at].strip():
                self.blank = False
            else:
                self.blank_upto = at
        return 0 if self.blank else at
