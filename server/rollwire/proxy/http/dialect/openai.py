"""The request bodies the door takes, as typed models, and the fields it cannot honour.

Every field OpenAI's or vLLM's API defines for these endpoints is declared here: honoured,
honoured only at its neutral value (`NEUTRAL`: anything else is a 400 naming the field),
or accepted with no effect because it has no sampling meaning (`user`, `store`, `metadata`,
`service_tier`, ...; docs/http.md lists them). A field no API defines is a 400 naming it too
(extra="forbid"), so nothing a caller sends is silently dropped. An explicit null is the
field left out, as OpenAI's spec allows (`"n": null` is n=1).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from rollwire.proxy.http.dialect.errors import unsupported

MAX_SEED = (1 << 64) - 1
UINT32, INT32, INT64 = (1 << 32) - 1, (1 << 31) - 1, (1 << 63) - 1
"""Every integer field is bounded by the wire type it becomes (generator.proto), or by int64 when it reaches no
wire: a value out of range is a 400 naming the field, never a 500 from the protobuf setter (audit A9)."""
TokenId = Annotated[int, Field(ge=0, le=INT32)]
"""A prompt token id (TokenIds.ids is int32)."""
Int64 = Annotated[int, Field(ge=-INT64 - 1, le=INT64)]
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "raise_exception",
        "strftime_now",
    }
)
"""chat_template_kwargs names the door itself gives the template (or the template's helpers): a 400 if sent."""
_NULLABLE = FieldInfo(default=None)
"""What an unknown key is taken for when its value is null: kept, so extra="forbid" names it."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        """`"field": null` reads as the field left out (its default), as OpenAI's and vLLM's
        servers read it; a required field sent as null is then missing."""
        if isinstance(data, dict):
            return {
                k: v for k, v in data.items() if v is not None or cls.model_fields.get(k, _NULLABLE).default is None
            }
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """What both generation endpoints share."""

    model: str = Field(min_length=1, max_length=256)
    n: int = Field(default=1, ge=1, le=1024)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-1, le=UINT32)
    """vLLM's convention: 0 or -1 = off."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """vLLM's extension: the prompt's and each choice's token ids."""
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: the tokens in `logprobs` spelled "token_id:<int>" (every token identifiable, whatever its
    text)."""
    ignore_eos: bool = False
    follow: bool = False
    """rollwire's extension: with an adapter at its newest version (`NAME`), running samples switch to each newly
    committed version (docs/http.md); each choice's `token_versions` says which version produced each token."""
    return_kept_tokens: bool = False
    """rollwire's extension: each choice's `kept_token_ids`, per token the ids top-k/top-p kept (docs/http.md)."""
    include_stop_str_in_output: bool = False
    routed_experts_prompt_start: Int64 = Field(default=0, ge=0)
    """vLLM's: with http.return_routed_experts, each choice's `routed_experts` leaves out this many of the prompt's
    first positions (a multi-turn client already has them); above the prompt's length it leaves the whole prompt out."""
    # Accepted and not used: no sampling meaning (docs/http.md, "Fields").
    user: str | None = Field(default=None, max_length=256)
    """OpenAI's end-user tag."""
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    service_tier: str | None = Field(default=None, max_length=64)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    # Honoured only at their neutral value (check_unhonoured):
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: Int64 | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    best_of: Int64 | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    stop_token_ids: list[Int64] | None = None
    prompt_logprobs: Int64 | None = None
    truncate_prompt_tokens: Int64 | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None
    priority: Int64 | None = None
    request_id: str | None = Field(default=None, max_length=256)
    """Becomes the request id in every log line the request crosses (as x-request-id does)."""

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionBody(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(default=16, ge=0, le=UINT32)
    """0 only with echo: the prompt's logprobs, no completion (http/echo.py)."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a string or token ids each); a bare string or id list is one."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # pyright: ignore[reportReturnType]  # a list of ints, checked above
        return list(p)  # pyright: ignore[reportReturnType]  # list[str] | list[list[int]]


class ChatBody(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """"auto" (the default with tools: the calls are parsed, http.tool_call_parser) or "none" (the template sees the
    tools, nothing is parsed); "required" and a named tool are refused (dialect/tools.check_tool_choice)."""
    parallel_tool_calls: bool | None = None
    """Accepted and not used: every call the model writes is returned (rollwire constrains no sampling)."""
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    echo: bool = False
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """Passed to the chat template as the variable `reasoning_effort`, as vLLM does."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_names(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(RESERVED_TEMPLATE_NAMES & set(kwargs or ()))
        if taken:
            raise ValueError(
                f"{', '.join(taken)} cannot be set here: the door gives the template these itself (use the request's "
                "own fields: messages, tools, add_generation_prompt, continue_final_message)"
            )
        return kwargs


class ChatTokensBody(ChatBody):
    """POST /v1/chat/completions/tokens (prime-rl's vLLM server extension; verifiers' training client sends every
    turn after the first here): a chat completion sampled from `tokens`, the prompt's ids as sent (turn k's prompt
    and sampled ids and the rendered rest: nothing is retokenized); `messages` are the conversation those ids hold,
    checked as a chat's are but not rendered."""

    tokens: list[TokenId] = Field(min_length=1)


class LoadLoraBody(_Body):
    """POST /v1/load_lora_adapter (vLLM)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoraBody(_Body):
    """POST /v1/unload_lora_adapter (vLLM)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Int64 | None = None


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "stop_token_ids": (None, []),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "priority": (None, 0),
    "suffix": (None, ""),
    "chat_template": (None,),
}
"""Fields rollwire honours only at these values."""


def check_unhonoured(body: _Sampling) -> None:
    """A 400 naming the first field set to a value rollwire cannot honour."""
    for field, neutral in NEUTRAL.items():
        if field in type(body).model_fields and getattr(body, field) not in neutral:
            value = getattr(body, field)
            raise unsupported(field, f"rollwire's engines do not support it (got {value!r:.80}); leave it unset")
    if body.best_of is not None and body.best_of != body.n:
        raise unsupported("best_of", "rollwire returns every sample it draws; set n instead")
    if isinstance(body, ChatBody):
        if body.top_logprobs:
            raise unsupported(
                "top_logprobs", "rollwire returns the sampled token's logprob only; use 0 or leave it unset"
            )
        fmt = (body.response_format or {}).get("type", "text")
        if fmt != "text":
            raise unsupported("response_format", f"only {{'type': 'text'}} is served (got {fmt!r})")
    if isinstance(body, CompletionBody) and body.logprobs:
        raise unsupported(
            "logprobs",
            "rollwire returns the sampled tokens' logprobs, not the top alternatives: send logprobs=0",
        )


_PARTS_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


def template_takes_parts(template: str | None) -> bool:
    """True when a chat template loops over a message's content (vLLM's "openai" content
    format: it is given the parts); otherwise it is given the text ("string" format)."""
    return bool(template and _PARTS_LOOP.search(template))


def flatten_content(messages: list[dict[str, Any]], keep_parts: bool) -> list[dict[str, Any]]:
    """Messages whose list-style content (OpenAI's content parts) is text, as vLLM renders
    them: the text parts joined by newlines for a template that takes a string, kept as text
    parts for one that loops over them. A part of any other type is a 400 naming it."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):  # pyright: ignore[reportAttributeAccessIssue]  # a dict here
                    raise unsupported(
                        "messages",
                        f"messages[{i}].content[{j}] is a part of type {str(kind)[:40]!r}; rollwire's models read text, "
                        "so send parts of type 'text' (with a 'text' string) or a string content",
                    )
                texts.append(part["text"])
            parts = [{"type": "text", "text": t} for t in texts]
            message = {**message, "content": parts if keep_parts else "\n".join(texts)}
        out.append(message)
    return out
