"""vLLM's `mistral` parser, in the two forms it picks by the tokenizer (vLLM's MistralParser):

- v11 and later (`[ARGS]` in the vocabulary): `[TOOL_CALLS]NAME[ARGS]{...}` (or `NAME{...}`),
  each call after its own `[TOOL_CALLS]`, read by grammar.py: the name as written, stripped,
  empty included; the arguments the first JSON value after it (text that does not parse is
  kept as it is, none is `{}`), read as the tool's schema types; text after a call's JSON is
  dropped; the content is the text before the first call, stripped.
- before v11: `[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]` (or one object): the JSON
  after the first `[TOOL_CALLS]` that is followed by more than whitespace; entries that are not
  call objects are skipped, a missing or non-string name is "", string arguments are kept as
  written. Without a call, the content is that JSON's text, not the text before the tag (vLLM's
  answer), so nothing streams before the sample ends.

Call ids are 9 letters and digits, as Mistral's chat templates check them when a turn is fed back.
`[TOOL_CALLS]` must be text the replicas send: a tokenizer that makes it a special token (most
Mistral releases) is refused at the door's start (tools.check_tokenizer).
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from rollwire.proxy.http.dialect.toolcalls.base import Format, Parsed, ToolCall, Tools
from rollwire.proxy.http.dialect.toolcalls.grammar import ARG, ARGS, CONTENT, NAME, START, Grammar

BOT, ARGS_TAG = "[TOOL_CALLS]", "[ARGS]"
_ALNUM = string.ascii_letters + string.digits
_DECODER = json.JSONDecoder()
_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)


def mistral_id() -> str:
    return "".join(random.choices(_ALNUM, k=9))


def arguments(raw: str) -> str:
    """The first JSON value of `raw` as written; `raw` stripped when none parses; "{}" when empty."""
    stripped = raw.strip()
    if not stripped:
        return "{}"
    try:
        _, end = _DECODER.raw_decode(stripped)
    except (ValueError, RecursionError):
        return stripped
    return stripped[:end]


GRAMMAR = Grammar(
    terminals=(BOT, ARGS_TAG, "{"),
    transitions={
        (CONTENT, BOT): (NAME, (START,)),
        (NAME, ARGS_TAG): (ARGS, ()),
        (NAME, "{"): (ARGS, (ARG,)),
        (ARGS, BOT): (NAME, (START,)),
    },
    arguments=arguments,
    nameless=lambda raw: ("", arguments(raw)),
    accept=lambda name: True,
    make_id=mistral_id,
)


def parse_pre_v11(text: str, tools: Tools = ()) -> Parsed:
    if BOT not in text:
        return Parsed(text or None, [])
    content, *segments = text.split(BOT)
    body = next((s.strip() for s in segments if s.strip()), "")
    parsed: Any = None
    try:
        parsed, _ = _DECODER.raw_decode(body)
    except (ValueError, RecursionError):
        found = _ARRAY.findall(body)
        try:
            parsed = json.loads(found[0]) if found else None
        except (ValueError, RecursionError):
            parsed = None
    calls = _calls(parsed)
    if not calls:
        return Parsed(body or None, [])
    return Parsed(content if content.strip() else None, calls)


def _calls(parsed: Any) -> list[ToolCall]:
    entries = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
    calls = []
    for entry in entries:
        if not isinstance(entry, dict) or ("name" not in entry and "arguments" not in entry):
            continue
        name, args = entry.get("name"), entry.get("arguments")
        args = "{}" if args is None else args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(name if isinstance(name, str) else "", args, mistral_id()))
    return calls


MISTRAL = Format("mistral", GRAMMAR.parse, openers=(BOT,), strip=True, needs=(BOT,))
MISTRAL_PRE_V11 = Format("mistral", parse_pre_v11, hold_all=True, needs=(BOT,))
