"""Supervision of a launched engine server (engines/served/process.py) with real processes: a launched
server dies with its replica, however the replica ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

PARENT = textwrap.dedent(
    """
    import asyncio, pathlib, sys
    from rollwire.generator.engines.served.process import ServerProcess
    from rollwire.generator.engines.served.sglang_protocol import SGLANG

    async def main():
        process = ServerProcess(SGLANG, [sys.executable, "-c", "import time; time.sleep(60)"], pathlib.Path(sys.argv[1]))
        await process.start()
        print("pid", process.proc.pid, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


def test_a_launched_server_dies_with_its_replica(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "server.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(next(line for line in parent.stdout if line.startswith("pid ")).split()[1])
        os.kill(child, 0)  # running
        parent.kill()  # SIGKILL: no cleanup of its own runs
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.05)
        if _alive(child):
            os.killpg(child, signal.SIGKILL)
            pytest.fail("the launched server outlived its SIGKILLed replica")
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for whichever process adopted it to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
