"""Streamed answers: one server-sent event per message of the core's stream, `[DONE]` last.

Invariants: a reader that stops reading for `fairness.slow_reader_timeout_s` ends its
response, which closes its group (lease and client slot freed); a failure after the first
event is a last event carrying the error object; a restart after tokens were sent ends the
stream (tokens cannot be taken back), before that the failover is invisible."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from rollwire.common.errors import ResourceExhausted, RollwireError, Unavailable
from rollwire.common.reasons import Reason
from rollwire.proxy.accounting import RequestRecord
from rollwire.proxy.http.dialect import convert
from rollwire.proxy.http.dialect.errors import error_response
from rollwire.proxy.http.dialect.openai import ChatBody, CompletionBody
from rollwire.proxy.http.dialect.tools import ToolStream, parser_for
from rollwire.proxy.http.door import Door
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.runtime.logs import get_logger
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


class BoundedStream(StreamingResponse):
    """Server-sent events whose every send must complete within `patience` seconds: a reader
    that stops reading ends its response (and so its group) instead of holding it. However
    the response ends (done, failed, its reader gone), `closing` runs once."""

    def __init__(
        self, content: AsyncIterator[str], patience: float, closing: Callable[[BaseException | None], Awaitable[None]]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.patience = patience
        self.closing = closing

    async def stream_response(self, send: Callable[[Any], Awaitable[None]]) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        async def bounded(message: Any) -> None:
            async with asyncio.timeout(self.patience):
                await send(message)

        await super().stream_response(bounded)  # pyright: ignore[reportArgumentType]

    async def __call__(self, scope, receive, send) -> None:
        ended: BaseException | None = None
        try:
            await super().__call__(scope, receive, send)
        except TimeoutError:  # a send the reader did not take within patience (stream_response)
            ended = ResourceExhausted(
                f"the client did not read this stream for {self.patience:g}s, so the proxy ended it",
                reason=Reason.SLOW_READER,
            )
            log.warning("slow_reader_cut_off", seconds=self.patience)
        except BaseException as exc:
            ended = exc
            raise
        finally:
            await self.closing(ended)


async def stream_group(
    door: Door,
    body: CompletionBody | ChatBody,
    req: pb.GenerateRequest,
    client: str,
    kind: str,
    rid: str,
    record: RequestRecord,
) -> BoundedStream:
    """A streamed group (see the module docstring), answered once the core has decided it:
    the group is started and its first message awaited before the status line is sent, so
    every refusal (unknown model, limits, ...) raises here and is answered with its own 4xx
    like an unstreamed request's. Chunks are shaped as vLLM's (tests/e2e/test_http_vllm_parity.py):
    one choice per chunk; with `return_token_ids` the first chunk of a sample carries
    `prompt_token_ids` (chat: in the frame; completions: in the choice), and a sample's finish
    rides on its last tokens' delta."""
    events = _Events(door, body, req, client, kind, rid, record.tenant)
    await events.begin()
    events.record = record.hand_over()
    return BoundedStream(events.run(), door.config.fairness.slow_reader_timeout_s, events.close)


class _Events:
    """The SSE events of one streamed group, from the core's messages."""

    def __init__(
        self,
        door: Door,
        body: CompletionBody | ChatBody,
        req: pb.GenerateRequest,
        client: str,
        kind: str,
        rid: str,
        tenant: str,
    ) -> None:
        self.door, self.body, self.req, self.client, self.kind, self.rid = door, body, req, client, kind, rid
        self.tenant = tenant
        """The `tenant` label its tokens count under."""
        self.chat = kind == "chat.completion.chunk"
        self.holdback = max((len(s) for s in body.stop_list()), default=1) - 1
        """Characters of text held back while they could still begin a stop string."""
        self.group = convert.Group(body.n, body.stop_list())
        self.sent_text = [0] * body.n
        self.unprompted = set(range(body.n)) if body.return_token_ids else set()
        parse = parser_for(body, door.tool_format) if isinstance(body, ChatBody) else None
        self.tools = [ToolStream(parse) for _ in range(body.n)] if parse is not None else None
        """Per sample, its text split into content and tool calls (dialect/tools.py), when a parser applies."""
        self.stream: AsyncGenerator[pb.GenerateResponse] | None = None
        self.first: pb.GenerateResponse | None = None
        self.record: RequestRecord | None = None
        self.ended: tuple[BaseException | None] | None = None
        """How the group ended, once it has (None inside: complete)."""

    async def begin(self) -> None:
        """Start the group and take its first message (the core holds `started` back until
        the first tokens or finish, so every refusal comes before it)."""
        stream = self.door.group_events(self.req, self.rid, self.client, self.door.deadline(), self.tenant)
        self.stream = stream  # pyright: ignore[reportAttributeAccessIssue]  # group_events is an async generator
        try:
            self.first = await anext(stream)
        except BaseException:
            await stream.aclose()  # pyright: ignore[reportAttributeAccessIssue]  # an async generator has aclose
            raise

    async def close(self, ended: BaseException | None) -> None:
        """The response is over: the group is closed (lease and client slot freed) and the
        request recorded with how it ended (a response cut before the group ended: cancelled)."""
        if self.stream is not None:
            await self.stream.aclose()
        if isinstance(ended, RollwireError) and ended.reason == Reason.SLOW_READER:
            self.door.core.state.metrics.client_limited.labels("slow_reader").inc()
        elif ended is None or isinstance(ended, ClientDisconnect):
            ended = asyncio.CancelledError()
        if self.record is not None:
            self.record.close(self.ended[0] if self.ended is not None else ended)

    @staticmethod
    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def frame(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {
            "id": f"{prefix}-{self.rid}",
            "object": self.kind,
            "created": int(time.time()),
            "model": self.body.model,
            "choices": choices,
        }

    async def messages(self) -> AsyncIterator[pb.GenerateResponse]:
        assert self.stream is not None and self.first is not None, "begin() first"
        yield self.first
        async for message in self.stream:
            yield message

    async def run(self) -> AsyncIterator[str]:
        shown, failure = False, None
        try:
            async for message in self.messages():
                if message.HasField("restarted") and shown:
                    raise Unavailable(
                        "the replica serving this stream failed after sending tokens; send the request again",
                        reason=Reason.ATTEMPTS_EXHAUSTED,
                    )
                events = self.payloads(message)
                if events:  # one write per core message, however many choices it moves
                    shown = True
                    yield "".join(self.event(payload) for payload in events)
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield self.event({**self.frame([]), "usage": convert.usage([self.group])})
        except PassThrough as relay:
            failure = relay
            yield self.event(_error_body(relay.error()))
        except RollwireError as err:
            failure = err
            yield self.event(_error_body(err))
        finally:
            assert self.stream is not None
            await self.stream.aclose()
        self.ended = (failure,)
        yield "data: [DONE]\n\n"

    def payloads(self, message: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The events one core message becomes, one choice each (none: nothing to show yet)."""
        body, group = self.body, self.group
        choices = []
        added = group.apply(message)
        ending = {index for index, _, finish in added if finish}  # text a stop string cuts is never sent
        for index, chunk, finish in added:
            c = group.choices[index]
            if index in ending:
                text = c.final_text(body.include_stop_str_in_output)
                upto = len(text) if finish else min(len(text), max(self.sent_text[index], len(text) - self.holdback))
            else:
                text = "".join(c.text)
                upto = max(self.sent_text[index], len(text) - self.holdback)
            delta, self.sent_text[index] = text[self.sent_text[index] : upto], upto
            calls: list[dict[str, Any]] = []
            if self.tools is not None:
                delta, calls = self.tools[index].feed(delta, finish is not None)
                finish = "tool_calls" if finish and self.tools[index].called else finish
            choices.append(_delta(body, self.chat, index, delta, chunk, finish, c, self.door.token_text, calls))
        choices = _merge_finishes(choices, self.chat)
        if self.chat and message.HasField("started"):
            role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            choices = [{"index": i, **role} for i in range(body.n)] + choices
        events = []
        for choice in choices:
            extra: dict[str, Any] = {}
            if choice["index"] in self.unprompted:  # a sample's first chunk
                self.unprompted.discard(choice["index"])
                if self.chat:
                    extra["prompt_token_ids"] = list(group.prompt_ids)
                else:
                    choice["prompt_token_ids"] = list(group.prompt_ids)
            events.append({**self.frame([choice]), **extra})
        return events


def _delta(
    body: CompletionBody | ChatBody,
    chat: bool,
    index: int,
    text: str,
    chunk: pb.TokenChunk | None,
    finish: str | None,
    c: convert.Choice,
    token_text: Callable[[int], str],
    calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    ids = list(chunk.token_ids) if chunk is not None else []
    lps = list(chunk.logprobs) if chunk is not None else []
    out: dict[str, Any] = {"index": index, "finish_reason": finish, "adapter_version": c.version}
    if finish or not chat:  # vLLM: in every completion chunk, in a chat chunk with the finish
        out["stop_reason"] = c.stop_reason
    if chat:
        delta: dict[str, Any] = {"content": text} if text else {}
        out["delta"] = delta | {"tool_calls": calls} if calls else delta
        as_ids = body.return_tokens_as_token_ids
        logprobs = getattr(body, "logprobs", False)
        out["logprobs"] = convert.chat_logprobs(ids, lps, token_text, as_ids) if logprobs else None
    else:
        out["text"] = text
        as_ids = body.return_tokens_as_token_ids
        logprobs = body.logprobs is not None
        out["logprobs"] = convert.completion_logprobs(ids, lps, token_text, as_ids=as_ids) if logprobs else None
    if body.return_token_ids:
        out["token_ids"] = ids
    return out


def _merge_finishes(choices: list[dict[str, Any]], chat: bool) -> list[dict[str, Any]]:
    """A sample's finish folded into its tokens' delta of the same event, as vLLM sends it (a
    client reading one choice per chunk sees the finish with the last tokens)."""
    merged: list[dict[str, Any]] = []
    for choice in choices:
        last = next((m for m in reversed(merged) if m["index"] == choice["index"]), None)
        if choice["finish_reason"] and last is not None and not last["finish_reason"]:
            if chat:
                text = last["delta"].get("content", "") + choice["delta"].get("content", "")
                calls = last["delta"].get("tool_calls", []) + choice["delta"].get("tool_calls", [])
                last["delta"] = ({"content": text} if text else {}) | ({"tool_calls": calls} if calls else {})
            else:
                last["text"] += choice["text"]
            last["finish_reason"], last["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
            continue
        merged.append(choice)
    return merged


def _error_body(err: RollwireError) -> dict[str, Any]:
    return json.loads(bytes(error_response(err).body))
