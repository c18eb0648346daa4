"""Helpers for the proxy tests (this module holds no tests): starting real generator and
proxy processes, reading Generate streams while checking the protocol, waiting on state."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from conftest import Service, start_generator, start_service

from rollwire.v1 import admin_pb2_grpc, generator_pb2_grpc
from rollwire.v1 import generator_pb2 as pb

# The limits of conftest's generator fixture, so bad requests are judged alike; one torch
# thread each, because several replicas on two cores with torch's default threads spin
# against each other and run ~25x slower (measured: 640 ms instead of 27 ms per group).
GENERATOR_ARGS = ("--set", "limits.max_n=16", "--set", "limits.max_new_tokens=128", "--set", "transformers.threads=1")


def start_generators(model: Path, workdir: Path, names: list[str], *extra: str) -> list[Service]:
    """Start replicas one after the other (~5 s each; starting them together on two cores
    was slower still), each named by its replica id."""
    return [start_generator(model, workdir, n, *GENERATOR_ARGS, "--replica-id", n, *extra) for n in names]


def start_proxy(workdir: Path, name: str, generators: list[Service], *extra: str) -> Service:
    """A proxy over `generators`; health checks every 0.2 s so tests see changes quickly."""
    args = ["proxy", "--port", "0", "--metrics-port", "0", "--proxy-id", name, "--set", "health.interval_s=0.2"]
    for g in generators:
        args += ["--generator", g.target]
    return start_service(args + list(extra), workdir, name)


def stop_all(services: list[Service]) -> None:
    """SIGTERM everything at once, then wait: a replica takes ~3 s to stop."""
    for s in services:
        if s.proc.poll() is None:
            s.proc.terminate()
    for s in services:
        s.stop()


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


def status(target: str) -> pb.GetStatusResponse:
    with grpc.insecure_channel(target) as ch:
        return generator_pb2_grpc.GeneratorServiceStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10)


def admin(target: str) -> admin_pb2_grpc.AdminServiceStub:
    return admin_pb2_grpc.AdminServiceStub(grpc.insecure_channel(target))


def routable(proxy: Service) -> dict[str, pb.ReplicaStatus]:
    """Replicas the proxy routes to now, by address."""
    return {r.address: r for r in status(proxy.target).replicas if r.healthy}


def wait_routable(proxy: Service, replicas: list[Service], timeout: float = 30) -> None:
    want = {r.target for r in replicas}
    wait_until(lambda: want <= set(routable(proxy)), timeout, f"the proxy routes to {sorted(want)}")


def request(
    prompt: str, n: int = 2, max_new_tokens: int = 8, adapter: str = "", request_id: str = "", **params
) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens, **params)
    req = pb.GenerateRequest(text=prompt, n=n, request_id=request_id, sampling=sampling)
    if adapter:
        req.adapter.name = adapter
    return req


@dataclass
class GroupResult:
    """One complete group as the client keeps it, and what happened on the way."""

    request_id: str
    replica: str
    version: int
    tokens: dict[int, list[int]]
    restarts: int
    attempts_started: list[str] = field(default_factory=list)
    sent_at: float = 0.0
    seconds: float = 0.0


def run_group(
    stub: generator_pb2_grpc.GeneratorServiceStub,
    req: pb.GenerateRequest,
    timeout: float = 30,
    on_event: Callable[[pb.GenerateResponse], None] | None = None,
    metadata=(),
) -> GroupResult:
    """Read one Generate stream, asserting the protocol: `started` first and again after
    every `restarted` (which discards what came before); each sample finished exactly once."""
    sent_at = time.monotonic()
    started, restarts, starts = None, 0, []
    tokens: dict[int, list[int]] = {}
    finished: dict[int, pb.SampleFinished] = {}
    versions: set[int] = set()
    for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
        if on_event:
            on_event(msg)
        if msg.HasField("restarted"):
            assert not (msg.HasField("started") or msg.tokens or msg.finished), "`restarted` must come alone"
            restarts += 1
            started, tokens, finished, versions = None, {}, {}, set()
            continue
        if msg.HasField("started"):
            assert started is None, "a second `started` without `restarted` before it"
            started = msg.started
            starts.append(started.replica)
        assert started is not None, "tokens or finishes before `started`"
        for t in msg.tokens:
            assert t.sample_index not in finished, "tokens after the sample finished"
            tokens.setdefault(t.sample_index, []).extend(t.token_ids)
            versions.add(t.adapter_version)
        for f in msg.finished:
            assert f.sample_index not in finished, "a sample finished twice"
            finished[f.sample_index] = f
    assert started is not None and sorted(finished) == list(range(req.n)), (
        "the stream ended before every sample finished"
    )
    for i, f in finished.items():
        assert len(tokens.get(i, [])) == f.completion_tokens
    assert versions <= {started.adapter.version}, "tokens from another adapter version than `started` announced"
    return GroupResult(
        started.request_id,
        started.replica,
        started.adapter.version,
        tokens,
        restarts,
        starts,
        sent_at,
        time.monotonic() - sent_at,
    )
