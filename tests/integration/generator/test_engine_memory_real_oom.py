"""Memory as the replica's load, never its fault, with real allocation failures (issue 32, A15):
the transformers engine in a process of its own (tests/support/real_oom.py) whose address space
is capped a few MiB above its size. The same engine with injected failures, in-process:
tests/unit/generator/test_engine_memory.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
@pytest.mark.slow
def test_real_allocation_failures_end_the_large_group_and_no_newcomer(tiny_model):
    """No injection: the engine in its own process with its address space capped (RLIMIT_AS) a
    few MiB above its size, a large group decoding and 6 small newcomers joining it. Over
    headrooms where memory runs out while all are in the batch (when the rows join, or in a
    decode step), every run answers every group within its deadline (before this fix, the engine
    thread died and every request hung), the small groups finish with their tokens alone (no
    collateral), and the large group is the one that ends, ENGINE_OOM."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
    tests = Path(__file__).resolve().parents[2]  # support/ is imported from tests/
    runs = {}
    for headroom_mib in (19, 21):  # here: memory runs out as the rows join, then in a decode step
        done = subprocess.run(
            [sys.executable, "-m", "support.real_oom", str(tiny_model), str(headroom_mib)],
            cwd=tests,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs[headroom_mib] = json.loads(done.stdout.strip().splitlines()[-1])
    for headroom_mib, run in runs.items():
        assert run["smalls"] == ["ok"] * 6, (headroom_mib, run)
        assert run["big"] in ("ok", "ENGINE_OOM"), (headroom_mib, run)
    if all(run["big"] == "ok" for run in runs.values()):
        pytest.skip(f"this host's allocator did not run out within these headrooms: {runs}")
