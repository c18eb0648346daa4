"""What a caller reads, rewritten in one place (audit 2026-12-07 S8, S13; proxy/tenants.py
`Scope.scrub`, routing/passthrough.py `PassThrough.scoped`, metrics.py `confirmed`): a tenant's
sentence names no other tenant's adapter nor a replica's address, a relayed status carries the
same sentence in its google.rpc.Status detail, and the metrics name no tenant's adapter.
The same over real processes: tests/integration/proxy/test_tenants.py (its hostile test)."""

from __future__ import annotations

import grpc
from google.rpc import status_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwire.common.errors import DETAILS_KEY, NotFound, to_status
from rollwire.common.manifest import NAME_RE
from rollwire.proxy.metrics import ProxyMetrics
from rollwire.proxy.routing.passthrough import PassThrough
from rollwire.proxy.tenants import HIDDEN, Scope

names = st.from_regex(NAME_RE, fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(own=names, other=names, adapter=names, mine=names, words=st.text(max_size=40))
def test_a_tenants_sentence_keeps_its_own_names_and_hides_every_other_qualified_one(own, other, adapter, mine, words):
    text = f"no adapter {own}:{mine} here (loaded: {other}:{adapter}, shared) on 10.0.0.5:50051 [::1]:7 {words}"
    shown = Scope(own).scrub(text)
    assert f"adapter {mine} here" in shown
    if other != own:
        assert f"{other}:{adapter}" not in shown and f"(loaded: {HIDDEN}, shared)" in shown
    assert "10.0.0.5:50051" not in shown and "[::1]:7" not in shown
    fingerprint = "base model sha256:e2e30175f617e3d3 (blake3:0a1b)"
    assert Scope(own).scrub(fingerprint) == fingerprint  # a digest is no name: the sentence stays actionable
    assert Scope().scrub(text) == text  # the fleet's tokens see every name as held


class _Relayed(grpc.aio.AioRpcError):
    def __init__(self, status: grpc.Status) -> None:
        super().__init__(status.code, None, grpc.aio.Metadata(*status.trailing_metadata), status.details)


def test_a_relayed_status_is_rewritten_with_its_detail_so_the_two_agree():
    """Before, only the sentence was scrubbed: the trailer's Status kept every tenant's names, and
    it no longer matched the sentence, so a client's reason was lost with it."""
    sentence = "no adapter named 'team-b:x' is loaded on this replica (loaded: team-a:secret, team-b:y)"
    relay = PassThrough(_Relayed(to_status(NotFound(sentence, reason="ADAPTER_NOT_FOUND"))))
    relay.scoped(Scope("team-b").scrub)
    assert relay.details == f"no adapter named 'x' is loaded on this replica (loaded: {HIDDEN}, y)"
    ((key, value),) = relay.trailers
    status = status_pb2.Status.FromString(value)
    assert key == DETAILS_KEY and status.message == relay.details and "secret" not in value.decode(errors="replace")
    assert relay.error().reason == "ADAPTER_NOT_FOUND"  # the details still parse: the reason survives


def test_the_version_gauge_names_no_tenants_adapter_and_is_one_series_per_tenant():
    metrics = ProxyMetrics("least-loaded", tenants=["team-a"])
    held = {"team-a:secret-project": [3], "team-a:other": [1, 7], "shared": [2]}
    for name in held:
        metrics.confirmed("r:1", held, name)
    text = metrics.registry.get_sample_value
    assert text("rollwire_proxy_replica_adapter_version", {"replica": "r:1", "adapter": "team-a:*"}) == 7
    assert text("rollwire_proxy_replica_adapter_version", {"replica": "r:1", "adapter": "shared"}) == 2
    labels = {
        s.labels["adapter"]
        for m in metrics.registry.collect()
        if m.name == "rollwire_proxy_replica_adapter_version"
        for s in m.samples
    }
    assert labels == {"team-a:*", "shared"}
