"""vLLM's adapter routes at the door: /v1/load_lora_adapter (a folder under the adapter root),
/v1/upload_lora_adapter (multipart: the folder's files) and /v1/unload_lora_adapter, each the
core's `load` or `unload` verb (core.py) over the door's reading of names and files
(adapters.py); an upload's bytes bounded by the spool's room for its tenant and by the door's
upload budget before they are held (audit S4)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from rollwire.common.errors import NotFound
from rollwire.common.reasons import Reason
from rollwire.common.signing import MAX_SIGNATURE_FILE_BYTES, SIGNATURE_FILE
from rollwire.proxy.http.adapters import CONFIG_FILE, MAX_CONFIG_BYTES, UPLOAD_SLACK, WEIGHTS_FILE, Files, answer
from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.dialect.names import model_id
from rollwire.proxy.http.dialect.openai import LoadLoraBody, UnloadLoraBody
from rollwire.proxy.http.edge.bodies import body_chunks
from rollwire.proxy.http.edge.uploads import Holding, read_form
from rollwire.proxy.http.scoped import caller_of, scope_of
from rollwire.runtime.security import ADMIN

if TYPE_CHECKING:
    from rollwire.proxy.http.door import Door

Authorize = Callable[[Any, Request, str], str]
ReadBody = Callable[[Any, Request, type[BaseModel]], Awaitable[Any]]


def add_adapter_routes(app: FastAPI, door: Door, authorize: Authorize, read_body: ReadBody) -> None:
    """vLLM's load, upload and unload routes on the door's app (`authorize`, `read_body`: app.py's)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> JSONResponse:
        authorize(door, request, ADMIN)
        body: LoadLoraBody = await read_body(door, request, LoadLoraBody)
        if body.load_inplace:
            raise HttpError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "load_inplace: a rollwire version never changes its bytes; load new weights under the next name "
                "(NAME-vN+1)",
                reason=Reason.UNSUPPORTED_FIELD,
                param="load_inplace",
            )

        def named() -> tuple[str, int]:
            ref = door.adapters.load_ref(body.lora_name)
            return ref.name, ref.version

        async def files() -> Files:
            return await door.adapters.read_path(body.lora_path)

        loaded = await door.core.load(caller_of(request), "load", body.lora_name, named, files, request.state.rid)
        door.pacing.loaded(loaded.held, loaded.version)
        return JSONResponse(answer(loaded))

    @app.post("/v1/upload_lora_adapter")
    async def upload_lora(request: Request) -> JSONResponse:
        """multipart/form-data: `lora_name`, and the files adapter_config.json and
        adapter_model.safetensors (the fields are named after them), and optionally
        rollwire-signature.json (a signed version, docs/security.md)."""
        authorize(door, request, ADMIN)
        adapters = door.adapters
        with adapters.uploads.hold(scope_of(request).label) as holding:  # its bytes in the door's budget (S4)
            parts = await _upload_parts(door, request, holding)
            name = parts.pop("lora_name", b"").decode("utf-8", "replace")
            if not name:
                raise HttpError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "lora_name is required",
                    reason=Reason.BAD_REQUEST_BODY,
                    param="lora_name",
                )

            def named() -> tuple[str, int]:
                ref = adapters.load_ref(name)
                return ref.name, ref.version

            async def files() -> Files:
                return adapters.read_upload(parts.items())

            loaded = await door.core.load(caller_of(request), "upload", name, named, files, request.state.rid)
        return JSONResponse(answer(loaded))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> JSONResponse:
        authorize(door, request, ADMIN)
        body: UnloadLoraBody = await read_body(door, request, UnloadLoraBody)
        return JSONResponse(await _unload(door, request, body.lora_name))


async def _unload(door: Door, request: Request, asked: str) -> dict[str, Any]:
    """The core's unload of `asked` (NAME-vN, or NAME: every version), answered in vLLM's shape."""
    try:
        held, versions = await door.core.unload(caller_of(request), asked, lambda: door.adapters.unload_ref(asked))
    except NotFound as err:  # about the request's lora_name, in vLLM's words
        raise HttpError(err.code, err.message, reason=err.reason, param="lora_name") from None
    name, version = door.adapters.unload_ref(asked)
    door.pacing.unloaded(held, version)
    return {"object": "lora_adapter", "id": asked, "unloaded": [model_id(name, v) for v in versions]}


async def _upload_parts(door: Door, request: Request, holding: Holding) -> dict[str, bytes]:
    """An upload's fields, its weights bounded by what the spool and the caller's tenant could
    take now (routing.shares.upload_room) and its bytes by the door's upload budget, both
    before its bytes are held: a declared Content-Length is checked and counted whole first."""
    arriving = holding.budget.by_tenant[holding.tenant] - holding.size  # the tenant's other uploads at the door
    room = door.core.upload_room(scope_of(request), arriving)
    limits = {
        "lora_name": 1024,
        CONFIG_FILE: MAX_CONFIG_BYTES,
        WEIGHTS_FILE: min(door.adapters.max_bytes, room),
        SIGNATURE_FILE: MAX_SIGNATURE_FILE_BYTES,
    }
    total = sum(limits.values()) + UPLOAD_SLACK - 1024  # lora_name is among the limits
    no_room = HttpError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the proxy's spool can take at most {room} more bytes of adapters from this caller now (the room it has, "
        "less uploads in flight, within the tenant's quotas: docs/deploy.md, Tenants), and this upload's weights are "
        "larger; unload versions, push a smaller adapter, or retry when uploads in flight have ended",
        reason=Reason.SPOOL_FULL,
        retry_after_s=door.config.routing.retry_after_s,
    )
    declared = request.headers.get("content-length", "")
    if room < door.adapters.max_bytes and declared.isdigit() and int(declared) > total:
        raise no_room
    if declared.isdigit() and int(declared) <= total:
        holding.reach(int(declared))  # the whole declared body, before its first byte
    chunks = body_chunks(request, total, door.config.http.body_timeout_s)
    refusals = {WEIGHTS_FILE: no_room} if room < door.adapters.max_bytes else {}
    return await read_form(request.headers.get("content-type", ""), chunks, limits, total, holding, refusals)
