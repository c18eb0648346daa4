"""The demo's placement with real processes: vLLM-backed replicas launch vLLM from its own
environment, and a started process and the threads it starts later run on the given cores."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast


def test_vllm_backed_replicas_launch_vllm_from_its_own_environment(tmp_path):
    """`make demo ENGINE=vllm`: the flags the demo gives a replica resolve to a vLLM launched
    from .venv-vllm with the CPU settings (the generator's own --dry-run)."""
    from rollwire.demo.run import engine_args, parse_args
    from rollwire.demo.stack import VLLM_CPU_ENV, generator_args, rollwire_cmd

    python = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(SystemExit, match="make .venv-vllm"):
        engine_args(parse_args(["--engine", "vllm", "--vllm-python", str(python)]))
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)  # a venv's python: a link that must not be resolved away
    flags, timeout = engine_args(parse_args(["--engine", "vllm", "--vllm-python", str(python)]))
    assert timeout >= 300 and engine_args(parse_args([])) == ((), 120.0)
    dry = subprocess.run(
        rollwire_cmd(*generator_args(tmp_path, *flags), "--dry-run"), capture_output=True, text=True, check=True
    ).stdout
    config = tomllib.loads(dry)
    assert config["engine"] == "vllm" and config["vllm"]["dtype"] == "float32"
    assert config["vllm"]["launch_command"] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert config["vllm"]["env"] == VLLM_CPU_ENV


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
