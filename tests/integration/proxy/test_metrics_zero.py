"""Counters that dashboards rate exist at 0 before their first event (Prometheus' advice: a
series that first appears at 1 has no rate, so the first retry or failure is invisible).

A fresh stack (one replica, one proxy that knows a peer) is scraped over HTTP, as Prometheus
does, before any request; the learner's registry is served on its own port and scraped too.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.processes import free_port, start_generators, start_service, stop_all, wait_routable

from rollwire.common.retries import CLIENT_CAUSED

LINE = re.compile(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-z_]+)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a Prometheus text exposition: (name, labels) -> value."""
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[(m.group(1), frozenset(LABEL.findall(m.group(2) or "")))] = float(m.group(3))
    return out


def value(scraped: dict, name: str, **labels: str) -> float | None:
    """The sample's value, or None when the series does not exist."""
    return scraped.get((name, frozenset(labels.items())))


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    workdir: Path = tmp_path_factory.mktemp("metrics-zero")
    (replica,) = start_generators(tiny_model, workdir, ["z1"])
    peer = f"127.0.0.1:{free_port()}"  # a peer proxy that is down: its series exist anyway
    args = ["proxy", "--port", "0", "--metrics-port", "0", "--generator", replica.target, "--set", f'peers=["{peer}"]']
    proxy = start_service(args, workdir, "zero-proxy")
    wait_routable(proxy, [replica])
    yield replica, proxy, peer
    stop_all([proxy, replica])


def test_a_fresh_proxy_exports_its_rated_counters_at_zero(stack):
    replica, proxy, peer = stack
    m = samples(proxy.metrics())
    r = replica.target
    for name in ("retries", "restarts", "resumes", "ejections", "catchup_pushes", "push_heals"):
        assert value(m, f"rollwire_proxy_{name}_total", replica=r) == 0, name
    for cause in ("off", "unsupported", "refused", "limits"):
        assert value(m, "rollwire_proxy_restart_causes_total", cause=cause) == 0, cause
    for code in ("OK", "UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL"):
        assert value(m, "rollwire_proxy_replica_attempts_total", replica=r, code=code) == 0, code
    for code in ("OK", "UNAVAILABLE", "INVALID_ARGUMENT", "FAILED_PRECONDITION"):
        assert value(m, "rollwire_proxy_replica_pushes_total", replica=r, code=code) == 0, code
    for code in grpc.StatusCode:
        assert value(m, "rollwire_proxy_requests_total", policy="least-loaded", code=code.name) == 0, code
    for code in CLIENT_CAUSED:
        assert value(m, "rollwire_proxy_client_errors_total", code=code.name) == 0, code
    for limit in ("in_flight", "queued_tokens", "slow_reader"):
        assert value(m, "rollwire_proxy_client_limited_total", limit=limit) == 0, limit
    for code in ("OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"):
        assert value(m, "rollwire_proxy_peer_pushes_total", peer=peer, code=code) == 0, code
    assert value(m, "rollwire_proxy_peer_synced", peer=peer) == 0
    assert value(m, "rollwire_proxy_in_flight_requests", replica=r) == 0
    assert value(m, "rollwire_proxy_replica_healthy", replica=r) == 1


def test_a_fresh_replica_exports_its_rated_counters_at_zero(stack):
    replica, _, _ = stack
    m = samples(replica.metrics())
    for code in grpc.StatusCode:
        assert value(m, "rollwire_generator_requests_total", code=code.name) == 0, code
        assert value(m, "rollwire_generator_adapter_pushes_total", code=code.name) == 0, code
    for kind in ("prompt", "completion"):
        assert value(m, "rollwire_generator_tokens_total", kind=kind) == 0, kind


def test_the_learner_exports_its_rated_counters_at_zero():
    from rollwire.learner.run.metrics import DROP_REASONS, PUSH_OUTCOMES, LearnerMetrics

    metrics = LearnerMetrics()
    metrics.know_rewards(["exact_match", "format"])
    port = metrics.serve("127.0.0.1", 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        m = samples(reply.read().decode())
    for reason in DROP_REASONS:
        assert value(m, "rollwire_learner_groups_dropped_total", reason=reason) == 0, reason
    for outcome in PUSH_OUTCOMES:
        assert value(m, "rollwire_learner_pushes_total", outcome=outcome) == 0, outcome
    for outcome in ("requested", "trained"):
        assert value(m, "rollwire_learner_groups_total", outcome=outcome) == 0, outcome
    for reward in ("exact_match", "format"):
        assert value(m, "rollwire_learner_reward_errors_total", reward=reward) == 0, reward


def test_a_replica_that_leaves_takes_its_series_along():
    """The counterpart: zeros exist for known replicas only, not for ones that left."""
    from rollwire.proxy.metrics import ProxyMetrics

    metrics = ProxyMetrics("round-robin")
    metrics.know_replica("10.0.0.9:1")
    metrics.forget_replica("10.0.0.9:1")
    text = "\n".join(
        f"{s.name} {s.value}"
        for family in metrics.registry.collect()
        for s in family.samples
        if s.labels.get("replica")
    )
    assert text == ""


pytestmark = pytest.mark.integration  # starts processes: not in make test-fast
