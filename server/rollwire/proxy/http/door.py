"""What the door's routes answer from: the proxy's core, its config and the base model's
tokenizer (`Door`), and what the fleet is, told as vLLM tells it (/v1/models, /server_info)."""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rollwire.common.errors import FailedPrecondition, InvalidArgument
from rollwire.common.reasons import Reason
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.core import ProxyCore
from rollwire.proxy.http.adapters import AdapterDoor
from rollwire.proxy.http.dialect import convert, toolcalls
from rollwire.proxy.http.dialect.errors import HttpError
from rollwire.proxy.http.dialect.names import ModelRef, model_id, parse_model
from rollwire.proxy.http.dialect.openai import ChatBody
from rollwire.proxy.http.dialect.prompts import PromptGate
from rollwire.proxy.http.dialect.tokenizer import ChatTokenizer
from rollwire.proxy.http.dialect.toolcalls import Format
from rollwire.proxy.http.pacing import Pacing
from rollwire.proxy.http.pause import Pauses
from rollwire.proxy.http.weights import proof_summary
from rollwire.proxy.tenants import FLEET, Scope
from rollwire.runtime.logs import get_logger
from rollwire.runtime.security import TokenAuth
from rollwire.v1 import generator_pb2 as pb

log = get_logger(__name__)


@dataclass
class Door:
    """What the routes answer from: the proxy's core, its config and the base model's tokenizer."""

    config: ProxyConfig
    core: ProxyCore
    adapters: AdapterDoor
    auth: TokenAuth | None
    tokenizer: ChatTokenizer | None
    base_id: str
    base_names: frozenset[str]
    context_len: int
    """max_position_embeddings of the base model (0: unknown)."""
    tool_format: Format | None = None
    """The tool-call format http.tool_call_parser names, checked against the tokenizer at start (None: no parser,
    or no tokenizer, so no chat)."""

    @classmethod
    def build(cls, config: ProxyConfig, core: ProxyCore) -> Door:
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
        adapters = AdapterDoor(config, frozenset(names))
        tool_format = None
        if http.tool_call_parser and tokenizer is not None:
            try:  # as vLLM refuses a parser its tokenizer cannot serve, at start, with the sentence
                tool_format = toolcalls.format_for(http.tool_call_parser, *tokenizer.vocabulary())
            except ValueError as refused:
                raise SystemExit(str(refused)) from None
        return cls(
            config,
            core,
            adapters,
            core.state.auth,
            tokenizer,
            base_id,
            frozenset(names),
            context_len,
            tool_format,
        )

    # -- what the fleet is -------------------------------------------------------------------
    def max_model_len(self, status: pb.GetStatusResponse | None = None) -> int:
        if self.config.http.max_model_len:
            return self.config.http.max_model_len
        limits = (status or self.core.status()).limits
        fleet = limits.max_prompt_tokens + limits.max_new_tokens if limits.max_new_tokens else 0
        known = [x for x in (fleet, limits.max_context, self.context_len) if x]  # what every replica can serve
        return min(known) if known else 0

    def limits(self) -> pb.Limits:
        """The strictest limits of any replica (what every replica serves)."""
        return self.core.status().limits

    def default_max_tokens(self, prompt_len: int) -> int:
        """A chat request's max_tokens when it sends none: vLLM's (what the context leaves after
        the prompt), within what the replicas generate per sample."""
        room = max(1, self.max_model_len() - prompt_len)
        fleet = self.core.status().limits.max_new_tokens
        return min(room, fleet) if fleet else room

    def models(self, scope: Scope) -> dict[str, Any]:
        """vLLM's /v1/models: the base model, and every version served that `scope` sees, by its caller's name."""
        created, status = int(time.time()), self.core.status()  # one status: it walks every replica
        max_len = self.max_model_len(status)
        data = [
            {
                "id": self.base_id,
                "object": "model",
                "created": created,
                "owned_by": "rollwire",
                "root": self.config.http.model_path or self.base_id,
                "parent": None,
                "max_model_len": max_len,
            }
        ]
        digests = {(a.name, v): d for a in status.adapters for v, d in a.digests.items()}
        proofs = proof_summary(status)  # docs/protocol.md, "Proof": counts per outcome, no replica named
        for name, version, shown in self.core.listing(status, scope):  # by its client's name, theirs only
            listed = model_id(shown, version)
            data.append(
                {
                    "id": listed,
                    "object": "model",
                    "created": created,
                    "owned_by": "rollwire",
                    "root": listed,
                    "parent": self.base_id,
                    "max_model_len": max_len,
                    "rollwire": {
                        "version": version,
                        "sha256": digests.get((name, version), ""),
                        "proofs": proofs.get((name, version), {}),
                    },
                }
            )
        return {"object": "list", "data": data}

    def model(self, model: str, scope: Scope) -> dict[str, Any]:
        """GET /v1/models/{id}: the entry /v1/models lists under that id (the base also under
        its path); 404 in vLLM's words otherwise."""
        data = self.models(scope)["data"]
        if model in self.base_names:
            return data[0]
        entry = next((m for m in data if m["id"] == model), None)
        if entry is None:
            raise HttpError(
                grpc.StatusCode.NOT_FOUND,
                f"The model `{model[:256]}` does not exist (GET /v1/models lists the models served)",
                reason=Reason.ADAPTER_NOT_FOUND,
                param="model",
            )
        return entry

    def server_info(self) -> dict[str, Any]:
        """vLLM's /server_info as TRL reads it, true of the fleet: an adapter load reaches every
        replica, so to the caller the fleet is one data-parallel rank."""
        status = self.core.status()
        engines = set(status.engine.split(",")) - {""}
        dtype = "float32" if engines <= {"transformers"} else self.config.http.dtype
        window = status.limits.adapter_keep or status.limits.adapter_window  # versions a caller may name
        return {
            "vllm_config": {
                "model_config": {
                    "model": self.config.http.model_path or self.base_id,
                    "served_model_name": self.base_id,
                    "dtype": f"torch.{dtype}",
                    "max_model_len": self.max_model_len(),
                    "logprobs_mode": "processed_logprobs",  # after temperature, top-k/top-p (docs/protocol.md)
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
    def resolve(self, model: str, scope: Scope) -> ModelRef:
        """What a request's `model` selects, its adapter's name as the fleet holds it (a tenant's
        own, else a shared one: tenants.Scope.read)."""
        try:
            ref = parse_model(model, self.base_names)
            if not ref.is_base:
                ref = ModelRef(scope.read(ref.name, self.core.has_adapter), ref.version)
        except InvalidArgument as err:  # a name no adapter can have: about the request's `model`
            raise HttpError(err.code, err.message, reason=err.reason, param="model") from None
        if not ref.is_base and self.core.is_hidden(ref.name, ref.version):
            raise HttpError(
                grpc.StatusCode.NOT_FOUND,
                f"{model} was unloaded; load it again or name another version (GET /v1/models)",
                reason=Reason.ADAPTER_UNLOADED,
                param="model",
            )
        return ref

    def deadline(self) -> float:
        return time.monotonic() + min(self.config.http.request_timeout_s, self.config.routing.request_timeout_s)

    async def run_group(
        self, request: pb.GenerateRequest, client: str, group: convert.Group, deadline: float, tenant: str = FLEET
    ) -> None:
        events = self.group_events(request, request.request_id, client, deadline, tenant)
        async with contextlib.aclosing(events):
            async for message in events:
                group.apply(message)

    @functools.cached_property
    def pauses(self) -> Pauses:
        return Pauses(self.config.http.pause_max_s, self.core.state.metrics.http_paused)

    @functools.cached_property
    def pacing(self) -> Pacing:
        http = self.config.http
        return Pacing(http.pacing_factor, http.pacing_hold_max_s, self.core.state.metrics.http_paced)

    async def group_events(
        self, request: pb.GenerateRequest, rid: str, client: str, deadline: float, tenant: str
    ) -> AsyncGenerator[pb.GenerateResponse]:
        """The core's group_events, once the tenant's /pause (pause.py) and the lineage's pace
        (pacing.py) let the request go."""
        await self.pauses.hold(tenant, deadline)
        async with self.pacing.paced(request.adapter.name, request.n, deadline):
            with self.pauses.running(tenant):
                events = self.core.group_events(request, rid, client, deadline, tenant)
                async with contextlib.aclosing(events):  # pyright: ignore[reportArgumentType]  # an async generator has aclose
                    async for message in events:
                        yield message

    @functools.cached_property
    def prompts(self) -> PromptGate:
        return PromptGate(self.config.http, self.config.routing.retry_after_s)

    async def chat_prompt(self, body: ChatBody, client: str = "") -> list[int]:
        """The chat rendered and tokenized, its size bounded first (prompts.py: audit A2)."""
        if self.tokenizer is None:
            raise FailedPrecondition(
                "chat completions need the base model's tokenizer at the proxy: set http.model_path to the model's "
                "folder (or send a prompt to /v1/completions)",
                reason=Reason.NO_CHAT_TEMPLATE,
            )
        tokenizer = self.tokenizer
        max_tokens = self.core.status().limits.max_prompt_tokens
        chat = (body.messages, body.tools, body.chat_template_kwargs)
        size = self.prompts.check_size(chat, max_tokens)

        def render() -> list[int]:
            text = tokenizer.render(
                body.messages,
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                kwargs=body.chat_template_kwargs or {},
            )
            return tokenizer.encode(text, max_tokens)

        return await self.prompts.run(client, size, render)

    async def prompt_ids(
        self, prompt: str | list[int], client: str = "", *, special: bool = False, count_only: bool = False
    ) -> list[int]:
        """A completions prompt as token ids: ids as sent, text tokenized here, its size bounded
        first as a chat's is (prompts.py). `special` adds the tokenizer's special tokens;
        `count_only` (/tokenize) returns more ids than a prompt may have instead of refusing them
        (the text's size is bounded all the same)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise FailedPrecondition(
                "scoring a text prompt needs the base model's tokenizer at the proxy: set http.model_path to the "
                "model's folder, or send the prompt as token ids",
                reason=Reason.NO_CHAT_TEMPLATE,
            )
        tokenizer, max_tokens = self.tokenizer, self.core.status().limits.max_prompt_tokens
        size = self.prompts.check_size(prompt, max_tokens)
        limit = 0 if count_only else max_tokens
        return await self.prompts.run(client, size, lambda: tokenizer.encode(prompt, limit, special=special))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else ""
