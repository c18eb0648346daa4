"""Scoring through the HTTP door: OpenAI's `echo` with `max_tokens` 0 (issue 37).

A completions request with `echo: true`, `max_tokens: 0` and `logprobs: k` asks for each
prompt back with the logprob of every prompt token (evaluation harnesses send exactly this
for loglikelihoods). The door answers it with one `Score` of all its prompts through the core
(ProxyCore.score: the proxy's Score limits, the client's slot, routed by version, counted in
the Score metrics), in the legacy completions shape: `tokens`, `token_logprobs` (null for the
first token, which nothing conditions), `top_logprobs` (the k most likely tokens at each
position with their logprobs, null first; with k = 0 the prompt's own token alone, as the
door answers sampled tokens) and `text_offset`.

Invariants:
- only `echo` with `max_tokens` 0 is scoring; `echo` beside generation is refused by name
  (and `max_tokens` 0 without `echo` asks for nothing), as are n > 1 and stream;
- the logprobs are the model's raw log-softmax (temperature 1, untruncated) whatever the
  body's sampling fields say, as Score's are (docs/http.md);
- a one-token prompt has nothing to score: its answer is [null] and it costs no Score;
- the request is a Score in the metrics, not a generation: the route hands its generation
  record over unclosed.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.errors import HttpError, unsupported
from rollwire.proxy.http.dialect.openai import CompletionBody
from rollwire.proxy.http.door import Door
from rollwire.proxy.tenants import Scope
from rollwire.v1 import generator_pb2 as pb


def wants_scoring(body: CompletionBody) -> bool:
    """Whether the body asks for its prompts' logprobs rather than for completions."""
    if body.max_tokens == 0 and not body.echo:
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens 0 generates nothing: send echo=true with logprobs to score the prompt, or max_tokens >= 1",
            reason=Reason.BAD_MAX_NEW_TOKENS,
            param="max_tokens",
        )
    if body.echo and body.max_tokens != 0:
        raise unsupported(
            "echo",
            "rollwire echoes prompts only to score them: send max_tokens=0 with echo (and logprobs), and generate "
            "in a request of its own",
        )
    return body.echo


def check_scoring(body: CompletionBody, max_top_k: int) -> None:
    if body.n not in (None, 1):
        raise unsupported("n", "a prompt is scored once: leave n unset or 1 with echo")
    if body.stream:
        raise unsupported("stream", "scores come back whole: set stream to false with echo")
    if body.return_tokens_as_token_ids:
        raise unsupported(
            "return_tokens_as_token_ids",
            "a scored prompt's tokens are spelled as text; leave it unset with echo (send the prompt as token ids to "
            "know them)",
        )
    if body.logprobs is not None and body.logprobs > max_top_k:
        raise unsupported(
            "logprobs", f"this proxy returns at most {max_top_k} alternatives per token (score.max_top_k)"
        )


async def echo_scores(
    door: Door, body: CompletionBody, prompts: list[list[int]], client: str, rid: str, scope: Scope
) -> dict:
    """The completions answer with every prompt echoed and scored (see the module docstring)."""
    check_scoring(body, door.config.score.max_top_k)
    for ids in prompts:
        if not ids:
            raise HttpError(
                grpc.StatusCode.INVALID_ARGUMENT, "a prompt is empty", reason=Reason.EMPTY_PROMPT, param="prompt"
            )
    ref = door.resolve(body.model, scope)
    top_k = body.logprobs or 0
    request = pb.ScoreRequest(request_id=rid, top_k=top_k)
    if not ref.is_base:
        request.adapter.name, request.adapter.version = ref.name, ref.version
    scored = [i for i, ids in enumerate(prompts) if len(ids) > 1]
    for i in scored:
        request.sequences.add(prompt_token_ids=prompts[i][:1], continuation_token_ids=prompts[i][1:])
    reply = await door.core.score(request, rid, client, door.deadline(), scope.label) if scored else None
    results = dict(zip(scored, reply.sequences, strict=True)) if reply is not None else {}
    choices = []
    for i, ids in enumerate(prompts):
        tokens = [door.token_text(t) for t in ids]
        logprobs = _legacy_logprobs(tokens, results.get(i), door) if body.logprobs is not None else None
        choices.append({"index": i, "text": "".join(tokens), "logprobs": logprobs, "finish_reason": "length"})
    count = sum(len(ids) for ids in prompts)
    answer: dict[str, Any] = {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model,
        "choices": choices,
        "usage": {"prompt_tokens": count, "completion_tokens": 0, "total_tokens": count},
    }
    if reply is not None:
        answer["adapter_version"] = reply.adapter.version
    return answer


def _legacy_logprobs(tokens: list[str], scored: pb.SequenceScore | None, door: Door) -> dict:
    """OpenAI's completions `logprobs` for an echoed prompt of `tokens` (their texts)."""
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    values: list[float | None] = [None, *(scored.logprobs if scored is not None else ())]
    top: list[dict[str, float] | None] = [None]
    for j, t in enumerate(tokens[1:]):
        if scored is not None and scored.top:
            alternatives = scored.top[j]
            top.append(
                {door.token_text(a): lp for a, lp in zip(alternatives.token_ids, alternatives.logprobs, strict=True)}
            )
        else:
            top.append({t: values[j + 1]})  # type: ignore[dict-item]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}
