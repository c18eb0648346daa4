"""Tenants: many teams' runs on one fleet, each in a namespace of adapter names of its own
(docs/deploy.md, "Tenants"). Imports nothing of the proxy's, so its config may import it.

A tenant is a name, the token files of the roles its callers may have (`generate`;
`publish`: generate's calls and its own adapters' pushes, loads and unloads), a weight and
quotas. A token belongs to at most one tenant (runtime/security.py refuses a token listed for
two, or for a tenant and the fleet); a token in no tenant is the fleet's, as without tenants.

Invariants (`Scope`, applied by the core's verbs for both doors, core.py, before anything else sees a name):
- a tenant's adapter name NAME is `TENANT:NAME` to the core, the spool, lineages, peers and
  replicas; ':' is in no name a client gives (manifest.NAME_RE), so no name a tenant gives can
  spell another tenant's, nor a shared one;
- writes (pushes, loads, unloads) are always of the caller's own names; reads (Generate,
  Score, a `model`) of NAME take the tenant's own NAME once the fleet has it, else the shared
  NAME (an admin's, unqualified) when the fleet has that;
- what a tenant reads back (a stream's `started`, GetStatus, /v1/models, load and unload
  replies, error sentences) names its own adapters unqualified and shared ones as they are;
  another tenant's names never appear, and asking for one is asking for one's own NAME: not
  found, so a refusal never confirms that another tenant's name exists; every sentence a
  tenant reads passes `Scope.scrub` (the doors', and a replica's relayed status with its
  `google.rpc.Status` detail: routing/passthrough.py), which hides every other `A:B` in it;
- the fleet's tokens see every name as the fleet holds it, qualified names included;
- every publication that named an adapter (a push, a load, an upload, an unload), accepted or
  refused, is one `adapter_audit` log line saying who (tenant, role) did what to which
  adapter (`audit`), and counted in rollwire_proxy_tenant_publishes_total.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from rollwire.common.errors import InvalidArgument, RollwireError, clip
from rollwire.common.manifest import NAME_RE, NAME_RULE, TENANT_SEPARATOR
from rollwire.common.reasons import Reason
from rollwire.runtime.config import Section
from rollwire.runtime.logs import get_logger

log = get_logger(__name__)

HIDDEN = "(hidden)"
"""What a tenant reads in a sentence where another tenant's name or a replica's address stood."""
_QUALIFIED = re.compile(
    r"\[[0-9A-Fa-f:.]+\](?::\d+)?"
    r"|(?<![\w.:\[-])(?!(?:sha256|blake3):)(?P<tenant>[A-Za-z0-9][\w.-]*):(?P<name>[A-Za-z0-9][\w.-]*)"
)
"""`TENANT:NAME`, and `HOST:PORT` (a name, an IPv4 or a bracketed IPv6 address), wherever it stands in a sentence;
not a digest (`sha256:...`, `blake3:...`: a base-model fingerprint every caller may read)."""
FLEET = "_fleet"
"""The `tenant` label of the fleet's own tokens (and of calls where auth is off): no tenant can
be so named (NAME_RE starts with a letter or digit), so the label set is the configured
tenants plus this one."""


class QuotaSection(Section):
    """What one tenant may hold and use at once; refused beyond it (RESOURCE_EXHAUSTED, reason TENANT_QUOTA)."""

    max_spool_versions: int = Field(default=0, ge=0)
    """Versions of the tenant's adapters the proxy's spool may hold, all its names together (a push to a name already
    at spool.keep_versions replaces its oldest); 0 = no limit but the spool's."""
    max_spool_bytes: int = Field(default=0, ge=0)
    """Bytes of the tenant's adapters the spool may hold; 0 = no limit but the spool's."""
    max_in_flight: int = Field(default=0, ge=0)
    """Generation and Score requests all the tenant's callers may have open at the proxy (queued or running), either
    door; 0 = only the per-client limit ([fairness])."""
    max_queued_tokens: int = Field(default=0, ge=0)
    """Work (n x max_new_tokens) all the tenant's callers may have waiting in the proxy's queue (its first queued
    request is always accepted); 0 = only the per-client limit."""
    max_tokens_per_s: float = Field(default=0.0, ge=0)
    """Work the tenant may start per second (a Generate's n x max_new_tokens, a Score's prompt and continuation tokens),
    over a 10 s window (it may burst 10 s' worth); 0 = no limit."""


class TenantSection(Section):
    """One tenant: its name, its callers' token files, its weight and quotas."""

    name: str
    """The tenant's name (the adapter-name rule: 1-64 letters, digits, '.', '_' or '-'); its adapters are
    `NAME:ADAPTER` in the fleet, the `tenant` label of its metrics and audit lines."""
    generate_tokens_file: str = Field(default="")
    """File of this tenant's tokens with the `generate` role (Generate, Score, GetStatus; the HTTP door's sampling),
    one per line."""
    publish_tokens_file: str = Field(default="")
    """File of this tenant's tokens with the `publish` role: all that generate may, and pushing, loading and unloading
    this tenant's own adapters (never a fleet operation), one per line. A TRL run holds one of these."""
    weight: float = Field(default=1.0, gt=0, le=1000)
    """Its share of the fleet under contention, relative to the other tenants' weights (the fleet's own tokens
    weigh 1); a tenant alone may use the whole fleet."""
    quotas: QuotaSection = Field(default_factory=QuotaSection)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_RE.fullmatch(value):
            raise ValueError(f"a tenant's name is {NAME_RULE}")
        return value

    def token_files(self) -> dict[str, str]:
        """Each role's token file, by role (runtime/security.py's TokenAuth.from_config)."""
        return {"generate": self.generate_tokens_file, "publish": self.publish_tokens_file}


def check_tenants(tenants: list[TenantSection], auth_enabled: bool) -> list[TenantSection]:
    """Names unique, each tenant with a token file, and auth on (a tenant is known by its token only)."""
    names = [t.name for t in tenants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tenant names must be unique; {', '.join(twice)} appear more than once")
    bare = [t.name for t in tenants if not any(t.token_files().values())]
    if bare:
        raise ValueError(
            f"tenants {', '.join(bare)} have no token file: set generate_tokens_file or publish_tokens_file"
        )
    if tenants and not auth_enabled:
        raise ValueError(
            "tenants need auth on: set auth.admin_tokens_file (the fleet's operators) and each tenant's token files"
        )
    return tenants


@dataclass(frozen=True)
class Scope:
    """The names one caller sees: a tenant's (tenant set) or the fleet's (every name as held)."""

    tenant: str = ""

    @property
    def label(self) -> str:
        """Its `tenant` label in metrics and audit lines."""
        return self.tenant or FLEET

    def own(self, name: str) -> str:
        """The fleet's name of the caller's own adapter `name` (writes, and reads of its own);
        INVALID_ARGUMENT for a name a tenant may not give (':' included)."""
        if not self.tenant or not name:
            return name
        if not NAME_RE.fullmatch(name):
            raise InvalidArgument(
                f"adapter name {clip(name)} is invalid: use {NAME_RULE}", reason=Reason.BAD_ADAPTER_NAME
            )
        return f"{self.tenant}{TENANT_SEPARATOR}{name}"

    def read(self, name: str, known: Callable[[str], bool]) -> str:
        """The fleet's name a read of `name` means: the caller's own once `known` says the fleet
        has it, else the shared `name` if the fleet has that, else its own (not found there)."""
        qualified = self.own(name)
        if qualified == name or known(qualified) or not known(name):
            return qualified
        return name

    def shown(self, held: str) -> str | None:
        """A name the fleet holds as this caller sees it; None for another tenant's."""
        if not self.tenant:
            return held
        tenant, sep, name = held.partition(TENANT_SEPARATOR)
        if not sep:
            return held  # a shared adapter
        return name if tenant == self.tenant else None

    def scrub(self, text: str) -> str:
        """A sentence in a tenant's own words, whoever wrote it (the proxy, a replica relayed): its
        own names unqualified, and every other `A:B` (another tenant's name, a replica's HOST:PORT)
        replaced by HIDDEN, so nothing a replica puts in a sentence names what the tenant may not see."""
        if not self.tenant:
            return text
        return _QUALIFIED.sub(lambda m: m["name"] if m["tenant"] and m["tenant"] == self.tenant else HIDDEN, text)


def audit(
    counter: Any,
    scope: Scope,
    role: str,
    action: str,
    name: str,
    version: int | list[int],
    refused: RollwireError | None,
) -> None:
    """One publication's audit line and count: who (the caller's tenant and role) did `action`
    to which adapter (`name` as the fleet holds it, and as the caller named it) and version,
    and how it ended. `counter` is the proxy's tenant_publishes_total."""
    outcome = "ok" if refused is None else "refused"
    counter.labels(scope.label, action, outcome).inc()
    fields = {"code": refused.code.name, "reason": refused.reason} if refused is not None else {}
    shown = scope.shown(name)
    log.info(
        "adapter_audit",
        tenant=scope.label,
        role=role,
        action=action,
        adapter=shown if shown is not None else name,
        internal=name,
        version=version,
        outcome=outcome,
        **fields,
    )
