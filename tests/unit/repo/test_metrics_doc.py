"""docs/metrics.md and the metrics the services register agree, both ways."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(rollwire_[a-z_]+)` \| (counter|gauge|histogram) \| (.*?) \| .+ \|$")


def registered() -> dict[str, tuple[str, tuple[str, ...]]]:
    from rollwire.generator.metrics import GeneratorMetrics
    from rollwire.learner.run.metrics import LearnerMetrics
    from rollwire.proxy.metrics import ProxyMetrics

    out = {}
    for metrics in (GeneratorMetrics(), ProxyMetrics("least-loaded"), LearnerMetrics()):
        for family in metrics.registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = {k for s in family.samples for k in s.labels if k != "le"}
            out[name] = (family.type, tuple(sorted(labels)))
    return out


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            labels = tuple(sorted(re.findall(r"`([a-z_]+)`", m.group(3))))
            out[m.group(1)] = (m.group(2), labels)
    return out


def test_every_registered_metric_is_documented_and_nothing_else():
    code, doc = registered(), documented()
    assert sorted(set(code) - set(doc)) == [], "registered but not in docs/metrics.md"
    assert sorted(set(doc) - set(code)) == [], "documented but not registered"
    for name, (kind, _) in code.items():
        assert doc[name][0] == kind, name


def test_documented_labels_match_the_code():
    from rollwire.generator.metrics import GeneratorMetrics
    from rollwire.learner.run.metrics import LearnerMetrics
    from rollwire.proxy.metrics import ProxyMetrics

    doc = documented()
    for metrics in (GeneratorMetrics(), ProxyMetrics("least-loaded"), LearnerMetrics()):
        for collector in list(metrics.registry._collector_to_names):
            name = collector._name + (
                "_total" if collector._type == "counter" and not collector._name.endswith("_total") else ""
            )
            assert doc[name][1] == tuple(sorted(collector._labelnames)), name


def test_names_follow_the_conventions():
    for name, (kind, labels) in documented().items():
        assert re.match(r"^rollwire_(generator|proxy|learner)_", name), name
        assert (kind == "counter") == name.endswith("_total"), name
        assert not {"request_id", "id"} & set(labels), name


def test_dashboard_queries_only_documented_metrics():
    import json

    dashboard = json.loads((DOC.parents[1] / "ops" / "grafana" / "dashboards" / "rollwire.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"rollwire_[a-z_]+", e)}
    doc = documented()
    assert names and sorted(n for n in names if n not in doc) == []
