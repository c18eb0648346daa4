"""Converting between the door's JSON and the core's messages, once, in one place.

Requests become the same `GenerateRequest` a gRPC client sends (one group per prompt);
the group's events become OpenAI choices. Invariants:
- a choice's `token_ids` and `logprobs` are exactly the group's tokens and logprobs as the
  gRPC stream carried them (EOS included when the sample stopped on it), so HTTP and gRPC
  give identical samples for the same seed;
- `text` is the replicas' text, less the stop string a sample stopped on (vLLM's default;
  `include_stop_str_in_output` keeps it); the stop string is the choice's `stop_reason`;
- a `restarted` event discards every partial sample (the proxy's failover contract).
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollwire.common import kept
from rollwire.proxy.http.dialect.names import ModelRef
from rollwire.proxy.http.dialect.openai import ChatBody, CompletionBody
from rollwire.proxy.http.dialect.tools import Parser
from rollwire.v1 import generator_pb2 as pb

FINISH = {pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


WHOLE_SAMPLES = 4096
"""stream_interval of an unstreamed request: its samples come whole (GenerateRequest.stream_interval)."""


def generate_request(
    body: CompletionBody | ChatBody,
    prompt: str | list[int],
    ref: ModelRef,
    max_tokens: int,
    rid: str,
    routed_experts: bool = False,
) -> pb.GenerateRequest:
    """The gRPC request for one prompt of `body` (its n samples: one group); `routed_experts`
    (http.return_routed_experts) asks for the routing of an unstreamed request's samples."""
    sampling = pb.SamplingParams(
        max_new_tokens=max_tokens,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
        return_kept_tokens=body.return_kept_tokens,
    )
    if body.temperature is not None:
        sampling.temperature = body.temperature
    if body.top_p is not None:
        sampling.top_p = body.top_p
    if body.top_k is not None and body.top_k > 0:  # 0 and -1 are "off" in vLLM, 0 in rollwire
        sampling.top_k = body.top_k
    if body.seed is not None:
        sampling.seed = body.seed
    request = pb.GenerateRequest(request_id=rid, n=body.n, sampling=sampling)
    if not body.stream:  # the caller reads whole samples: one message per sample, not per token
        request.stream_interval = WHOLE_SAMPLES
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if not ref.is_base:
        request.adapter.name, request.adapter.version = ref.name, ref.version
    request.adapter.follow = body.follow  # refused by the replica without a name or with a pinned version
    request.return_routed_experts = routed_experts and not body.stream  # vLLM returns it in whole answers only
    return request


@dataclass
class Choice:
    """One sample as it accumulates."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    kept: list[list[int]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    version: int = 0
    finish: str | None = None
    stop_reason: str | None = None
    stop_end: int = 0
    """Where the stop string that ended the sample ends in its text (vLLM cuts the text there: a
    token may spell more after it)."""
    routed: pb.RoutedExperts | None = None
    """The sample's MoE routing, when the request asked for it (http.return_routed_experts)."""

    def routed_experts(self, prompt_start: int) -> str | None:
        """vLLM's `routed_experts`: base64 of the .npy of a [positions, layers, top_k] uint16
        array, less the first `prompt_start` positions (routed_experts_prompt_start; at most
        the sample's positions)."""
        if self.routed is None:
            return None
        r = self.routed
        ids = np.frombuffer(r.expert_ids, dtype="<u2").reshape(r.positions, r.layers, r.top_k)
        with io.BytesIO() as out:
            np.save(out, ids[min(prompt_start, r.positions) :], allow_pickle=False)
            return base64.b64encode(out.getbuffer()).decode("ascii")

    def final_text(self, keep_stop: bool) -> str:
        text = "".join(self.text)
        if self.stop_reason:
            return text[: self.stop_end if keep_stop else self.stop_end - len(self.stop_reason)]
        return text


@dataclass
class Group:
    """A group's events folded into choices (restarts discard the partial samples)."""

    n: int
    stop: list[str]
    prompt_ids: list[int] = field(default_factory=list)
    replica: str = ""
    choices: list[Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.choices = [Choice() for _ in range(self.n)]

    def apply(self, message: pb.GenerateResponse) -> list[tuple[int, pb.TokenChunk | None, str | None]]:
        """Fold one message in; return what it added per sample: (index, chunk, finish)."""
        if message.HasField("restarted"):
            self.__post_init__()
            return []
        if message.HasField("started"):
            self.prompt_ids = list(message.started.prompt_token_ids)
            self.replica = message.started.replica
        added: list[tuple[int, pb.TokenChunk | None, str | None]] = []
        for chunk in message.tokens:
            c = self.choices[chunk.sample_index]
            c.token_ids.extend(chunk.token_ids)
            c.logprobs.extend(chunk.logprobs)
            c.text.append(chunk.text)
            c.kept.extend(kept.decode(k) for k in chunk.kept_tokens)
            c.version = chunk.adapter_version or c.version
            c.versions.extend([chunk.adapter_version] * len(chunk.token_ids))
            added.append((chunk.sample_index, chunk, None))
        for done in message.finished:
            c = self.choices[done.sample_index]
            c.finish = FINISH.get(done.finish_reason, "stop")
            if done.HasField("routed_experts"):
                c.routed = done.routed_experts
            if done.finish_reason == pb.FINISH_REASON_STOP:
                text = "".join(c.text)
                ends = [(text.find(s) + len(s), s) for s in self.stop if s and s in text]
                c.stop_end, c.stop_reason = min(ends) if ends else (0, None)
            added.append((done.sample_index, None, c.finish))
        return added


def usage(groups: list[Group]) -> dict[str, int]:
    prompt = sum(len(g.prompt_ids) for g in groups)
    completion = sum(len(c.token_ids) for g in groups for c in g.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


TokenText = Callable[[int], str]


def as_id(token_id: int) -> str:
    """vLLM's spelling of a token under `return_tokens_as_token_ids`."""
    return f"token_id:{token_id}"


def completion_logprobs(
    ids: list[int], logprobs: list[float], token_text: TokenText, start: int = 0, as_ids: bool = False
) -> dict:
    """vLLM's completion `logprobs` object for sampled tokens: with `logprobs=0`, as vLLM
    answers it, each token's `top_logprobs` holds the sampled token alone (no alternatives);
    `as_ids` spells each token "token_id:<int>" (offsets then count those spellings, as vLLM's)."""
    tokens = [as_id(t) if as_ids else token_text(t) for t in ids]
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(ids: list[int], logprobs: list[float], token_text: TokenText, as_ids: bool = False) -> dict:
    """OpenAI's chat `logprobs` object for sampled tokens (no alternatives); `as_ids` spells
    each token "token_id:<int>", its `bytes` still the token's text (as vLLM's)."""
    content = []
    for t, lp in zip(ids, logprobs, strict=True):
        text = token_text(t)
        shown = as_id(t) if as_ids else text
        content.append({"token": shown, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def completion_response(
    body: CompletionBody, groups: list[Group], model: str, rid: str, token_text: TokenText
) -> dict[str, Any]:
    choices = []
    for g_index, g in enumerate(groups):
        for i, c in enumerate(g.choices):
            choice: dict[str, Any] = {
                "index": g_index * body.n + i,
                "text": c.final_text(body.include_stop_str_in_output),
                "logprobs": completion_logprobs(
                    c.token_ids, c.logprobs, token_text, as_ids=body.return_tokens_as_token_ids
                )
                if body.logprobs is not None
                else None,
                "finish_reason": c.finish,
                "stop_reason": c.stop_reason,
                "adapter_version": c.version,
            }
            if body.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = list(g.prompt_ids)
                choice["token_versions"] = list(c.versions)
            if body.return_kept_tokens:
                choice["kept_token_ids"] = c.kept
            if c.routed is not None:
                choice["routed_experts"] = c.routed_experts(body.routed_experts_prompt_start)
            choices.append(choice)
    return {
        "id": f"cmpl-{rid}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(groups),
    }


def chat_response(
    body: ChatBody, group: Group, model: str, rid: str, token_text: TokenText, parse: Parser | None = None
) -> dict[str, Any]:
    """The chat answer; with `parse` (dialect/tools.py), a sample's tool calls are its
    `message.tool_calls` and its finish_reason "tool_calls", its ids and logprobs unchanged."""
    choices = []
    for i, c in enumerate(group.choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.final_text(body.include_stop_str_in_output)}
        finish = c.finish
        parsed = parse(message["content"]) if parse is not None else None
        if parsed is not None and parsed.calls:
            message = {**message, "content": parsed.content, "tool_calls": [t.openai() for t in parsed.calls]}
            finish = "tool_calls"
        as_ids = body.return_tokens_as_token_ids
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, token_text, as_ids) if body.logprobs else None,
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
            "adapter_version": c.version,
        }
        if body.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["token_versions"] = list(c.versions)
        if body.return_kept_tokens:
            choice["kept_token_ids"] = c.kept
        if c.routed is not None:
            choice["routed_experts"] = c.routed_experts(body.routed_experts_prompt_start)
        choices.append(choice)
    out: dict[str, Any] = {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage([group]),
    }
    if body.return_token_ids:
        out["prompt_token_ids"] = list(group.prompt_ids)
    return out
