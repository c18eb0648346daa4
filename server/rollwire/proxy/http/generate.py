"""vLLM's tokens-in, tokens-out RL route, `POST /inference/v1/generate` (vLLM 0.32's
entrypoints/scale_out/token_in_token_out), over the door's one dispatch.

The body (`token_ids`, vLLM's `sampling_params`, `output_mode`, `stream`, ...) is read as the
completions body of the same token-id prompt (convert.generate_request): one group, the same
limits, failover, pause and pacing. Invariants:
- each choice's `token_ids` and `logprobs` are the group's as gRPC carries them;
- `weight_versions` are the spans of output tokens each adapter version sampled (vLLM's
  WeightVersionSpan: `version` a string, `[start, end)`); rollwire knows the version of every
  token, so they are exact, a `follow` switch included;
- a field vLLM defines that rollwire cannot honour is a 400 naming it (`sampling_params.X`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from rollwire.proxy.accounting import RequestRecord
from rollwire.proxy.http.dialect import convert
from rollwire.proxy.http.dialect.errors import HttpError, unsupported
from rollwire.proxy.http.dialect.openai import (
    INT64,
    MAX_SEED,
    UINT32,
    CompletionBody,
    Int64,
    StreamOptions,
    TokenId,
    _Body,
    check_unhonoured,
)
from rollwire.proxy.http.dialect.vocabulary import Asked, http_terms
from rollwire.proxy.http.door import Door
from rollwire.proxy.http.stream import BoundedStream, _Events
from rollwire.proxy.tenants import Scope
from rollwire.v1 import generator_pb2 as pb


class SamplingBody(_Body):
    """vLLM's SamplingParams as the route reads them; each other field it defines is honoured
    only at its default (the completions door's rules, `check_unhonoured`)."""

    n: int = Field(default=1, ge=1, le=1024)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(default=0, ge=-1, le=UINT32)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32)
    """Left out: what the context leaves after the prompt, within the replicas' limit (vLLM's default here)."""
    logprobs: int | None = Field(default=None, ge=-1, le=20)
    """0: the sampled token's logprob (its own top entry); more alternatives are not served."""
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    stream_interval: int | None = Field(default=None, ge=1, le=UINT32)
    """Tokens batched into each streamed chunk (GenerateRequest.stream_interval)."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: Int64 | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_token_ids: list[Int64] | None = None
    prompt_logprobs: Int64 | None = None
    structured_outputs: Any = None
    # vLLM's own, honoured at their defaults only (ONLY_DEFAULT):
    watermarking: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[Int64] | None = None
    logprob_token_ids: list[Int64] | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: Int64 | None = None
    flat_logprobs: bool = False
    thinking_token_budget: Int64 | None = None
    repetition_detection: Any = None
    extra_args: dict[str, Any] | None = None
    trace_decode_token_ids: list[Int64] | None = None
    routed_experts_prompt_start: int = Field(default=0, ge=0, le=INT64)
    skip_reading_prefix_cache: bool | None = None


ONLY_DEFAULT = (
    "watermarking",
    "bad_words",
    "allowed_token_ids",
    "logprob_token_ids",
    "prompt_logprob_token_ids",
    "prompt_logprob_start",
    "thinking_token_budget",
    "repetition_detection",
    "extra_args",
    "trace_decode_token_ids",
)


class GenerateBody(_Body):
    """POST /inference/v1/generate (vLLM's GenerateRequest)."""

    model: str = Field(min_length=1, max_length=256)
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    request_id: str | None = Field(default=None, max_length=256)
    return_token_ids: bool = False
    """The prompt's token ids in the answer (a stream's first chunk)."""
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 | None = None
    token_offsets: list[tuple[int, int]] | None = None
    """Metadata of the render step (character offsets of the prompt's tokens); no effect on sampling."""
    reasoning_ended: bool | None = None
    """No effect without structured outputs (as in vLLM), which are not served."""
    reasoning_parser_kwargs: dict[str, Any] | None = None
    """No effect without structured outputs (as in vLLM)."""
    features: Any = None
    content_parts: Any = None
    cache_salt: str | None = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    return_sampling_mask: bool = False
    """rollwire's extension (vLLM's server flag --return-sampling-mask): each choice's `sampling_mask`, per token
    the ids top-k/top-p kept (docs/protocol.md, "Kept-token sets")."""
    follow: bool = False
    """rollwire's extension, as on completions: running samples switch to each newly committed version."""


def _completion(body: GenerateBody) -> CompletionBody:
    """The completions body of the same request: the one conversion into the core's request."""
    for name in ("features", "content_parts", "cache_salt", "kv_transfer_params", "ec_transfer_params"):
        if getattr(body, name) is not None:
            raise unsupported(
                name, "rollwire's replicas take token ids and serve no transfer or salted cache; leave it unset"
            )
    sp = body.sampling_params
    for name in ONLY_DEFAULT:
        if getattr(sp, name) not in (None, False, 0):
            raise unsupported(f"sampling_params.{name}", "rollwire's engines do not support it; leave it unset")
    if sp.logprobs not in (None, 0):
        raise unsupported(
            "sampling_params.logprobs", "rollwire returns the sampled token's logprob, not alternatives: send 0"
        )
    if body.output_mode == "text" and not sp.detokenize:
        raise unsupported("output_mode", "output_mode 'text' needs sampling_params.detokenize true")
    if body.output_mode == "text" and body.stream:
        raise unsupported("output_mode", "a stream of this route carries tokens only here: send output_mode 'tokens'")
    if body.priority not in (None, 0):
        raise unsupported("priority", "rollwire's queue has no priorities (its shares are per tenant); leave it unset")
    no_effect = {"detokenize", "stream_interval", "flat_logprobs"}
    fields = set(sp.model_fields_set) - no_effect - {"skip_reading_prefix_cache"}
    fields -= set(ONLY_DEFAULT) | {"logprobs"}
    asked = {name: getattr(sp, name) for name in fields}
    completion = CompletionBody.model_validate(
        {
            **asked,
            "model": body.model,
            "prompt": body.token_ids,
            "max_tokens": sp.max_tokens or 1,
            "logprobs": sp.logprobs,
            "stream": body.stream,
            "stream_options": body.stream_options,
            "return_token_ids": True,
            "return_kept_tokens": body.return_sampling_mask,
            "follow": body.follow,
        }
    )
    try:
        check_unhonoured(completion)
    except HttpError as err:
        err.param = f"sampling_params.{err.param}"
        raise
    return completion


def spans(versions: list[int]) -> list[dict[str, Any]]:
    """vLLM's weight_versions: contiguous runs of output tokens sampled by one version."""
    out: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if out and out[-1]["version"] == str(v):
            out[-1]["end"] = i + 1
        else:
            out.append({"version": str(v), "start": i, "end": i + 1})
    return out


def _choice(
    body: GenerateBody,
    index: int,
    c: convert.Choice,
    ids: list[int],
    lps: list[float],
    kept: list[list[int]],
    finish: str | None,
) -> dict[str, Any]:
    logprobs = None
    if body.sampling_params.logprobs is not None:
        content = [{"token_id": t, "logprob": lp, "rank": None} for t, lp in zip(ids, lps, strict=True)]
        logprobs = {"content": [{**e, "top_logprobs": [dict(e)]} for e in content]}
    return {
        "index": index,
        "logprobs": logprobs,
        "finish_reason": finish,
        "stop_reason": c.stop_reason if finish else None,
        "token_ids": ids,
        "routed_experts": c.routed_experts(body.sampling_params.routed_experts_prompt_start),
        "sampling_mask": kept if body.return_sampling_mask else None,
        "weight_versions": spans(c.versions) if finish else None,
    }


def response(body: GenerateBody, group: convert.Group, rid: str, door: Door) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(group.choices):
        choice = _choice(body, i, c, list(c.token_ids), list(c.logprobs), c.kept, c.finish)
        if body.output_mode == "text":
            choice["text"] = c.final_text(body.sampling_params.include_stop_str_in_output)
            if choice["logprobs"] is not None:
                choice["logprobs"] = convert.chat_logprobs(c.token_ids, c.logprobs, door.token_text)
        choices.append(choice)
    return {
        "request_id": rid,
        "model": body.model,
        "created": int(time.time()),
        "usage": convert.usage([group]),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": list(group.prompt_ids) if body.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": body.output_mode,
        "choices": choices,
    }


class _Chunks(_Events):
    """A streamed generate: vLLM's GenerateTokensStreamResponse chunks, one choice each."""

    def __init__(self, door: Door, body: GenerateBody, completion: CompletionBody, *args: Any) -> None:
        super().__init__(door, completion, *args)
        self.generate = body

    def frame(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"request_id": self.rid, "usage": None, "output_mode": "tokens", "choices": choices}

    def payloads(self, message: pb.GenerateResponse) -> list[dict[str, Any]]:
        group, events = self.group, []
        for index, chunk, finish in self.group.apply(message):
            c = group.choices[index]
            last = events[-1]["choices"][0] if events else None
            if finish and last is not None and last["index"] == index and not last["finish_reason"]:
                ended = _choice(self.generate, index, c, [], [], [], finish)  # the finish rides on the last tokens
                last |= {k: ended[k] for k in ("finish_reason", "stop_reason", "weight_versions")}
                continue
            ids = list(chunk.token_ids) if chunk is not None else []
            lps = list(chunk.logprobs) if chunk is not None else []
            kept = c.kept[len(c.kept) - len(ids) :] if ids else []
            event = self.frame([_choice(self.generate, index, c, ids, lps, kept, finish)])
            if index in self.unprompted:
                self.unprompted.discard(index)
                if self.generate.return_token_ids:
                    event["prompt_token_ids"] = list(group.prompt_ids)
            events.append(event)
        return events


async def generate(
    door: Door, body: GenerateBody, client: str, rid: str, record: RequestRecord, scope: Scope
) -> dict[str, Any] | BoundedStream:
    """The route: one group for the body's token ids, whole or streamed."""
    completion = _completion(body)
    ref = door.resolve(body.model, scope)
    max_tokens = body.sampling_params.max_tokens or door.default_max_tokens(len(body.token_ids))
    completion.max_tokens = max_tokens
    rid = f"generate-tokens-{body.request_id or rid}"
    routed = door.config.http.return_routed_experts
    request = convert.generate_request(completion, list(body.token_ids), ref, max_tokens, rid, routed)
    if body.sampling_params.stream_interval:
        request.stream_interval = body.sampling_params.stream_interval
    record.edge = False  # the core decides from here
    try:
        with http_terms(Asked(completion, max_tokens, len(body.token_ids), door.limits)):
            if body.stream:
                events = _Chunks(door, body, completion, request, client, "generate", rid, record.tenant)
                await events.begin()
                events.record = record.hand_over()
                return BoundedStream(events.run(), door.config.fairness.slow_reader_timeout_s, events.close)
            group = convert.Group(completion.n, completion.stop_list())
            await door.run_group(request, client, group, door.deadline(), record.tenant)
    except HttpError as err:
        err.param = _in_route_terms(err.param)
        raise
    return response(body, group, rid, door)


def _in_route_terms(param: str | None) -> str | None:
    """A refusal's `param` in this route's fields: the prompt is `token_ids`, sampling fields are
    `sampling_params.X`."""
    if param == "prompt":
        return "token_ids"
    return f"sampling_params.{param}" if param in SamplingBody.model_fields else param
