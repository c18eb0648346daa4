"""Fixtures for the learner's integration tests: the taught model and a proxy with 2 replicas.

The taught model is cached by its content key under .cache/ in the repository, so it is built
once (about a minute) and reused by every later test session and by `make demo`-like runs.
"""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollwire.common.services import ServiceProcess, rollwire_cmd, start

ROOT = Path(__file__).resolve().parents[1]
TAUGHT_DIR = ROOT / ".cache" / "rollwire" / "taught"


@pytest.fixture(scope="session")
def taught_model() -> Path:
    from rollwire.demo.teach import build_taught_model

    return build_taught_model(TAUGHT_DIR, log=lambda line: None)


@dataclass
class Stack:
    proxy: ServiceProcess
    replicas: list[ServiceProcess]
    workdir: Path

    def stop(self) -> None:
        for svc in [self.proxy, *self.replicas]:
            svc.stop()


def start_stack(model: Path, workdir: Path, replicas: int = 2, *generator_args: str) -> Stack:
    """Replicas (1 torch thread each, started concurrently) behind a proxy."""

    def one(i: int) -> ServiceProcess:
        return start(
            [
                "generator",
                "--model",
                str(model),
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--set",
                "transformers.threads=1",
                "--set",
                "grace_seconds=1",
                *generator_args,
            ],
            workdir,
            f"generator-{i}",
        )

    with ThreadPoolExecutor(replicas) as pool:
        gens = list(pool.map(one, range(replicas)))
    proxy = start(
        ["proxy", "--port", "0", "--metrics-port", "0", *[a for g in gens for a in ("--generator", g.target)]],
        workdir,
        "proxy",
    )
    return Stack(proxy, gens, workdir)


@pytest.fixture(scope="session")
def stack(taught_model, tmp_path_factory):
    """One proxy with 2 replicas of the taught model, shared: each test uses its own adapter name."""
    s = start_stack(taught_model, tmp_path_factory.mktemp("learner-stack"))
    yield s
    s.stop()


def learner_args(target: str, model: Path, run_dir: Path, adapter: str, *overrides: str) -> list[str]:
    return [
        "learner",
        f"target={target}",
        f"base_model={model}",
        f"run_dir={run_dir}",
        f"adapter_name={adapter}",
        "metrics_port=0",
        "metrics_host=127.0.0.1",
        "train.threads=1",
        "eval.concurrency=16",
        *overrides,
    ]


def run_learner(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(rollwire_cmd(*args), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-4000:]
        raise AssertionError(f"learner still running after {timeout}s:\n{tail.decode(errors='replace')}") from None
    if result.returncode != 0:
        raise AssertionError(f"learner exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def wait_for_steps(run_dir: Path, count: int, proc, timeout: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = steps(run_dir)
        if len(done) >= count:
            return done
        if proc.poll() is not None:
            raise AssertionError(f"the learner exited early with {proc.returncode}")
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} steps after {timeout}s")


def adapter_versions(target: str, name: str) -> list[int]:
    from rollwire.client import Client

    with Client(target, timeout=10) as c:
        status = c.get_status()
    adapters = list(status.adapters) + [a for r in status.replicas for a in r.adapters]
    return sorted({v for a in adapters if a.name == name for v in a.versions})


def log_events(text: str, event: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{") and f'"event": "{event}"' in line:
            out.append(json.loads(line))
    return out
