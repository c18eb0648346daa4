"""The Grafana dashboard against a real Prometheus scraping a running local stack.

A proxy, two generator replicas and a short learner run; Prometheus (Debian's package,
installed by `make test`'s system-deps step) scrapes them through the same file_sd config
the local stack uses (ops/prometheus/prometheus.local.yml). Every query of every panel is
evaluated through Prometheus's HTTP API and must return at least one series.
"""

from __future__ import annotations

import functools
import json
import operator
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.processes import free_port, start_service

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "ops" / "grafana" / "dashboards" / "rollwire.json"
RATE_WINDOW = "20s"  # what Grafana's $__rate_interval becomes at a 2 s scrape interval


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels if p["type"] != "row" for t in p["targets"]]


def test_dashboard_json_is_generated_from_the_panel_list():
    import runpy

    module = runpy.run_path(str(ROOT / "ops" / "grafana" / "build_dashboard.py"))
    assert json.loads(DASHBOARD.read_text()) == module["build"](), "run ops/grafana/build_dashboard.py and commit"


def query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr.replace("$__rate_interval", RATE_WINDOW)})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("stack")
    one_thread = ("--set", "transformers.threads=1")
    gen_args = ["generator", "--model", str(tiny_model), "--port", "0", "--metrics-port", "0", *one_thread]
    with ThreadPoolExecutor(2) as pool:
        generators = list(
            pool.map(lambda name: start_service([*gen_args, "--replica-id", name], work, name), ["gen-a", "gen-b"])
        )
    proxy = start_service(
        [
            "proxy",
            "--port",
            "0",
            "--metrics-port",
            "0",
            *functools.reduce(operator.iadd, (["--generator", g.target] for g in generators), []),
        ],
        work,
        "proxy",
    )
    learner = start_service(
        [
            "learner",
            f"target={proxy.target}",
            f"base_model={tiny_model}",
            f"run_dir={work / 'learner'}",
            "metrics_port=0",
            "metrics_host=127.0.0.1",
            "max_seconds=150",
            "progress=false",
            "eval.at_start=false",
            "eval.at_end=false",
            "buffer.keep_zero_variance=true",
            "rollout.n=4",
            "rollout.groups_in_flight=8",
            "train.groups_per_step=4",
            "train.threads=1",
        ],
        work,
        "learner",
        plaintext=False,
    )
    services = [*generators, proxy, learner]
    yield {"generator": generators, "proxy": [proxy], "learner": [learner]}, work
    for svc in reversed(services):
        svc.stop()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run `make system-deps` (Debian's prometheus package)")
    services, _ = stack
    work = tmp_path_factory.mktemp("prometheus")
    (work / "targets").mkdir()
    for role, procs in services.items():
        targets = [
            {"targets": [f"127.0.0.1:{p.metrics_port}"], "labels": {"role": role, "replica": p.name}} for p in procs
        ]
        (work / "targets" / f"{role}.json").write_text(json.dumps(targets))
    shutil.copy(ROOT / "ops" / "prometheus" / "prometheus.local.yml", work / "prometheus.yml")
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=(work / "prometheus.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    yield base
    proc.terminate()
    proc.wait(20)


def test_every_dashboard_query_returns_series(stack, prometheus):
    queries = dashboard_queries()
    assert len(queries) >= 20
    deadline, missing = time.monotonic() + 150, queries
    while missing and time.monotonic() < deadline:  # series appear as the learner steps and pushes
        time.sleep(2)
        try:
            missing = [(title, expr) for title, expr in missing if not query(prometheus, expr)]
        except OSError:
            continue  # Prometheus still starting
    assert not missing, "dashboard queries with no series:\n" + "\n".join(f"{t}: {e}" for t, e in missing)
    up = query(prometheus, "up")
    assert len(up) == 4 and all(s["value"][1] == "1" for s in up)
    roles = {s["metric"]["role"] for s in up}
    assert roles == {"generator", "proxy", "learner"}


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
