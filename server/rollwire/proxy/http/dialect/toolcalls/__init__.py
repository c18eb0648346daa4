"""Tool-call formats, one module each, behind one small interface (base.Format), chosen as vLLM
chooses its parser: by the name given to `--tool-call-parser` (here `http.tool_call_parser`),
checked against the model's tokenizer once, when the door starts."""

from __future__ import annotations

from collections.abc import Collection

from rollwire.proxy.http.dialect.toolcalls.base import Format, Parsed, ToolCall, Tools
from rollwire.proxy.http.dialect.toolcalls.hermes import HERMES
from rollwire.proxy.http.dialect.toolcalls.llama3_json import LLAMA3_JSON
from rollwire.proxy.http.dialect.toolcalls.mistral import ARGS_TAG, MISTRAL, MISTRAL_PRE_V11
from rollwire.proxy.http.dialect.toolcalls.qwen3_xml import QWEN3_XML

NAMES = ("hermes", "llama3_json", "qwen3_xml", "qwen3_coder", "mistral")
"""The values http.tool_call_parser takes (besides "", no parser); qwen3_coder is qwen3_xml, as in vLLM 0.32."""

__all__ = ["NAMES", "Format", "Parsed", "ToolCall", "Tools", "format_for"]


def format_for(name: str, vocab: Collection[str] = (), special: Collection[str] = ()) -> Format:
    """The format `name` reads, for a tokenizer whose tokens are `vocab` (`special`: those the
    replicas' text leaves out). ValueError, with a sentence naming the parser and the token,
    where vLLM's parser would refuse to start or where its tag would never reach the door's text."""
    if name not in NAMES:
        raise ValueError(f"http.tool_call_parser {name!r} is not one of {', '.join(NAMES)}")
    fmt = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "qwen3_xml": QWEN3_XML, "qwen3_coder": QWEN3_XML}.get(name)
    if fmt is None:
        fmt = MISTRAL if ARGS_TAG in vocab else MISTRAL_PRE_V11
    for token in fmt.needs:
        if token not in vocab:
            raise ValueError(
                f"http.tool_call_parser {name} cannot be used with this model's tokenizer: it has no {token!r} token "
                "(vLLM refuses the same parser at start)"
            )
        if token in special:
            raise ValueError(
                f"http.tool_call_parser {name} cannot be used with this model's tokenizer: {token!r} is a special token, "
                "and the replicas' text leaves special tokens out, so no call would ever be seen"
            )
    return fmt
