"""vLLM's `/tokenize` and `/detokenize`, answered from the base model's tokenizer at the door.

The replicas' tokenizer is the truth for what they sample from; the door's is the same
files (`http.model_path`), so a text's ids here are the ids a text prompt becomes there
(the same special tokens added), and a chat's ids are exactly the prompt a chat completion
samples from (the same rendering, door.chat_prompt). Without `http.model_path` both answer
400 (NO_CHAT_TEMPLATE), as chat does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from pydantic import Field

from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.errors import HttpError, unsupported
from rollwire.proxy.http.dialect.openai import ChatBody, _Body, flatten_content, template_takes_parts
from rollwire.proxy.http.dialect.prompts import UNKNOWN_PROMPT_TOKENS
from rollwire.proxy.http.door import Door
from rollwire.proxy.tenants import Scope


class TokenizeBody(_Body):
    """POST /tokenize (vLLM): a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = Field(default=None, max_length=256)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template writes its own), as vLLM."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    chat_template: str | None = None


class DetokenizeBody(_Body):
    """POST /detokenize (vLLM)."""

    model: str | None = Field(default=None, max_length=256)
    tokens: list[int]


def _tokenizer(door: Door, route: str):
    if door.tokenizer is None:
        raise HttpError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{route} needs the base model's tokenizer at the proxy: set http.model_path (--http-model) to the model's "
            "folder",
            reason=Reason.NO_CHAT_TEMPLATE,
        )
    return door.tokenizer


async def tokenize(door: Door, body: TokenizeBody, client: str, scope: Scope) -> dict[str, Any]:
    """vLLM's answer: `count`, `max_model_len`, `tokens` and (with `return_token_strs`) `token_strs`."""
    chat = _tokenizer(door, "/tokenize")
    model = body.model or door.base_id
    door.resolve(model, scope)  # an adapter shares the base's tokenizer; an unknown name is refused as elsewhere
    if body.chat_template is not None:
        raise unsupported("chat_template", "the model's own template renders every chat; leave it unset")
    if (body.prompt is None) == (body.messages is None):
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "send either `prompt` (a text) or `messages` (a chat), not both and not neither",
            reason=Reason.BAD_REQUEST_BODY,
            param="prompt",
        )
    if body.messages is not None:
        messages = flatten_content(body.messages, template_takes_parts(chat.chat_template))
        request = ChatBody(
            model=model,
            messages=messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
            tools=body.tools,
        )
        if body.add_special_tokens:
            raise unsupported("add_special_tokens", "the chat template writes a chat's special tokens; leave it false")
        ids = await door.chat_prompt(request, client)
    else:
        special = body.add_special_tokens is not False
        ids = await door.prompt_ids(body.prompt or "", client, special=special, count_only=True)
    strs = None
    if body.return_token_strs:  # up to the door's token cap of lookups: off the event loop
        strs = await asyncio.to_thread(lambda: [chat.tokenizer.id_to_token(t) for t in ids])
    return {"count": len(ids), "max_model_len": door.max_model_len(), "tokens": ids, "token_strs": strs}


async def detokenize(door: Door, body: DetokenizeBody, scope: Scope) -> dict[str, Any]:
    """vLLM's answer: `prompt`, the ids' text (special tokens kept). At most a context's worth of
    ids (`max_model_len`, else the door's token cap) is decoded, on a worker thread with the GIL
    released (the batch call), so no list of ids a body can hold stalls the proxy."""
    chat = _tokenizer(door, "/detokenize")
    door.resolve(body.model or door.base_id, scope)
    cap = door.max_model_len() or UNKNOWN_PROMPT_TOKENS
    if len(body.tokens) > cap:
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{len(body.tokens)} tokens are more than a context holds here ({cap}); send at most {cap}",
            reason=Reason.PROMPT_TOO_LONG,
            param="tokens",
        )
    vocab = chat.tokenizer.get_vocab_size(with_added_tokens=True)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})",
            reason=Reason.BAD_TOKEN_ID,
            param="tokens",
        )
    ids = body.tokens
    text = await asyncio.to_thread(lambda: chat.tokenizer.decode_batch([ids], skip_special_tokens=False)[0])
    return {"prompt": text}
