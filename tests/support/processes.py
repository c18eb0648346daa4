"""Real rollwire processes for the tests: the test defaults over rollwire.demo.stack (the one
stack starter of the demo, the tests and the benchmarks), and bounded waits on their state."""

from __future__ import annotations

import os
import random
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
    """A port nothing listens on, for a process a test starts on it later (or for a refused
    connection). The classic `bind(("127.0.0.1", 0))` and close hands out a port from the
    kernel's ephemeral range, where any process binding port 0 meanwhile (the test's own, the
    other pytest-xdist worker's) may be given it before the test's process binds it: that was
    a replica of one worker's fleet answering at another's member address. These ports come from
    below the ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), which port 0 never draws
    from, each worker from its own slice of it, never one this process handed out before, and
    each checked free by binding it."""
    global _next_port
    lowest_ephemeral = _ephemeral_low()
    if lowest_ephemeral < RESERVED_FROM + 2_000:  # a host whose ephemeral range starts low: the kernel's pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    width = (lowest_ephemeral - RESERVED_FROM) // workers
    first = RESERVED_FROM + worker * width
    if _next_port is None:
        _next_port = random.Random(os.getpid()).randrange(width)  # two runs at once start apart
    for _ in range(width):
        port = first + _next_port % width
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {first}..{first + width - 1}")


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


RESERVED_FROM = 10_000
"""The reserved ports start here and end below the ephemeral range (Linux's default starts at 32768)."""
_next_port: int | None = None


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`rollwire ARGS` in a process of its own, its output captured, within 120 s."""
    return subprocess.run(rollwire_cmd(*args), capture_output=True, text=True, timeout=120)
