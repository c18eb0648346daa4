"""Requests as the SDK builds them: adapter selectors, sampling options, a GenerateRequest.

Invariants:
- a request is validated here before any byte leaves the process (`RequestError`);
- unset optional sampling parameters stay unset on the wire (the server's defaults apply).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypedDict

from rollwire.common.errors import RequestError
from rollwire.common.errors import finite_number as _float
from rollwire.common.errors import whole_number as _int
from rollwire.common.manifest import NAME_RULE, name_ok
from rollwire.v1 import generator_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 128
UINT32 = (1 << 32) - 1
UINT64 = (1 << 64) - 1
INT32 = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """An adapter name and version; version 0 means "latest" in a selector."""

    name: str
    version: int = 0

    def __str__(self) -> str:
        return f"{self.name}@{self.version or 'latest'}"


def check_adapter_name(name: str) -> str:
    """The name, if a server would accept it (the push protocol's one rule)."""
    if not name_ok(name):
        raise RequestError(f"adapter name {name!r} is invalid: use {NAME_RULE}")
    return name


def parse_adapter(spec: str | AdapterVersion | None) -> AdapterVersion | None:
    """ "name" / "name@latest" -> newest version, "name@3" -> version 3, None -> base model."""
    if spec is None or isinstance(spec, AdapterVersion):
        return spec
    if not isinstance(spec, str):
        raise RequestError(f"adapter must be a string like 'name@3', got {type(spec).__name__}")
    name, sep, version = spec.partition("@")
    check_adapter_name(name)
    if not sep or version == "latest":
        return AdapterVersion(name, 0)
    if not version.isdigit() or int(version) < 1 or int(version) > UINT64:
        raise RequestError(f"adapter {spec!r}: the version after '@' must be a whole number >= 1 or 'latest'")
    return AdapterVersion(name, int(version))


class GenerateOptions(TypedDict, total=False):
    """Keyword options of `generate` / `generate_stream` besides prompt and n."""

    max_new_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    stop: str | Sequence[str]
    seed: int | None
    ignore_eos: bool
    return_kept_tokens: bool
    return_routed_experts: bool
    adapter: str | AdapterVersion | None
    follow: bool
    group_key: str
    request_id: str


def _set_prompt(request: pb.GenerateRequest, prompt: str | Sequence[int]) -> None:
    if isinstance(prompt, str):
        request.text = prompt
        return
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Iterable):
        raise RequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    ids = [_int("prompt token id", token, 0, INT32) for token in prompt]
    if not ids:
        raise RequestError("prompt token ids must hold at least one id")
    request.token_ids.ids.extend(ids)


def _sampling(
    max_new_tokens: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop: str | Sequence[str],
    seed: int | None,
    ignore_eos: bool,
    return_kept_tokens: bool = False,
) -> pb.SamplingParams:
    params = pb.SamplingParams(max_new_tokens=_int("max_new_tokens", max_new_tokens, 1, UINT32))
    if temperature is not None:
        if _float("temperature", temperature) < 0:
            raise RequestError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        params.temperature = temperature
    if top_p is not None:
        if not 0 < _float("top_p", top_p) <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}")
        params.top_p = top_p
    if top_k is not None:
        params.top_k = _int("top_k", top_k, 0, UINT32)
    stops = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be non-empty strings, got {stops!r}")
    params.stop.extend(stops)
    if seed is not None:
        params.seed = _int("seed", seed, 0, UINT64)
    params.ignore_eos = bool(ignore_eos)
    params.return_kept_tokens = bool(return_kept_tokens)
    return params


def build_generate_request(
    prompt: str | Sequence[int],
    n: int = 1,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    stop: str | Sequence[str] = (),
    seed: int | None = None,
    ignore_eos: bool = False,
    return_kept_tokens: bool = False,
    return_routed_experts: bool = False,
    adapter: str | AdapterVersion | None = None,
    follow: bool = False,
    group_key: str = "",
    request_id: str = "",
) -> pb.GenerateRequest:
    """One validated GenerateRequest; unset optional params stay unset on the wire."""
    request = pb.GenerateRequest(n=_int("n", n, 1, UINT32))
    _set_prompt(request, prompt)
    request.sampling.CopyFrom(
        _sampling(max_new_tokens, temperature, top_p, top_k, stop, seed, ignore_eos, return_kept_tokens)
    )
    selector = parse_adapter(adapter)
    if selector is not None:
        request.adapter.name, request.adapter.version = selector.name, selector.version
    if follow:
        if selector is None or selector.version:
            raise RequestError("follow=True needs adapter='NAME' or 'NAME@latest': a pinned version cannot be followed")
        request.adapter.follow = True
    if not isinstance(group_key, str) or not isinstance(request_id, str):
        raise RequestError("group_key and request_id must be strings")
    request.group_key, request.request_id = group_key, request_id
    request.return_routed_experts = bool(return_routed_experts)
    return request
