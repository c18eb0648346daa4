"""`make demo-agent` (rollwire.demo.agent), in a short run: two replicas behind a proxy, a learner
ingesting only, and examples/agent_producer.py as its own process playing multi-turn episodes
through sessions. The full demo's acceptance (held-out episode success up by 30+ points in
under 5 minutes) is measured by running it; this checks what every run promises: the learner
trained on the producer's episodes, every accepted trajectory is accounted for, the turns went
through the proxy's sessions, and the run folder holds the summary and the reward curve.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.integration
@pytest.mark.slow
def test_a_short_agent_demo_trains_on_the_producers_episodes(chain_model, tmp_path):
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, "-m", "rollwire.demo.agent", "--budget-s", "30", "--max-steps", "6", "--eval-size", "16",
        "--eval-every", "0", "--concurrency", "3", "--runs-dir", str(runs), "--model-dir", str(chain_model),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    run = (runs / "latest").resolve()
    learner_log = (run / "learner.log").read_text(errors="replace") if (run / "learner.log").exists() else ""
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{learner_log[-3000:]}"

    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "chain" and 1 <= summary["steps"] <= 6
    assert summary["accuracy_before"] is not None and summary["accuracy_after"] is not None
    ingest, produced = summary["ingest"]["trajectories"], summary["producer"]
    assert (
        ingest["accepted"] == produced["trajectories"]["accepted"] > 0
    )  # what the producer was told, the learner holds
    assert ingest["accepted"] == ingest["trained"] + ingest.get("dropped", 0) + ingest.get("expired", 0)
    assert ingest["trained"] == 4 * summary["steps"] * 8  # groups_per_step 4, n 8: every step trained ingested samples
    routes = summary["serving"]["session_routes"]
    assert routes.get("first", 0) > 0 and sum(v for k, v in routes.items() if k != "first") > 0
    assert (run / "reward_curve.png").exists() or summary["reward_curve"] is None
    assert "ingested" in result.stdout and "run folder" in result.stdout
