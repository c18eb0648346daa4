"""The demo's placement with real processes: a started process and the threads it starts later
run on the given cores. The flags a vLLM-backed replica gets (its --dry-run, in-process):
tests/unit/demo/test_learner_demo.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_a_started_process_and_the_threads_it_starts_later_run_on_the_given_cores():
    from rollwire.demo.stack import pin

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core: pinning to a subset cannot be told from not pinning")
    code = (
        "import os, sys, threading\n"
        "sys.stdin.readline()\n"  # the parent pins this process first, then lets it go on
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "print(sorted(os.sched_getaffinity(0)), seen[0])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pin(proc.pid, {allowed[-1]})
    out, _ = proc.communicate("go\n", timeout=60)
    assert out.split() == [f"[{allowed[-1]}]", f"[{allowed[-1]}]"]
