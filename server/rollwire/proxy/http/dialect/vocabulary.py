"""The core's refusals in the HTTP door's words.

A replica or the core refuses a request in gRPC's vocabulary (`sampling.max_new_tokens`,
"on this replica", "push it first"); an HTTP caller sent OpenAI's fields and never pushed
anything. Invariants: the status, code and `reason` stay the core's (so the HTTP status is
the one a gRPC caller's code maps to); `param` is the OpenAI field the caller sent; a limit
named is the one this caller meets (for `max_tokens`: what the context leaves after this
prompt, when that is less than the replicas' per-sample limit); numbers echoed are the
caller's own values (`%g`), not their float32 round trip.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rollwire.common.errors import RollwireError
from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.dialect.openai import ChatBody, CompletionBody
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.v1 import generator_pb2 as pb

PARAMS: dict[str, str] = {
    Reason.BAD_N: "n",
    Reason.BAD_MAX_NEW_TOKENS: "max_tokens",
    Reason.CONTEXT_TOO_LONG: "max_tokens",
    Reason.BAD_TEMPERATURE: "temperature",
    Reason.BAD_TOP_P: "top_p",
    Reason.BAD_TOP_K: "top_k",
    Reason.BAD_STOP: "stop",
    Reason.PROMPT_TOO_LONG: "prompt",
    Reason.BAD_TOKEN_ID: "prompt",
    Reason.EMPTY_PROMPT: "prompt",
    Reason.KV_BUDGET: "n",
    Reason.BAD_FOLLOW: "follow",
    Reason.BAD_ADAPTER_NAME: "model",
    Reason.ADAPTER_NOT_FOUND: "model",
    Reason.ADAPTER_VERSION_NOT_FOUND: "model",
    Reason.ADAPTER_VERSION_EVICTED: "model",
    Reason.BAD_SCORE_REQUEST: "prompt",
    Reason.SCORE_TOO_LARGE: "prompt",
    Reason.BAD_SCORE_TOP_K: "logprobs",
}
"""The OpenAI field each refusal of a generation request is about."""
_PROMPT_TOKENS = re.compile(r"prompt \((\d+) tokens\)")
_GRPC_WORDS = (
    ("sampling.max_new_tokens", "max_tokens"),
    ("max_new_tokens", "max_tokens"),
    ("sampling.", ""),
    ("`text` or `token_ids`", "the prompt"),
    ("this replica accepts", "this server accepts"),
    ("this replica", "this server"),
)


@dataclass
class Asked:
    """What the caller sent, in its words, and the limits it met."""

    body: CompletionBody | ChatBody
    max_tokens: int
    prompt_tokens: int | None
    """The prompt's length when the door knows it (token ids, a rendered chat)."""
    limits: Callable[[], pb.Limits]


@contextlib.contextmanager
def http_terms(asked: Asked) -> Iterator[None]:
    """Refusals from the core raised inside, re-raised in the caller's words."""
    try:
        yield
    except PassThrough as relay:
        raise in_http_terms(relay.error(), asked, relayed=True) from None
    except HttpError:
        raise
    except RollwireError as err:
        raise in_http_terms(err, asked) from None


def in_http_terms(err: RollwireError, asked: Asked, relayed: bool = False) -> HttpError:
    body, reason = asked.body, err.reason
    param = PARAMS.get(reason)
    if param == "prompt" and isinstance(body, ChatBody):
        param = "messages"
    if param == "max_tokens" and isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        param = "max_completion_tokens"
    message = _sentence(err, asked, param)
    out = HttpError(err.code, message, reason=reason, param=param, retry_after_s=err.retry_after_s)
    out.relayed = relayed
    return out


def _sentence(err: RollwireError, asked: Asked, param: str | None) -> str:
    body, reason = asked.body, err.reason
    if param == "model":
        if reason == Reason.ADAPTER_VERSION_EVICTED:
            return (
                f"The model `{body.model}` is no longer served: the replicas serve each adapter's newest versions "
                "(their adapter_keep setting; GET /v1/models lists what is served)"
            )
        if reason != Reason.BAD_ADAPTER_NAME:
            return f"The model `{body.model}` does not exist (GET /v1/models lists the models served)"
    if reason == Reason.BAD_N:
        return f"n is {body.n}; this server draws 1 to {asked.limits().max_n} samples per request"
    if reason in (Reason.BAD_MAX_NEW_TOKENS, Reason.CONTEXT_TOO_LONG):
        return _max_tokens(err, asked, param or "max_tokens")
    if reason == Reason.BAD_TEMPERATURE and body.temperature is not None:
        return f"temperature is {body.temperature:g}; use 0 for greedy decoding or a value from 0.001 to 100"
    if reason == Reason.BAD_TOP_P and body.top_p is not None:
        return f"top_p is {body.top_p:g}; it must be in (0, 1] (1 disables nucleus sampling)"
    message = err.message
    for grpc_word, http_word in _GRPC_WORDS:
        message = message.replace(grpc_word, http_word)
    return message


def _max_tokens(err: RollwireError, asked: Asked, param: str) -> str:
    """`max_tokens` refused, with the most this caller could ask for with this prompt."""
    limits = asked.limits()
    prompt = asked.prompt_tokens
    if prompt is None and (m := _PROMPT_TOKENS.search(err.message)):
        prompt = int(m[1])
    most, why = limits.max_new_tokens, "this server generates at most that many tokens per sample"
    if prompt is not None and limits.max_context:
        room = limits.max_context - prompt
        if room < 1:
            return f"the prompt ({prompt} tokens) fills the model's context of {limits.max_context} tokens"
        if not most or room < most:
            most = room
            why = (
                f"this prompt ({prompt} tokens) leaves that much of the model's context of {limits.max_context} tokens"
            )
    if not most:
        return f"{param} is {asked.max_tokens}: {err.message}"
    return f"{param} is {asked.max_tokens}; send at most {most} ({why})"
