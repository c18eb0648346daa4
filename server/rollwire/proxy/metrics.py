"""Prometheus metrics of the routing proxy, prefixed `rollwire_proxy_`.

Labels come from fixed sets only: the replica address (members of the replica set; their
series are removed when a replica leaves), peer proxy addresses (from the config), the policy
name, gRPC code names, adapter names, per-client limit names, tenant names (the config's
tenants plus tenants.FLEET for the fleet's own tokens: `tenant_*` families). Never request ids or client
identities (unbounded). Counters that dashboards rate start at 0 for every label value known
in advance (codes, limits, each replica as it joins, each peer).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from prometheus_client import CollectorRegistry, Histogram

from rollwire.common.manifest import TENANT_SEPARATOR
from rollwire.common.probe import OUTCOMES as PROOF_OUTCOMES
from rollwire.common.retries import CLIENT_CAUSED
from rollwire.proxy.policies.prefix import OUTCOMES as PREFIX_OUTCOMES
from rollwire.proxy.tenants import FLEET
from rollwire.runtime.metrics import MetricFactory
from rollwire.serving.sessions import SessionMetrics

RESTART_CAUSES = ("off", "unsupported", "refused", "limits")
"""Why a group was restarted instead of resumed (routing/failover.py, routing/resume.py):
routing.resume is off; the replica's engine cannot continue samples (it refused with
RESUME_UNSUPPORTED, or ignored `resume`: its `started` did not count them); the replica refused
the continuation (BAD_RESUME); a sample was sent as many tokens as its max_new_tokens and did
not end."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
PREFIX = "rollwire_proxy_"
CODES = tuple(code.name for code in grpc.StatusCode)
"""Every gRPC code: the proxy's request counter starts with each at 0."""
CLIENT_CODES = tuple(sorted(code.name for code in CLIENT_CAUSED))
"""The codes a client can cause (retries.CLIENT_CAUSED): client_errors_total starts with each."""
CLIENT_LIMITS = ("in_flight", "queued_tokens", "slow_reader", "slow_upload")
PUBLISH_ACTIONS = ("push", "load", "upload", "unload")
"""What a publication did (tenant_publishes_total): a gRPC push, an HTTP load by path, an upload, an unload."""
MEMBER_REFUSALS = ("unproven", "canary", "floor")
"""Why a would-be member was kept out: its address unproven at registration, a failed canary, limits under the floor."""
SESSION_ROUTES = ("first", "sticky", "overloaded", "draining", "down", "version", "failed")
"""Where a session turn went: its first turn; the session's replica (sticky); another one because that replica was
overloaded, draining, down (ejected, unhealthy or gone), lacked the version, or failed the turn."""
HTTP_ROUTES = (
    "/health",
    "/server_info",
    "/weight_info",
    "/v1/models",
    "/v1/models/{id}",
    "/version",
    "/tokenize",
    "/detokenize",
    "/pause",
    "/resume",
    "/is_paused",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/v1/upload_lora_adapter",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/tokens",
    "/inference/v1/generate",
)
"""Every route the HTTP front door serves (http/app.py declares each): the label set of
rollwire_proxy_http_requests_total."""
REPLICA_CODES = (
    "OK",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "INVALID_ARGUMENT",
    "UNAVAILABLE",
    "INTERNAL",
)
"""Codes each replica's attempt and push counters start with (the outcomes that happen; the rare
rest appear when they first occur, so a replica costs 16 series here, not 34)."""
PEER_CODES = ("OK", "DEADLINE_EXCEEDED", "FAILED_PRECONDITION", "UNAVAILABLE")


def _latency(make: MetricFactory, name: str, text: str, labels: Sequence[str] = ()) -> Histogram:
    return make.histogram(name, text, labels, buckets=LATENCY_BUCKETS)


class ProxyMetrics:
    def __init__(self, policy: str, registry: CollectorRegistry | None = None, tenants: Sequence[str] = ()) -> None:
        self.registry = registry or CollectorRegistry()
        self.policy = policy
        make = MetricFactory(PREFIX, self.registry)
        # counters a dashboard rates exist at 0 from the start (Prometheus' advice), so rate()
        # sees their first event instead of a series appearing at 1
        self._requests(make, policy)
        self._routes(make)
        self._replica_families(make)
        self._proof_families(make)
        self._push_families(make)
        self._peer_families(make)
        self._tenant_families(make, (FLEET, *tenants))

    def _tenant_families(self, make: MetricFactory, tenants: Sequence[str]) -> None:
        """Per tenant (proxy/tenants.py): its requests, tokens and publications."""
        counter = make.counter
        self.tenant_requests = counter(
            "tenant_requests_total",
            "Generation requests (either door) by tenant (_fleet: the fleet's own tokens) and final gRPC code.",
            ["tenant", "code"],
        )
        self.tenant_tokens = counter(
            "tenant_tokens_total", "Tokens generated for each tenant's requests (either door).", ["tenant"]
        )
        self.tenant_publishes = counter(
            "tenant_publishes_total",
            "Adapter publications by tenant, action (push, load, upload, unload) and outcome (ok, refused).",
            ["tenant", "action", "outcome"],
        )
        for tenant in tenants:
            self.tenant_tokens.labels(tenant)
            for code in ("OK", "RESOURCE_EXHAUSTED"):
                self.tenant_requests.labels(tenant, code)
            for action in PUBLISH_ACTIONS:
                self.tenant_publishes.labels(tenant, action, "ok")

    def _requests(self, make: MetricFactory, policy: str) -> None:
        """Generate requests: outcomes, latency, queueing, refusals, per-client limits."""
        counter, gauge = make.counter, make.gauge
        self.requests = counter(
            "requests_total",
            "Generation requests (gRPC Generate, HTTP completions and chat) by routing policy and final gRPC code.",
            ["policy", "code"],
        )
        self.latency = _latency(
            make, "request_duration_seconds", "From request arrival to its last message.", ["policy"]
        )
        self.queue_wait = _latency(make, "queue_wait_seconds", "Time a request waited for a replica slot.")
        self.queue_depth = gauge("queue_depth", "Requests waiting for a replica slot.")
        self.refused = counter("refused_total", "Requests refused by backpressure (RESOURCE_EXHAUSTED).")
        self.client_errors = counter(
            "client_errors_total",
            "Generation requests (either door) ended by a status the client caused (relayed refusals, per-client "
            "limits, refusals at the HTTP door's edge), by code.",
            ["code"],
        )
        self.client_limited = counter(
            "client_limited_total",
            "Requests refused or cut off by a per-client limit: in_flight, queued_tokens, slow_reader or slow_upload.",
            ["limit"],
        )
        self.clients = gauge("clients", "Client identities with requests open or queued at the proxy.")
        self.score_requests = counter("score_requests_total", "Score requests by final gRPC code.", ["code"])
        self.scored_tokens = counter("scored_tokens_total", "Continuation tokens scored by Score requests answered OK.")
        self.score_latency = _latency(make, "score_duration_seconds", "From Score request arrival to its answer.")
        for code in CODES:
            self.requests.labels(policy, code)
            self.score_requests.labels(code)
        for code in CLIENT_CODES:
            self.client_errors.labels(code)
        for limit in CLIENT_LIMITS:
            self.client_limited.labels(limit)

    def _routes(self, make: MetricFactory) -> None:
        """Where sessions and prefixes sent work; the HTTP front door."""
        counter = make.counter
        self.sessions = SessionMetrics(make)
        self.session_routes = counter(
            "session_routes_total",
            "Session turns by where they ran: first, sticky (the session's replica), or moved because it was "
            "overloaded, draining, down, lacked the version, or failed the turn.",
            ["outcome"],
        )
        self.coalesced = counter(
            "coalesced_requests_total",
            "Single-sample requests served as part of a group with others for the same prompt (routing.coalesce_window_ms).",
        )
        self.prefix_routes = counter(
            "prefix_routes_total",
            "Groups placed by the prefix policy: hit (where their longest known prefix went), miss (no known prefix), "
            "overloaded (the prefix's replica was too busy).",
            ["outcome"],
        )
        for outcome in SESSION_ROUTES:
            self.session_routes.labels(outcome)
        for outcome in PREFIX_OUTCOMES:
            self.prefix_routes.labels(outcome)
        self.http_requests = counter(
            "http_requests_total",
            "HTTP front door requests by route and HTTP status (docs/http.md).",
            ["route", "code"],
        )
        self.http_latency = _latency(
            make,
            "http_request_duration_seconds",
            "HTTP front door: from request arrival to its response's end.",
            ["route"],
        )
        self.http_paused = counter(
            "http_paused_requests_total",
            "HTTP front door generation requests held at the door by their tenant's /pause until /resume (http/pause.py).",
        )
        self.http_paced = counter(
            "http_paced_requests_total",
            "HTTP front door generation requests held past their lineage's samples per version (http/pacing.py).",
        )
        for route in (*HTTP_ROUTES, "other"):
            self.http_requests.labels(route, "200")
            self.http_latency.labels(route)

    def _replica_families(self, make: MetricFactory) -> None:
        """Each replica's attempts, state and versions."""
        counter, gauge = make.counter, make.gauge
        self.replicas = gauge("replicas", "Replicas known to the proxy.")
        self.attempts = counter(
            "replica_attempts_total", "Attempts sent to each replica, by outcome code.", ["replica", "code"]
        )
        self.retries = counter(
            "retries_total",
            "Attempts that failed before the first token and were redone invisibly, by replica.",
            ["replica"],
        )
        self.restarts = counter(
            "restarts_total", "Groups restarted elsewhere after failing mid-stream, by replica.", ["replica"]
        )
        self.resumes = counter(
            "resumes_total",
            "Groups continued on another replica from their tokens so far after failing mid-stream, by the replica "
            "that failed.",
            ["replica"],
        )
        self.restart_causes = counter(
            "restart_causes_total",
            "Groups restarted instead of resumed, by cause: off (routing.resume), unsupported (an engine that cannot "
            "continue samples), refused (a continuation the replica refused), limits.",
            ["cause"],
        )
        for cause in RESTART_CAUSES:
            self.restart_causes.labels(cause)
        self.ejections = counter("ejections_total", "Circuit-breaker ejections of each replica.", ["replica"])
        self.in_flight = gauge("in_flight_requests", "Groups the proxy runs on each replica now.", ["replica"])
        self.healthy = gauge("replica_healthy", "1 when the replica passes health checks.", ["replica"])
        self.routable = gauge("replica_routable", "1 when the replica takes new work.", ["replica"])
        self.foreign = gauge(
            "replica_foreign_base_model",
            "1 while the replica serves another base model than the fleet's and is refused membership.",
            ["replica"],
        )
        self.versions = gauge(
            "replica_adapter_version",
            "Newest adapter version confirmed; a tenant's adapters as one series, TENANT:* (their newest).",
            ["replica", "adapter"],
        )
        self.member_refusals = counter(
            "member_refusals_total",
            "Would-be members kept out: unproven address at registration, failed canary, limits under the floor.",
            ["why"],
        )
        for why in MEMBER_REFUSALS:
            self.member_refusals.labels(why)
        self.conflicts = gauge(
            "replica_digest_conflicts",
            "Adapter versions the replica holds with other bytes than the spool's under the same name and number.",
            ["replica"],
        )

    def _push_families(self, make: MetricFactory) -> None:
        """Adapter pushes: fan-out, catch-up, quarantine, heals."""
        counter = make.counter
        self.pushes = counter(
            "replica_pushes_total", "Adapter pushes (fan-out and catch-up) by code.", ["replica", "code"]
        )
        self.catchup_pushes = counter(
            "catchup_pushes_total", "Versions pushed to a replica to bring it up to date.", ["replica"]
        )
        self.catchup_gave_up = counter(
            "catchup_gave_up_total",
            "Spooled versions catch-up stopped pushing to a replica after health.catch_up_attempts failures for now.",
            ["replica"],
        )
        self.quarantined = counter(
            "quarantined_versions_total", "Spooled adapter versions every replica refused, moved out of the spool."
        )
        self.fanout_latency = _latency(
            make,
            "push_fanout_duration_seconds",
            "From a push's manifest to its version committed on every replica that staged it (relay, heal, commit).",
        )
        self.publications_pending = make.gauge(
            "publications_pending",
            'Publications answered at "spooled" (the HTTP door\'s loads) whose relay and commit still run.',
        )
        self.publications_failed_after_answer = counter(
            "publications_failed_after_answer_total",
            'Publications answered at "spooled" that no replica committed: the version stays spooled and catch-up '
            "brings it to the replicas.",
        )
        self.push_heals = counter(
            "push_heals_total",
            "Replicas that got a pushed version again from the proxy because the relay tree did not deliver it.",
            ["replica"],
        )
        self.push_paths = counter(
            "push_path_total",
            "Push streams the proxy sent to replicas, by the path their bytes took (bulk or grpc) and why (connected, "
            "no_offer, refused, timeout, tls, unreachable).",
            ["path", "reason"],
        )

    def _peer_families(self, make: MetricFactory) -> None:
        """Peer proxies' spools."""
        counter, gauge = make.counter, make.gauge
        self.peer_pushes = counter(
            "peer_pushes_total",
            "Adapter versions sent to each peer proxy's spool (replication and catch-up), by code.",
            ["peer", "code"],
        )
        self.peer_synced = gauge(
            "peer_synced", "1 when the peer proxy is known to hold every version this proxy spools.", ["peer"]
        )
        self.peer_conflicts = counter(
            "peer_version_conflicts_total",
            "Versions a peer proxy holds with another digest than this proxy's (two truths: a page, not a retry).",
            ["peer"],
        )
        self.peer_lineage_sends = counter(
            "peer_lineage_sends_total",
            "This proxy's lineage map and unloads sent to each peer proxy (on a change and in catch-up), by code.",
            ["peer", "code"],
        )
        self.lineage_changes_received = counter(
            "lineage_changes_received_total",
            "Names and versions of this proxy's lineage map a peer proxy's map changed (new lineages, unloads, loads).",
        )

    def _proof_families(self, make: MetricFactory) -> None:
        """Each replica's re-checks against adapter versions' probes (publish/proof.py)."""
        counter, gauge = make.counter, make.gauge
        self.proofs = counter(
            "adapter_proofs_total",
            "Re-checks of adapter versions on each replica against their probes (publish/proof.py), by outcome: passed, "
            "failed (a signed probe: the replica computes another policy and is not routed that version), disputed "
            "(an unsigned probe or another replica's numbers), unsupported (its engine cannot score).",
            ["replica", "outcome"],
        )
        self.proof_gap = gauge(
            "adapter_proof_gap",
            "Largest |logprob - reference| of the last re-check of each adapter's newest re-checked version on each "
            "replica (the version: adapter_proof_version); a tenant's adapters as one series, TENANT:* (their worst).",
            ["replica", "adapter"],
        )
        self.proof_version = gauge(
            "adapter_proof_version",
            "The version that adapter_proof_gap was measured on (a tenant's adapters: TENANT:*).",
            ["replica", "adapter"],
        )

    def know_replica(self, address: str) -> None:
        """Create a new replica's series at 0, so its first retry, restart, ejection or failed
        push is seen by rate() (a series that appears at 1 has no rate)."""
        for metric in (
            self.retries,
            self.restarts,
            self.resumes,
            self.ejections,
            self.catchup_pushes,
            self.catchup_gave_up,
            self.push_heals,
        ):
            metric.labels(address)
        for code in REPLICA_CODES:
            self.attempts.labels(address, code)
            self.pushes.labels(address, code)
        for outcome in PROOF_OUTCOMES:
            self.proofs.labels(address, outcome)
        self.in_flight.labels(address).set(0)

    def know_peer(self, peer: str) -> None:
        """Create a peer proxy's series at 0 (see know_replica)."""
        for code in PEER_CODES:
            self.peer_pushes.labels(peer, code)
            self.peer_lineage_sends.labels(peer, code)
        self.peer_synced.labels(peer).set(0)
        self.peer_conflicts.labels(peer)

    def confirmed(self, address: str, versions: dict[str, list[int]], name: str) -> None:
        """Set `replica_adapter_version` for `name` on the replica at `address`, which holds
        `versions`: a shared adapter under its own name, a tenant's (TENANT:NAME) as the one
        series TENANT:*, the newest of all its names there, so the series are bounded by the
        config, never by the names tenants invent, and name none of them (the port has no auth)."""
        tenant, sep, _ = name.partition(TENANT_SEPARATOR)
        if not sep:
            self.versions.labels(address, name).set(versions[name][-1] if versions.get(name) else 0)
            return
        prefix = tenant + TENANT_SEPARATOR
        newest = max((v[-1] for n, v in versions.items() if n.startswith(prefix) and v), default=0)
        self.versions.labels(address, prefix + "*").set(newest)

    def forget_replica(self, address: str) -> None:
        """Drop every series of a replica that left, so dashboards do not show ghosts."""
        for metric in (
            self.attempts,
            self.retries,
            self.restarts,
            self.resumes,
            self.ejections,
            self.in_flight,
            self.healthy,
            self.routable,
            self.foreign,
            self.conflicts,
            self.versions,
            self.pushes,
            self.catchup_pushes,
            self.catchup_gave_up,
            self.push_heals,
            self.proofs,
            self.proof_gap,
            self.proof_version,
        ):
            for labels in list(metric._metrics):  # prometheus_client keeps children by label tuple
                if labels and labels[0] == address:
                    metric.remove(*labels)
