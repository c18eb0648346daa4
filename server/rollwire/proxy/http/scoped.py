"""The HTTP door's tenant edge (proxy/tenants.py): a request's scope, its adapter routes'
names qualified and audited, and their answers in the caller's words."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request

from rollwire.common.errors import InvalidArgument, RollwireError
from rollwire.common.reasons import Reason
from rollwire.proxy.http.dialect.names import model_id, parse_model
from rollwire.proxy.tenants import Scope, audit
from rollwire.runtime.security import ADMIN

if TYPE_CHECKING:
    from rollwire.proxy.http.door import Door


def scope_of(request: Request) -> Scope:
    """The names' scope of a request's caller (the fleet's until its token was checked)."""
    return getattr(request.state, "scope", None) or Scope()


@contextlib.asynccontextmanager
async def publication(door: Door, request: Request, action: str, lora_name: str) -> AsyncIterator[tuple[str, list]]:
    """A load, upload or unload of `lora_name` by this request's caller: yields the name as the
    fleet holds it (a tenant's own: tenants.Scope.own) and a list the route appends its answer
    to; audited (tenants.audit) however it ends. No caller loads under the base model's id (a
    tenant would write the shared namespace with it, audit S7): INVALID_ARGUMENT BAD_ADAPTER_NAME."""
    scope, role = scope_of(request), getattr(request.state, "role", ADMIN)
    name, adapter, done = lora_name, lora_name, []
    metrics = door.core.state.metrics.tenant_publishes
    try:
        if lora_name in door.base_names and action != "unload":  # the unload route refuses it in its own words
            raise InvalidArgument(
                f"lora_name {lora_name[:80]!r} is the base model's id, which names the base model on this server; "
                "load the adapter under a name of its own",
                reason=Reason.BAD_ADAPTER_NAME,
            )
        if scope.tenant and lora_name not in door.base_names:  # every write of a tenant is of its own names
            ref = parse_model(lora_name, frozenset())
            adapter = scope.own(ref.name)
            name = model_id(adapter, ref.version) if ref.version else adapter
        else:  # the fleet's name goes on as given (the route's own checks come first, as without tenants)
            adapter = _bare(lora_name)
        yield name, done
    except RollwireError as err:
        audit(metrics, scope, role, action, adapter, 0, err)
        raise
    out = done[0] if done else {}
    version = out.get("version") or [int(v.rsplit("-v", 1)[1]) for v in out.get("unloaded", ())]
    audit(metrics, scope, role, action, out.get("lineage") or adapter, version, None)


def shown(request: Request, out: Any) -> Any:
    """An adapter route's answer in its caller's words: a tenant's own names unqualified."""
    scope = scope_of(request)
    if not scope.tenant:
        return out
    if isinstance(out, str):
        return scope.scrub(out)
    if isinstance(out, list):
        return [shown(request, v) for v in out]
    if isinstance(out, dict):
        return {k: shown(request, v) for k, v in out.items()}
    return out


def _bare(lora_name: str) -> str:
    """`NAME` of a `NAME-vN` the fleet gave, for its audit line (itself when it does not parse)."""
    try:
        return parse_model(lora_name, frozenset()).name
    except RollwireError:
        return lora_name
