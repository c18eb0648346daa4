"""Starting rollwire processes and waiting until they serve (tests, benchmarks, demo).

A process started with `--ready-file F` writes {port, metrics_port, pid} to F once it
serves; `start` waits for that file (or the process's death) and returns the ports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def rollwire_cmd(*args: str) -> list[str]:
    """The `rollwire` command line run by this interpreter."""
    return [sys.executable, "-m", "rollwire.client.cli", *args]


@dataclass
class ServiceProcess:
    """A rollwire process this code started; stop() ends only it."""

    name: str
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start(args: list[str], workdir: str | Path, name: str, timeout: float = 120) -> ServiceProcess:
    """Run `rollwire <args> --ready-file ...`, logging to workdir/name.log; wait until ready."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ready, log_path = workdir / f"{name}.ready.json", workdir / f"{name}.log"
    ready.unlink(missing_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(rollwire_cmd(*args, "--ready-file", str(ready)), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}; see {log_path}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{name} was not ready after {timeout:.0f}s; see {log_path}:\n{_tail(log_path)}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return ServiceProcess(name, proc, info["port"], info["metrics_port"], log_path)


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]
