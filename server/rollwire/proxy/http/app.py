"""The HTTP door's routes and its server, in the proxy's process and event loop (docs/http.md).

Invariants:
- limits before work: a body is read only up to its route's limit (413 beyond it), and only
  after the caller's token passed; JSON is parsed off the event loop when it is large;
- every generation request has a deadline (`http.request_timeout_s`, capped by the proxy's
  `routing.request_timeout_s`) and runs under the caller's per-client limits, as a gRPC call;
- a streamed response whose reader stops reading for `fairness.slow_reader_timeout_s` is
  ended, which closes its group (lease and client slot freed);
- one request's failure ends that request only: every exception becomes that request's
  error response (errors.py), an unexpected one a logged 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from rollwire.common.errors import FailedPrecondition, Internal, RollwireError, Unavailable
from rollwire.common.logs import get_logger
from rollwire.common.reasons import Reason
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.dispatch import client_name
from rollwire.proxy.http import ROUTES, convert
from rollwire.proxy.http.adapters import AdapterDoor
from rollwire.proxy.http.errors import HttpError, error_response, http_status
from rollwire.proxy.http.names import ModelRef, model_id, parse_model
from rollwire.proxy.http.openai import ChatBody, CompletionBody, LoadLoraBody, UnloadLoraBody, check_unhonoured
from rollwire.proxy.http.tokenizer import ChatTokenizer
from rollwire.proxy.relay import Relay
from rollwire.proxy.servicer import ProxyServicer
from rollwire.serving.security import ADMIN, GENERATE, TokenAuth
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)
THREAD_PARSE_BYTES = 64 << 10
"""JSON bodies larger than this are parsed on a worker thread, not on the event loop."""


@dataclass
class Door:
    """What the routes answer from: the proxy's core, its config and the base model's tokenizer."""

    config: ProxyConfig
    servicer: ProxyServicer
    adapters: AdapterDoor
    auth: TokenAuth | None
    tokenizer: ChatTokenizer | None
    base_id: str
    base_names: frozenset[str]
    context_len: int
    """max_position_embeddings of the base model (0: unknown)."""

    @classmethod
    def build(cls, config: ProxyConfig, servicer: ProxyServicer) -> Door:
        http = config.http
        tokenizer, context_len, base_id = None, 0, http.served_model_name or "base"
        names = {base_id}
        if http.model_path:
            folder = Path(http.model_path)
            tokenizer = ChatTokenizer(folder)
            model_config = (
                json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
            )
            context_len = int(model_config.get("max_position_embeddings") or 0)
            base_id = http.served_model_name or folder.resolve().name
            names |= {base_id, http.model_path, str(folder.resolve())}
        adapters = AdapterDoor(servicer.fanout, http.adapter_root, config.spool.max_adapter_bytes)
        return cls(
            config,
            servicer,
            adapters,
            TokenAuth.from_config(config.auth),
            tokenizer,
            base_id,
            frozenset(names),
            context_len,
        )

    # -- what the fleet is -------------------------------------------------------------------
    def max_model_len(self) -> int:
        if self.config.http.max_model_len:
            return self.config.http.max_model_len
        limits = self.servicer.status().limits
        fleet = limits.max_prompt_tokens + limits.max_new_tokens if limits.max_new_tokens else 0
        known = [x for x in (fleet, self.context_len) if x]
        return min(known) if known else 0

    def default_max_tokens(self, prompt_len: int) -> int:
        """A chat request's max_tokens when it sends none: vLLM's (what the context leaves after
        the prompt), within what the replicas generate per sample."""
        room = max(1, self.max_model_len() - prompt_len)
        fleet = self.servicer.status().limits.max_new_tokens
        return min(room, fleet) if fleet else room

    def models(self) -> dict[str, Any]:
        created = int(time.time())
        data = [
            {
                "id": self.base_id,
                "object": "model",
                "created": created,
                "owned_by": "rollwire",
                "root": self.config.http.model_path or self.base_id,
                "parent": None,
                "max_model_len": self.max_model_len(),
            }
        ]
        status = self.servicer.status()
        for adapter in status.adapters:
            for version in adapter.versions:
                if (adapter.name, version) in self.adapters.hidden:
                    continue
                data.append(
                    {
                        "id": model_id(adapter.name, version),
                        "object": "model",
                        "created": created,
                        "owned_by": "rollwire",
                        "root": model_id(adapter.name, version),
                        "parent": self.base_id,
                        "max_model_len": self.max_model_len(),
                    }
                )
        return {"object": "list", "data": data}

    def server_info(self) -> dict[str, Any]:
        """vLLM's /server_info as TRL reads it, true of the fleet: an adapter load reaches every
        replica, so to the caller the fleet is one data-parallel rank."""
        status = self.servicer.status()
        engines = set(status.engine.split(",")) - {""}
        dtype = "float32" if engines <= {"transformers"} else self.config.http.dtype
        window = status.limits.adapter_window
        return {
            "vllm_config": {
                "model_config": {
                    "model": self.config.http.model_path or self.base_id,
                    "served_model_name": self.base_id,
                    "dtype": f"torch.{dtype}",
                    "max_model_len": self.max_model_len(),
                },
                "lora_config": {
                    "max_lora_rank": self.config.http.max_lora_rank,
                    "max_loras": window,
                    "max_cpu_loras": window,
                },
                "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
            },
            "rollwire": {
                "model_fingerprint": status.model_fingerprint,
                "engines": sorted(engines),
                "replicas": [r.address for r in status.replicas if r.healthy],
                "adapter_window": window,
            },
        }

    # -- generation ------------------------------------------------------------------------
    def resolve(self, model: str) -> ModelRef:
        ref = parse_model(model, self.base_names)
        if not ref.is_base and self.adapters.is_hidden(ref):
            raise HttpError(
                _code("NOT_FOUND"),
                f"{model} was unloaded through this door; load it again or name another version (GET /v1/models)",
                reason=Reason.ADAPTER_UNLOADED,
                param="model",
            )
        return ref

    def deadline(self) -> float:
        return time.monotonic() + min(self.config.http.request_timeout_s, self.config.routing.request_timeout_s)

    async def run_group(self, request: pb.GenerateRequest, client: str, group: convert.Group, deadline: float) -> None:
        events = self.servicer.group_events(request, request.request_id, client, deadline)
        async with contextlib.aclosing(events):  # pyright: ignore[reportArgumentType]  # an async generator has aclose
            async for message in events:
                group.apply(message)

    async def chat_prompt(self, body: ChatBody) -> list[int]:
        if self.tokenizer is None:
            raise FailedPrecondition(
                "chat completions need the base model's tokenizer at the proxy: set http.model_path to the model's "
                "folder (or send a prompt to /v1/completions)",
                reason=Reason.NO_CHAT_TEMPLATE,
            )
        tokenizer = self.tokenizer

        def render() -> list[int]:
            text = tokenizer.render(
                body.messages,
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                kwargs=body.chat_template_kwargs or {},
            )
            return tokenizer.encode(text)

        return await asyncio.to_thread(render)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else ""


def create_app(door: Door) -> FastAPI:
    """The FastAPI application of the door; every route is declared in ROUTES."""
    app = FastAPI(title="rollwire", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = door.servicer.metrics
    http = door.config.http

    @app.middleware("http")
    async def observe(request: Request, call_next):
        start = time.monotonic()
        route = request.url.path if request.url.path in ROUTES else "other"
        rid = request.headers.get("x-request-id", "")[:128] or uuid.uuid4().hex
        request.state.rid = rid
        structlog.contextvars.bind_contextvars(request_id=rid)
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            metrics.http_requests.labels(route, str(status)).inc()
            metrics.http_latency.labels(route).observe(time.monotonic() - start)
            structlog.contextvars.unbind_contextvars("request_id")

    @app.exception_handler(RollwireError)
    async def rollwire_error(request: Request, err: RollwireError):
        _log_refusal(request, err)
        return error_response(err)

    @app.exception_handler(Relay)
    async def relayed(request: Request, relay: Relay):
        err = relay.error()
        _log_refusal(request, err)
        return error_response(err)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("http_request_failed", route=request.url.path, error=repr(exc)[:500], exc_info=exc)
        return error_response(Internal("the proxy failed on this request; it is logged"))

    def authorize(request: Request, role: str) -> str:
        """The caller's identity for the per-client limits, once its token grants `role`."""
        header = request.headers.get("authorization")
        if door.auth is not None:
            door.auth.require(role, header, request.url.path)
        peer = request.client
        host = f"ipv4:{peer.host}:{peer.port}" if peer else "unknown"
        return client_name([("authorization", header or "")], host, door.auth is not None)

    async def body_of(request: Request, kind: type[BaseModel]) -> Any:
        raw = await read_body(request, http.max_body_bytes)
        return await parse_body(raw, kind)

    @app.get("/health")
    async def health() -> Response:
        if door.servicer.replicas.routable():
            return Response(status_code=200)
        return error_response(
            Unavailable(
                f"no replica is routable ({door.servicer.replicas.describe()})",
                reason=Reason.NO_REPLICA,
                retry_after_s=door.config.routing.retry_after_s,
            )
        )

    @app.get("/server_info")
    async def server_info(request: Request) -> JSONResponse:
        authorize(request, GENERATE)
        return JSONResponse(door.server_info())

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request, GENERATE)
        return JSONResponse(door.models())

    @app.post("/pause")
    async def pause(request: Request) -> JSONResponse:
        """Nothing needs pausing in rollwire (docs/http.md): a load stages a new version on every
        replica and commits it without stopping requests of the versions before it."""
        authorize(request, ADMIN)
        return JSONResponse({"paused": False, "note": "rollwire swaps adapter versions without pausing"})

    @app.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        authorize(request, ADMIN)
        return JSONResponse({"paused": False})

    @app.get("/is_paused")
    async def is_paused(request: Request) -> JSONResponse:
        authorize(request, GENERATE)
        return JSONResponse({"is_paused": False})

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> JSONResponse:
        authorize(request, ADMIN)
        body: LoadLoraBody = await body_of(request, LoadLoraBody)
        if body.load_inplace:
            raise HttpError(
                _code("INVALID_ARGUMENT"),
                "load_inplace: a rollwire version never changes its bytes; load new weights under the next name "
                "(NAME-vN+1)",
                reason=Reason.UNSUPPORTED_FIELD,
                param="load_inplace",
            )
        return JSONResponse(await door.adapters.load_path(body.lora_name, body.lora_path, request.state.rid))

    @app.post("/v1/upload_lora_adapter")
    async def upload_lora(request: Request) -> JSONResponse:
        """multipart/form-data: `lora_name`, and the files adapter_config.json and
        adapter_model.safetensors (the fields are named after them)."""
        authorize(request, ADMIN)
        limit = door.config.spool.max_adapter_bytes + (2 << 20)
        _check_length(request, limit)
        try:
            form = await request.form(max_files=2, max_fields=2, max_part_size=1 << 20)
        except Exception as exc:  # the multipart parser's errors carry no common type
            raise HttpError(
                _code("INVALID_ARGUMENT"),
                f"the upload is not multipart/form-data with lora_name and the two adapter files ({exc})",
                reason=Reason.BAD_REQUEST_BODY,
            ) from None
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(form.close)
            name = form.get("lora_name")
            if not isinstance(name, str) or not name:
                raise HttpError(
                    _code("INVALID_ARGUMENT"),
                    "lora_name is required",
                    reason=Reason.BAD_REQUEST_BODY,
                    param="lora_name",
                )
            parts = []
            for key, value in form.multi_items():
                if not isinstance(value, str):
                    parts.append((key, await value.read()))
            config, payload = await door.adapters.read_upload(parts)
            return JSONResponse(await door.adapters.publish(name, config, payload, request.state.rid))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> JSONResponse:
        authorize(request, ADMIN)
        body: UnloadLoraBody = await body_of(request, UnloadLoraBody)
        return JSONResponse(door.adapters.unload(body.lora_name, door.base_names))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        client = authorize(request, GENERATE)
        body: CompletionBody = await body_of(request, CompletionBody)
        check_unhonoured(body)
        ref = door.resolve(body.model)
        prompts = body.prompts()
        if not prompts or len(prompts) > http.max_prompts:
            raise HttpError(
                _code("INVALID_ARGUMENT"),
                f"prompt holds {len(prompts)} prompts; send 1 to {http.max_prompts} per request",
                reason=Reason.BAD_REQUEST_BODY,
                param="prompt",
            )
        rid = body.request_id or request.state.rid
        max_tokens = body.max_tokens or 16
        requests = [
            convert.generate_request(body, p, ref, max_tokens, rid if len(prompts) == 1 else f"{rid}-{i}")
            for i, p in enumerate(prompts)
        ]
        if body.stream:
            if len(requests) > 1:
                raise HttpError(
                    _code("INVALID_ARGUMENT"),
                    "stream one prompt per request (or set stream to false for a batch of prompts)",
                    reason=Reason.UNSUPPORTED_FIELD,
                    param="stream",
                )
            return _stream(door, body, requests[0], client, "text_completion", rid)
        deadline = door.deadline()
        groups = [convert.Group(body.n, body.stop_list()) for _ in requests]
        await _all_or_first_error(
            [door.run_group(r, client, g, deadline) for r, g in zip(requests, groups, strict=True)]
        )
        return JSONResponse(convert.completion_response(body, groups, body.model, rid, door.token_text))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        client = authorize(request, GENERATE)
        body: ChatBody = await body_of(request, ChatBody)
        check_unhonoured(body)
        ref = door.resolve(body.model)
        prompt = await door.chat_prompt(body)
        rid = body.request_id or request.state.rid
        max_tokens = body.max_completion_tokens or body.max_tokens or door.default_max_tokens(len(prompt))
        req = convert.generate_request(body, prompt, ref, max_tokens, rid)
        if body.stream:
            return _stream(door, body, req, client, "chat.completion.chunk", rid)
        group = convert.Group(body.n, body.stop_list())
        await door.run_group(req, client, group, door.deadline())
        return JSONResponse(convert.chat_response(body, group, body.model, rid, door.token_text))

    return app


async def _all_or_first_error(runs: list[Awaitable[None]]) -> None:
    """Run the groups of one request together; the first failure cancels the others and is
    the request's answer (raised as it is, so its status reaches the caller)."""
    tasks = [asyncio.ensure_future(r) for r in runs]
    try:
        for done in asyncio.as_completed(tasks):
            await done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- bodies ------------------------------------------------------------------------------
def _check_length(request: Request, limit: int) -> None:
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise HttpError(
            _code("INVALID_ARGUMENT"),
            f"the request body is {length} bytes; this endpoint takes at most {limit}",
            reason=Reason.BODY_TOO_LARGE,
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes."""
    _check_length(request, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(
                _code("INVALID_ARGUMENT"),
                f"the request body is over {limit} bytes, the most this endpoint takes",
                reason=Reason.BODY_TOO_LARGE,
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(raw: bytes, kind: type[BaseModel]) -> Any:
    """`raw` as `kind`; a 400 naming the first field that is wrong."""

    def parse() -> Any:
        try:
            return kind.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            if first["type"] == "extra_forbidden":
                raise HttpError(
                    _code("INVALID_ARGUMENT"),
                    f"{where}: rollwire does not know this field; remove it (docs/http.md lists every field)",
                    reason=Reason.UNSUPPORTED_FIELD,
                    param=where,
                ) from None
            if first["type"].startswith("json"):
                raise HttpError(
                    _code("INVALID_ARGUMENT"),
                    f"the body is not valid JSON: {first['msg']}",
                    reason=Reason.BAD_REQUEST_BODY,
                ) from None
            raise HttpError(
                _code("INVALID_ARGUMENT"),
                f"{where}: {first['msg']} (got {str(first.get('input'))[:80]!r})",
                reason=Reason.BAD_REQUEST_BODY,
                param=where,
            ) from None

    return await asyncio.to_thread(parse) if len(raw) > THREAD_PARSE_BYTES else parse()


# -- streaming ---------------------------------------------------------------------------
class BoundedStream(StreamingResponse):
    """Server-sent events whose every send must complete within `patience` seconds: a reader
    that stops reading ends its response (and so its group) instead of holding it."""

    def __init__(self, content: AsyncIterator[str], patience: float) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.patience = patience

    async def stream_response(self, send: Callable[[Any], Awaitable[None]]) -> None:  # pyright: ignore[reportIncompatibleMethodOverride]
        async def bounded(message: Any) -> None:
            async with asyncio.timeout(self.patience):
                await send(message)

        await super().stream_response(bounded)  # pyright: ignore[reportArgumentType]


def _stream(door: Door, body: CompletionBody | ChatBody, req: pb.GenerateRequest, client: str, kind: str, rid: str):
    """A streamed group: an SSE event per message of the core's stream, `[DONE]` at the end;
    an error after the stream started is a last event with an `error` object (the status is
    sent already). A restart after tokens were sent cannot be taken back, so it ends the
    stream with an UNAVAILABLE error (retry); before that the failover is invisible. Chunks
    are shaped as vLLM's (tests/test_http_vllm_parity.py): with `return_token_ids` the first
    chunk carries `prompt_token_ids` (chat: in the frame; completions: in each choice's first
    delta), and a sample's finish rides on its last tokens' delta."""
    chat = kind == "chat.completion.chunk"
    holdback = max((len(s) for s in body.stop_list()), default=1) - 1
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def event(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def frame(choices: list[dict[str, Any]]) -> dict[str, Any]:
        prefix = "chatcmpl" if chat else "cmpl"
        return {
            "id": f"{prefix}-{rid}",
            "object": kind,
            "created": int(time.time()),
            "model": body.model,
            "choices": choices,
        }

    async def events() -> AsyncIterator[str]:
        group = convert.Group(body.n, body.stop_list())
        sent_text = [0] * body.n
        shown = False
        unprompted = set(range(body.n)) if body.return_token_ids and not chat else set()
        try:
            async with contextlib.aclosing(door.servicer.group_events(req, rid, client, door.deadline())) as stream:  # pyright: ignore[reportArgumentType]
                async for message in stream:
                    if message.HasField("restarted") and shown:
                        raise Unavailable(
                            "the replica serving this stream failed after sending tokens; send the request again",
                            reason=Reason.ATTEMPTS_EXHAUSTED,
                        )
                    choices = []
                    for index, chunk, finish in group.apply(message):
                        c = group.choices[index]
                        text = c.final_text(body.include_stop_str_in_output) if finish else "".join(c.text)
                        upto = len(text) if finish else max(sent_text[index], len(text) - holdback)
                        delta, sent_text[index] = text[sent_text[index] : upto], upto
                        choices.append(_delta(body, chat, index, delta, chunk, finish, c, door.token_text))
                        if index in unprompted:
                            unprompted.discard(index)
                            choices[-1]["prompt_token_ids"] = list(group.prompt_ids)
                    choices = _merge_finishes(choices, chat)
                    extra: dict[str, Any] = {}
                    if chat and message.HasField("started"):
                        role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                        choices = [{"index": i, **role} for i in range(body.n)] + choices
                        if body.return_token_ids:
                            extra["prompt_token_ids"] = list(group.prompt_ids)
                    if choices:
                        shown = True
                        yield event({**frame(choices), **extra})
            if include_usage:
                yield event({**frame([]), "usage": convert.usage([group])})
        except Relay as relay:
            yield event(_error_body(relay.error()))
        except RollwireError as err:
            yield event(_error_body(err))
        yield "data: [DONE]\n\n"

    return BoundedStream(events(), door.config.fairness.slow_reader_timeout_s)


def _delta(
    body: CompletionBody | ChatBody,
    chat: bool,
    index: int,
    text: str,
    chunk: pb.TokenChunk | None,
    finish: str | None,
    c: convert.Choice,
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    ids = list(chunk.token_ids) if chunk is not None else []
    lps = list(chunk.logprobs) if chunk is not None else []
    out: dict[str, Any] = {"index": index, "finish_reason": finish, "adapter_version": c.version}
    if finish or not chat:  # vLLM: in every completion chunk, in a chat chunk with the finish
        out["stop_reason"] = c.stop_reason
    if chat:
        out["delta"] = {"content": text} if text else {}
        out["logprobs"] = convert.chat_logprobs(ids, lps, token_text) if getattr(body, "logprobs", False) else None
    else:
        out["text"] = text
        out["logprobs"] = convert.completion_logprobs(ids, lps, token_text) if body.logprobs is not None else None
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
                last["delta"] = {"content": text} if text else {}
            else:
                last["text"] += choice["text"]
            last["finish_reason"], last["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
            continue
        merged.append(choice)
    return merged


def _error_body(err: RollwireError) -> dict[str, Any]:
    return json.loads(bytes(error_response(err).body))


def _log_refusal(request: Request, err: RollwireError) -> None:
    log.info(
        "http_refused", route=request.url.path, status=http_status(err), reason=err.reason, error=err.message[:300]
    )


def _code(name: str):
    import grpc

    return grpc.StatusCode[name]


# -- the server ----------------------------------------------------------------------------
class HttpServer:
    """uvicorn serving the door on the proxy's event loop; the proxy keeps its own signal
    handling (uvicorn's is switched off) and stops the door with itself."""

    def __init__(self, door: Door) -> None:
        import uvicorn

        config = door.config
        tls = config.tls
        self.sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((config.host, config.http.port or 0))
        except OSError as exc:
            self.sock.close()
            raise SystemExit(f"cannot listen for HTTP on {config.host}:{config.http.port}: {exc}") from None
        self.port = self.sock.getsockname()[1]
        options: dict[str, Any] = {}
        if tls.cert_file:
            options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
            if tls.client_ca_file:
                options |= {"ssl_ca_certs": tls.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        self.config = uvicorn.Config(
            create_app(door),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=math.ceil(config.grace_seconds) or 1,
            **options,
        )

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the proxy handles SIGTERM/SIGINT itself
                yield

        self.server = _Server(self.config)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)  # the door logs its own events (structlog)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup(sockets=[self.sock])
        self._task = asyncio.create_task(self.server.main_loop())

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.server.shutdown(sockets=[self.sock])
        self._task = None
