"""What every tool-call format gives: the calls a sample's text holds and its content, and
how much of a streamed text is content whatever follows.

Invariants (each format module keeps them, tests/unit/proxy/test_tool_calls.py checks them):
- `parse` reads the text only; the sample's token ids and logprobs are never changed;
- `parse` is vLLM's serving answer for that parser (tests/e2e/test_vllm_tool_parser_parity.py);
- for any text and any continuation, the content `parse` gives the whole text (with calls or
  without) begins with what `openers`, `strip` and `hold_all` say is settled of the text so far
  (tools.ToolStream sends only that before the sample ends), so a stream reassembles to the
  unstreamed answer.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Tools = Sequence[Mapping[str, Any]]
"""The request's `tools` (OpenAI's function tools, already checked by tools.check_tool_choice)."""


def chatcmpl_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"  # vLLM's random id: 16 hex digits


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The call's arguments as a JSON string, as vLLM's parser for the format writes them."""
    id: str = field(default_factory=chatcmpl_id)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class Format:
    """One tool-call format, as vLLM's `--tool-call-parser NAME` reads it."""

    name: str
    parse: Callable[[str, Tools], Parsed]
    openers: tuple[str, ...] = ()
    """Where a call may begin: content before the first of them (less an end that could begin
    one) is settled, per `strip`."""
    strip: bool = False
    """The content of a sample with calls is stripped of whitespace (vLLM's engine parsers); without
    calls it is not, so nothing is settled while the text begins with whitespace, and trailing
    whitespace is held. False: content before calls is kept as written, None when only whitespace."""
    hold_all: bool = False
    """A call may begin anywhere or changes what came before (llama3_json, mistral before v11):
    nothing is content until the sample ends."""
    needs: tuple[str, ...] = ()
    """Tokens the tokenizer must hold as ordinary (not special) text for the parse to apply, as
    vLLM's parser refuses to start without them."""
    needs_any: bool = False
    """True: one of `needs` suffices."""


def partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
