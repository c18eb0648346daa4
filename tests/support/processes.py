"""Real rollwire processes for the tests: the test defaults over rollwire.demo.stack (the one
stack starter of the demo, the tests and the benchmarks), and bounded waits on their state."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rollwire.demo import stack as demo_stack
from rollwire.demo.stack import (  # noqa: F401 (re-exported: the tests' one import for processes)
    Service,
    Stack,
    generator_args,
    rollwire_cmd,
    start,
    start_stack,
    stop_all,
    wait_routable,
)
from rollwire.v1 import generator_pb2 as pb

from .wire import status

ROOT = Path(__file__).resolve().parents[2]

# The limits of conftest's generator fixture, so bad requests are judged alike; one torch
# thread each, because several replicas on two cores with torch's default threads spin
# against each other and run ~25x slower (measured: 640 ms instead of 27 ms per group).
GENERATOR_ARGS = ("--set", "limits.max_n=16", "--set", "limits.max_new_tokens=128", "--set", "transformers.threads=1")
FAST_STOP = ("--set", "grace_seconds=1")
"""A replica that drains for at most a second when stopped: tests stop many."""
FAST_HEALTH = ("--set", "health.interval_s=0.2")
"""A proxy that checks its replicas every 0.2 s, so tests see changes quickly."""


def start_service(args: list[str], workdir: Path, name: str, timeout: float = 90, plaintext: bool = True) -> Service:
    """Start a rollwire process and wait until it serves (a plaintext one: until a channel is ready)."""
    return start(args, workdir, name, timeout, probe=plaintext)


def start_generator(
    model: Path, workdir: Path, name: str = "generator", *extra: str, plaintext: bool = True
) -> Service:
    return start_service(generator_args(model, *extra), workdir, name, plaintext=plaintext)


def start_generators(model: Path, workdir: Path, names: list[str], *extra: str) -> list[Service]:
    """Start replicas one after the other (~5 s each; starting them together on two cores
    was slower still), each named by its replica id."""
    return [start_generator(model, workdir, n, *GENERATOR_ARGS, "--replica-id", n, *extra) for n in names]


def start_proxy(workdir: Path, name: str, generators: list[Service], *extra: str) -> Service:
    """A proxy over `generators`, named by its proxy id, with FAST_HEALTH."""
    return demo_stack.start_proxy(workdir, name, generators, "--proxy-id", name, *FAST_HEALTH, *extra, probe=True)


def wait_until(predicate: Callable[[], object], timeout: float, what: str, every: float = 0.05):
    """Bounded polling of a condition that has no event to await."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        time.sleep(every)


def routable(proxy: Service) -> dict[str, pb.ReplicaStatus]:
    """Replicas the proxy routes to now, by address."""
    return {r.address: r for r in status(proxy.target).replicas if r.healthy}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`rollwire ARGS` in a process of its own, its output captured, within 120 s."""
    return subprocess.run(rollwire_cmd(*args), capture_output=True, text=True, timeout=120)
