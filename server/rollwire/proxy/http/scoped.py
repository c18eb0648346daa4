"""The HTTP door's tenant edge (proxy/tenants.py): a request's caller and the names' scope it
reads with. The scope itself is applied by the core's verbs (core.py), once for both doors."""

from __future__ import annotations

from fastapi import Request

from rollwire.proxy.core import Caller
from rollwire.proxy.tenants import Scope
from rollwire.runtime.security import ADMIN


def scope_of(request: Request) -> Scope:
    """The names' scope of a request's caller (the fleet's until its token was checked)."""
    return getattr(request.state, "scope", None) or Scope()


def caller_of(request: Request) -> Caller:
    """A request's caller for the core's verbs (the fleet's admin until its token was checked)."""
    return Caller(getattr(request.state, "role", ADMIN), scope_of(request))
