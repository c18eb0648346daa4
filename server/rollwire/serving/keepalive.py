"""The `keepalive` config section of every server process: rollwire.common.keepalive's numbers,
typed and documented for `--set keepalive.time_s=...` (tests shorten them to see a partition
in seconds)."""

from __future__ import annotations

from pydantic import Field, model_validator

from rollwire.common.keepalive import DEFAULT, MIN_PING_INTERVAL_S, Keepalive
from rollwire.runtime.config import Section


class KeepaliveSection(Section):
    """gRPC keepalive of this process's server and of every channel it dials (docs/deploy.md)."""

    time_s: float = Field(
        default=DEFAULT.time_s,
        ge=MIN_PING_INTERVAL_S,
        le=3600,
        description="Ping a peer after this many seconds without receiving anything from it (at least "
        f"{MIN_PING_INTERVAL_S:g} s: servers refuse faster pings).",
    )
    timeout_s: float = Field(default=DEFAULT.timeout_s, ge=0.1, le=600)
    """Close a connection whose ping is unanswered after this many seconds: a silent peer is detected within time_s +
    timeout_s of its last byte."""

    @model_validator(mode="after")
    def _check(self) -> KeepaliveSection:
        self.keepalive()
        return self

    def keepalive(self) -> Keepalive:
        return Keepalive(self.time_s, self.timeout_s)
