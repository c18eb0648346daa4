"""Writes ops/grafana/dashboards/rollwire.json, the provisioning-ready rollwire dashboard.

The panels are listed once, here; the JSON is generated from them and committed. Every
query names only metrics the services export (docs/metrics.md), and each one returns a
series on a running stack — tests/e2e/test_dashboard.py checks both against a real Prometheus.
Queries on counters that may not have moved yet end in `or vector(0)`.

Run: .venv/bin/python ops/grafana/build_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "rollwire.json"
W = "$__rate_interval"


def q(p: float, metric: str, by: str = "le") -> str:
    return f"histogram_quantile({p}, sum by ({by}) (rate({metric}_bucket[{W}])))"


# (row, title, unit, [(expr, legend)])
PANELS = [
    (
        "Overview",
        "Groups per second (through the proxy)",
        "reqps",
        [(f'sum(rate(rollwire_proxy_requests_total{{code="OK"}}[{W}])) or vector(0)', "groups/s")],
    ),
    (
        "Overview",
        "Tokens per second (all generators)",
        "short",
        [
            (f'sum(rate(rollwire_generator_tokens_total{{kind="completion"}}[{W}]))', "completion tokens/s"),
            (f'sum(rate(rollwire_generator_tokens_total{{kind="prompt"}}[{W}]))', "prompt tokens/s"),
        ],
    ),
    (
        "Overview",
        "Requests by status code",
        "reqps",
        [
            (f"sum by (code) (rate(rollwire_proxy_requests_total[{W}]))", "proxy {{code}}"),
            (f"sum by (code) (rate(rollwire_generator_requests_total[{W}]))", "generators {{code}}"),
        ],
    ),
    (
        "Proxy",
        "Request latency (p50, p99)",
        "s",
        [
            (q(0.5, "rollwire_proxy_request_duration_seconds"), "p50"),
            (q(0.99, "rollwire_proxy_request_duration_seconds"), "p99"),
        ],
    ),
    (
        "Proxy",
        "Queue depth and wait",
        "short",
        [
            ("rollwire_proxy_queue_depth", "queued groups"),
            (q(0.99, "rollwire_proxy_queue_wait_seconds"), "p99 wait (s)"),
        ],
    ),
    (
        "Proxy",
        "In flight per replica",
        "short",
        [("sum by (replica) (rollwire_proxy_in_flight_requests)", "{{replica}}")],
    ),
    (
        "Proxy",
        "Replica health (1 = healthy, routable)",
        "short",
        [
            ("rollwire_proxy_replica_healthy", "healthy {{replica}}"),
            ("rollwire_proxy_replica_routable", "routable {{replica}}"),
        ],
    ),
    (
        "Proxy",
        "Adapter version per replica",
        "none",
        [("max by (replica, adapter) (rollwire_proxy_replica_adapter_version)", "{{replica}} {{adapter}}")],
    ),
    (
        "Proxy",
        "Push fan-out latency (p50, p90)",
        "s",
        [
            (q(0.5, "rollwire_proxy_push_fanout_duration_seconds"), "p50"),
            (q(0.9, "rollwire_proxy_push_fanout_duration_seconds"), "p90"),
        ],
    ),
    (
        "Proxy",
        "Retries, restarts, ejections, refusals",
        "short",
        [
            (f"sum(rate(rollwire_proxy_retries_total[{W}])) or vector(0)", "retries/s"),
            (f"sum(rate(rollwire_proxy_restarts_total[{W}])) or vector(0)", "restarts/s"),
            (f"sum(increase(rollwire_proxy_ejections_total[{W}])) or vector(0)", "ejections"),
            (f"sum(rate(rollwire_proxy_refused_total[{W}])) or vector(0)", "refused/s"),
        ],
    ),
    (
        "Proxy",
        "Failover by replica (retries, restarts, ejections)",
        "short",
        [  # each replica's series exist at 0 from the moment it is known, so rate() sees the first one
            (f"sum by (replica) (rate(rollwire_proxy_retries_total[{W}]))", "retries/s {{replica}}"),
            (f"sum by (replica) (rate(rollwire_proxy_restarts_total[{W}]))", "restarts/s {{replica}}"),
            (f"sum by (replica) (increase(rollwire_proxy_ejections_total[{W}]))", "ejections {{replica}}"),
        ],
    ),
    (
        "Proxy",
        "Versions re-sent to a replica (catch-up, heal)",
        "short",
        [
            (f"sum by (replica) (increase(rollwire_proxy_catchup_pushes_total[{W}]))", "catch-up {{replica}}"),
            (f"sum by (replica) (increase(rollwire_proxy_push_heals_total[{W}]))", "heal {{replica}}"),
        ],
    ),
    (
        "Proxy",
        "Peer proxies: replication and peers behind",
        "short",
        [  # a proxy without peers has no peer series: these read 0 then
            (
                f"sum by (peer, code) (rate(rollwire_proxy_peer_pushes_total[{W}])) or vector(0)",
                "sent/s {{peer}} {{code}}",
            ),
            ("count(rollwire_proxy_peer_synced == 0) or vector(0)", "peers behind"),
        ],
    ),
    (
        "Generators",
        "Time to first token (p50, p99)",
        "s",
        [
            (q(0.5, "rollwire_generator_time_to_first_token_seconds"), "p50"),
            (q(0.99, "rollwire_generator_time_to_first_token_seconds"), "p99"),
        ],
    ),
    (
        "Generators",
        "Request latency (p50, p99)",
        "s",
        [
            (q(0.5, "rollwire_generator_request_duration_seconds"), "p50"),
            (q(0.99, "rollwire_generator_request_duration_seconds"), "p99"),
        ],
    ),
    (
        "Generators",
        "Queue depth and in flight per replica",
        "short",
        [
            ("sum by (replica) (rollwire_generator_queue_depth)", "queued {{replica}}"),
            ("sum by (replica) (rollwire_generator_in_flight_requests)", "in flight {{replica}}"),
        ],
    ),
    (
        "Generators",
        "Sequences per forward pass",
        "short",
        [
            (
                f"sum(rate(rollwire_generator_batch_rows_sum[{W}])) / sum(rate(rollwire_generator_batch_rows_count[{W}]))",
                "mean batch rows",
            )
        ],
    ),
    (
        "Generators",
        "Adapter version per replica",
        "none",
        [("max by (replica, adapter) (rollwire_generator_adapter_version)", "{{replica}} {{adapter}}")],
    ),
    (
        "Generators",
        "Adapter push latency (p50, p90)",
        "s",
        [
            (q(0.5, "rollwire_generator_adapter_push_duration_seconds"), "p50"),
            (q(0.9, "rollwire_generator_adapter_push_duration_seconds"), "p90"),
        ],
    ),
    (
        "Generators",
        "Tokens served by staleness (versions behind the newest)",
        "short",
        [(f"sum by (behind) (rate(rollwire_generator_served_tokens_total[{W}]))", "{{behind}} behind")],
    ),
    (
        "Tenants",
        "Tokens per second by tenant (docs/deploy.md, Tenants)",
        "short",
        [(f"sum by (tenant) (rate(rollwire_proxy_tenant_tokens_total[{W}]))", "{{tenant}}")],
    ),
    (
        "Tenants",
        "Requests by tenant and status code",
        "reqps",
        [(f"sum by (tenant, code) (rate(rollwire_proxy_tenant_requests_total[{W}]))", "{{tenant}} {{code}}")],
    ),
    (
        "Tenants",
        "Adapter publications by tenant (push, load, upload, unload)",
        "short",
        [
            (
                f"sum by (tenant, action, outcome) (increase(rollwire_proxy_tenant_publishes_total[{W}]))",
                "{{tenant}} {{action}} {{outcome}}",
            )
        ],
    ),
    (
        "HTTP door",
        "HTTP requests by route and status (docs/http.md)",
        "reqps",
        [(f"sum by (route, code) (rate(rollwire_proxy_http_requests_total[{W}]))", "{{route}} {{code}}")],
    ),
    (
        "HTTP door",
        "HTTP latency p99 by route",
        "s",
        [(q(0.99, "rollwire_proxy_http_request_duration_seconds", "le, route"), "{{route}}")],
    ),
    (
        "HTTP door",
        "HTTP refusals (4xx) and failures (5xx)",
        "reqps",
        [
            (f'sum(rate(rollwire_proxy_http_requests_total{{code=~"4.."}}[{W}])) or vector(0)', "4xx"),
            (f'sum(rate(rollwire_proxy_http_requests_total{{code=~"5.."}}[{W}])) or vector(0)', "5xx"),
        ],
    ),
    (
        "Proofs",
        "Proof outcomes per replica (re-checks against probes)",
        "short",
        [
            (
                f"sum by (replica, outcome) (increase(rollwire_proxy_adapter_proofs_total[{W}])) or vector(0)",
                "{{replica}} {{outcome}}",
            )
        ],
    ),
    (
        "Proofs",
        "Largest logprob gap per replica and adapter (its version: adapter_proof_version)",
        "short",
        [("max by (replica, adapter) (rollwire_proxy_adapter_proof_gap) or vector(0)", "{{replica}} {{adapter}}")],
    ),
    (
        "Proofs",
        "Versions refused at commit by their probe (replicas)",
        "short",
        [
            (
                f'sum by (instance) (increase(rollwire_generator_adapter_proofs_total{{outcome=~"failed|disputed"}}[{W}]))'
                " or vector(0)",
                "{{instance}}",
            )
        ],
    ),
    (
        "Learner",
        "Reward (mean and std of the last step)",
        "short",
        [("rollwire_learner_reward_mean", "mean"), ("rollwire_learner_reward_std", "std")],
    ),
    (
        "Learner",
        "Accuracy (rollouts and held-out)",
        "percentunit",
        [("rollwire_learner_accuracy", "rollouts"), ("rollwire_learner_eval_accuracy", "held-out (greedy)")],
    ),
    (
        "Learner",
        "Staleness of trained groups (versions)",
        "short",
        [
            (q(0.5, "rollwire_learner_staleness"), "p50"),
            (q(0.9, "rollwire_learner_staleness"), "p90"),
            (
                f"sum(rate(rollwire_learner_staleness_sum[{W}])) / sum(rate(rollwire_learner_staleness_count[{W}]))",
                "mean",
            ),
        ],
    ),
    (
        "Learner",
        "Step time by phase",
        "s",
        [
            (
                f"sum by (phase) (rate(rollwire_learner_step_phase_seconds_sum[{W}])) / "
                f"sum by (phase) (rate(rollwire_learner_step_phase_seconds_count[{W}]))",
                "{{phase}}",
            )
        ],
    ),
    (
        "Learner",
        "Policy version: trained vs served",
        "none",
        [("rollwire_learner_policy_version", "trained"), ("rollwire_learner_served_version", "served")],
    ),
    (
        "Learner",
        "Adapter push latency (p50, p90)",
        "s",
        [(q(0.5, "rollwire_learner_push_seconds"), "p50"), (q(0.9, "rollwire_learner_push_seconds"), "p90")],
    ),
    ("Learner", "Importance ratio pi/mu (last step)", "short", [("rollwire_learner_importance_ratio", "{{stat}}")]),
    ("Learner", "Trained tokens per second", "short", [("rollwire_learner_tokens_per_second", "tokens/s")]),
    (
        "Learner",
        "Groups dropped by reason",
        "short",
        [(f"sum by (reason) (increase(rollwire_learner_groups_dropped_total[{W}])) or vector(0)", "{{reason}}")],
    ),
    (
        "Learner",
        "Groups restarted on another replica (failover)",
        "short",
        [(f"sum(rate(rollwire_learner_group_restarts_total[{W}])) or vector(0)", "restarts/s")],
    ),
]


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int) -> dict:
    return {
        "id": i,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "rollwire-prometheus"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + k),
                "expr": expr,
                "legendFormat": legend,
                "datasource": {"uid": "rollwire-prometheus"},
            }
            for k, (expr, legend) in enumerate(targets)
        ],
    }


def build() -> dict:
    panels, y, col, row, pid = [], 0, 0, None, 1
    for row_title, title, unit, targets in PANELS:
        if row_title != row:
            row, y, col = row_title, y + (8 if col else 0), 0
            panels.append(
                {
                    "id": pid,
                    "type": "row",
                    "title": row,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                }
            )
            pid, y = pid + 1, y + 1
        elif col == 3:
            y, col = y + 8, 0
        panels.append(panel(pid, title, unit, targets, col * 8, y))
        pid, col = pid + 1, col + 1
    return {
        "uid": "rollwire",
        "title": "rollwire",
        "tags": ["rollwire", "grpo"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": []},
        "panels": panels,
    }


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
