"""The tag grammar vLLM's engine parsers (qwen3_xml, mistral from v11) read a sample's text with.

A text is cut into its terminals (the format's literal tags, the longest one where several begin
at a place, left to right) and the text between them; a table of transitions, (state,
terminal) to the next state and what the step does, walks them. A terminal with no transition
from the state is text of that state. Text is content in CONTENT, the call's name in
TOOL_NAME, its arguments in TOOL_ARGS, and dropped elsewhere. Then, as vLLM's ParserEngine
builds its answer: a call with a name (stripped) and arguments converted by the format, its
values read as the tool's schema types (schema.py), is kept where the format accepts the name;
with calls the content is the content before the first call's start, stripped, or None;
without, all the content text (tags dropped), None when empty or, once a call began, only
whitespace.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rollwire.proxy.http.dialect.toolcalls import schema
from rollwire.proxy.http.dialect.toolcalls.base import Parsed, ToolCall, Tools, chatcmpl_id

CONTENT, NAME, ARGS = "CONTENT", "TOOL_NAME", "TOOL_ARGS"
START, ARG = "start", "arg"
"""What a step does: begin a call; add the terminal's own text to the call's arguments."""


@dataclass(frozen=True)
class Grammar:
    terminals: tuple[str, ...]
    transitions: Mapping[tuple[str, str], tuple[str, tuple[str, ...]]]
    arguments: Callable[[str], str]
    """A named call's raw argument text as a JSON string."""
    nameless: Callable[[str], tuple[str, str]]
    """The name and arguments of a call whose name is empty but whose argument text is not."""
    accept: Callable[[str], bool]
    make_id: Callable[[], str] = chatcmpl_id
    pattern: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        alternatives = sorted(self.terminals, key=len, reverse=True)  # the longest first where several begin
        object.__setattr__(self, "pattern", re.compile("|".join(map(re.escape, alternatives))))

    def parse(self, text: str, tools: Tools) -> Parsed:
        state, slots, before, content = CONTENT, [], None, []
        at = 0
        for match in [*self.pattern.finditer(text), None]:
            piece = text[at : match.start()] if match else text[at:]
            pieces = [piece] if piece else []
            step = self.transitions.get((state, match.group())) if match else None
            if match and step is None:
                pieces.append(match.group())
            for piece in pieces:
                if state == CONTENT:
                    content.append(piece)
                elif state == NAME:
                    slots[-1][0] += piece
                elif state == ARGS:
                    slots[-1][1] += piece
            if step is not None:
                state, does = step
                if START in does:
                    if before is None:
                        before = "".join(content)
                    slots.append(["", ""])
                if ARG in does:
                    slots[-1][1] += match.group()  # pyright: ignore[reportOptionalMemberAccess]
            if match:
                at = match.end()
        calls = [c for c in (self._call(name, args, tools) for name, args in slots) if c is not None]
        if calls:
            return Parsed((before or "").strip() or None, calls)
        whole = "".join(content)
        return Parsed(None if not whole or (slots and not whole.strip()) else whole, [])

    def _call(self, name: str, args: str, tools: Tools) -> ToolCall | None:
        if not name and not args:
            return None
        name = name.strip()
        if not name and args.strip():
            name, arguments = self.nameless(args)
        elif args.strip():
            arguments = self.arguments(args)
        else:
            arguments = "{}"
        if not isinstance(name, str) or not self.accept(name):
            return None
        return ToolCall(name, schema.fix_types(arguments, name, tools), self.make_id())
