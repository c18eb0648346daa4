"""Running `rollwire learner` against a stack, and reading what it wrote."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from pathlib import Path

from rollwire.demo.stack import rollwire_cmd
from rollwire.demo.teach import TeachSpec

CACHE = Path(
    os.environ.get("ROLLWIRE_TEST_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollwire-tests"
)
"""Where the suite keeps what it builds once per machine (ROLLWIRE_TEST_CACHE, else the user's
cache folder), outside the checkout, so a fresh clone reuses it as pip reuses its wheels."""


def taught_dir(spec: TeachSpec | None = None) -> Path:
    """The folder of the model taught by `spec` (the addition task's by default), named by the
    spec's content key (`teach.TeachSpec.key`: it changes with the spec and the teaching's
    format), so checkouts of different specs never overwrite each other's: built once per
    machine (about a minute) and reused by every later session; a build is written aside and
    renamed into place whole."""
    return CACHE / f"taught-{(spec or TeachSpec()).key()}"


def taught_model(spec: TeachSpec | None = None) -> Path:
    """The model taught by `spec`, built here unless the cache holds it. Test processes that
    run at once (pytest-xdist's workers, two checkouts) build it one at a time under a lock
    file, so none replaces a folder another has started to read."""
    from rollwire.demo.teach import build_taught_model

    folder = taught_dir(spec)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return build_taught_model(folder, spec or TeachSpec(), log=lambda line: None)


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
