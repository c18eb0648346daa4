"""Well-behaved callers of a proxy in a process of their own, beside a hostile one (issue 32).

A hostile case counts its collateral with callers that do what users do: gRPC groups, HTTP
completions and GetStatus polls, each in a loop, each call timed. They run in a separate
process so that what the test process does to play the hostile caller (build an 8 MiB body,
hold sockets) never takes their interpreter: what their latencies show is the proxy's.

`Bystanders(proxy)` starts the process and returns once every kind of call has succeeded
once; leaving the block stops it (SIGTERM: each kind's callers go on until it has `MIN_CALLS`
calls, then end their calls in flight) and reads its record: every failure (collateral: a hostile case may cause none) and every latency, by kind.
The test process, playing the hostile client, keeps its usual priority: its own CPU (building
an 8 MiB body, trickling bytes) competes with the replica's on these 2 cores, which a fleet's
hostile caller on its own machine would not, so the bound is measured in the harder case.
`unharmed(during, calm)` is the issue's bound: no failure, every kind called, and each kind's
p99 (the proxy's own answer GetStatus, a gRPC group, an HTTP completion) within 2x of the same
callers' without the hostile client (`calm`). Latencies under `NOISE_FLOOR_S` count as the
floor: on 2 shared cores a scheduler tick or a collection moves a few-millisecond call by more
than its own length. Each case runs its bystanders for at least `MIN_RUN_S`, so a p99 is never
one call's latency.

Run as a script by `Bystanders` only: `bystanders.py GRPC_TARGET HTTP_URL|- OUT_JSON`.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

KINDS = ("grpc", "http", "status")
"""The calls made: a gRPC group, an HTTP completion (where the proxy serves its door), a GetStatus."""
NOISE_FLOOR_S = 0.05
"""Below this a latency is the machine's noise, not the proxy's: a p99 is compared from here up."""
FACTORS = {"status": 2.0, "grpc": 2.0, "http": 2.0}
"""Each kind's p99 bound, as a multiple of the calm run's (the issue's 2x)."""
MIN_RUN_S = 2.0
MIN_CALLS = 100
"""Each kind's p99 is taken over at least this many calls, so that it is the 99th of 100 (one
outlier alone never decides it): a stopped run goes on until it has them, `MAX_EXTRA_S` at most."""
MAX_EXTRA_S = 20.0
CALLERS = {"grpc": 2, "http": 2, "status": 1}
"""Concurrent callers of each kind (more calls in the same window, without stretching it)."""
READY_TIMEOUT_S = 60
STOP_TIMEOUT_S = 90


@dataclass
class Record:
    """What one run of the bystanders saw."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    failures: list[str] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        """The kinds this run made (no `http` against a proxy without its door)."""
        return [k for k in KINDS if k in self.latencies]

    def p99(self, kind: str) -> float:
        """The 99th percentile of `kind`'s latencies (nearest rank: an observed value)."""
        values = sorted(self.latencies[kind])
        assert values, f"no {kind} call finished"
        return values[max(0, math.ceil(0.99 * len(values)) - 1)]

    def summary(self) -> str:
        return ", ".join(f"{k} p99 {self.p99(k) * 1000:.0f} ms of {len(self.latencies[k])}" for k in self.kinds)


class OverBound(AssertionError):
    """A kind's p99 over its bound while every call was answered: the one part of `unharmed`
    that the machine's own load can fail (`measured_twice` measures it again)."""


def unharmed(during: Record, *calm: Record) -> None:
    """Assert the hostile case's collateral bound: 0 failed calls, and each kind's p99 within
    FACTORS[kind] of the calm runs' (all floored at NOISE_FLOOR_S; OverBound otherwise). With
    calm runs on both sides of a long hostile run, the larger p99 is the baseline: a change in the
    machine's load between them (the suite's other worker) is no effect of the hostile client."""
    assert calm, "no calm run to compare with"
    assert during.failures == [], during.failures[:5]
    for kind in calm[0].kinds:
        assert during.latencies.get(kind), f"no {kind} call finished beside the hostile client"
    for kind in calm[0].kinds:
        baseline = max(c.p99(kind) for c in calm)
        bound = FACTORS[kind] * max(baseline, NOISE_FLOOR_S)
        if during.p99(kind) > bound:
            raise OverBound(
                f"{kind} p99 {during.p99(kind) * 1000:.0f} ms beside the hostile client, over {FACTORS[kind]:g}x the "
                "calm run's "
                f"({during.summary()}; calm: {'; '.join(c.summary() for c in calm)})"
            )


T = TypeVar("T")


def measured_twice(case: Callable[[], tuple[T, Record, Record]], *calm: Record) -> T:
    """Run a hostile case, `case()` -> (its outcome, the bystanders' record beside it, a calm
    record right after), and check `unharmed` against that and `calm`; a case over the p99 bound
    (OverBound: every call answered) is run and measured once more, and passes only if the second
    measurement is within the bound. Why: on 2 cores shared with the suite's other worker, the
    machine's load moves a p99 by more than 2x between two calm runs of the same callers (88 and
    34 ms in one CI run), so one measurement over 2x can be the machine's; a hostile client that
    does the harm does it in both. A failed or starved call is never measured again."""
    try:
        outcome, during, after = case()
        unharmed(during, *calm, after)
        return outcome
    except OverBound as first:
        print(f"\nover the bound once ({first}); measured again")
    outcome, during, after = case()
    unharmed(during, *calm, after)
    return outcome


class Bystanders:
    """The bystanders' process, as a context manager; `.record` once the block has ended (or
    `stop` was called)."""

    def __init__(self, proxy, out: Path) -> None:
        self.proxy, self.out = proxy, out
        self.record = Record()
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def __enter__(self) -> Bystanders:
        http = self.proxy.http_url if self.proxy.http_port is not None else "-"
        argv = [sys.executable, __file__, self.proxy.target, http, str(self.out)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        ready = threading.Event()
        line: list[str] = []
        reader = threading.Thread(target=lambda: (line.append(self.proc.stdout.readline()), ready.set()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        if not ready.wait(READY_TIMEOUT_S) or line[0].strip() != "ready":
            self.proc.kill()
            raise AssertionError(f"the bystanders did not start within {READY_TIMEOUT_S} s: {line[:1]}")
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> Record:
        """End the run (once) and read its record."""
        if self.proc is None or self.proc.returncode is not None:
            return self.record
        time.sleep(max(0.0, self.started + MIN_RUN_S - time.monotonic()))  # a length of run, not an event
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the bystanders did not stop within {STOP_TIMEOUT_S} s of SIGTERM") from None
        body = json.loads(self.out.read_text())
        self.record = Record(body["latencies"], body["failures"])
        return self.record


def calm_run(proxy, out: Path, seconds: float = MIN_RUN_S) -> Record:
    """The same callers for `seconds` with nothing hostile beside them."""
    with Bystanders(proxy, out) as calm:
        time.sleep(seconds)  # a length of run, not a wait for an event
    return calm.record


# -- the bystanders' process ----------------------------------------------------------------------
def _main(target: str, http_url: str, out: str) -> None:
    import grpc
    import requests

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rollwire.v1 import generator_pb2 as pb
    from rollwire.v1 import generator_pb2_grpc
    from support.wire import request, run_group

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    kinds = [k for k in KINDS if k != "http" or http_url != "-"]
    record = Record({k: [] for k in kinds})
    first = {k: threading.Event() for k in kinds}

    done_at: list[float] = []  # when a stop was asked: the run ends MAX_EXTRA_S after it at the latest

    def finished(kind: str) -> bool:
        if not stop.is_set():
            return False
        if not done_at:
            done_at.append(time.monotonic() + MAX_EXTRA_S)
        return len(record.latencies[kind]) >= MIN_CALLS or time.monotonic() > done_at[0]

    def loop(kind: str) -> None:
        with requests.Session() as session:
            call = calls[kind] if kind != "http" else (lambda: http(session))
            while not finished(kind):
                start = time.monotonic()
                try:
                    call()
                except Exception as exc:  # every failure is collateral: count it
                    record.failures.append(f"{kind}: {exc!r}"[:300])
                    continue
                record.latencies[kind].append(time.monotonic() - start)
                first[kind].set()

    with grpc.insecure_channel(target) as channel:
        stub = generator_pb2_grpc.GeneratorServiceStub(channel)
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}

        def http(session) -> None:
            r = session.post(http_url + "/v1/completions", json=body, timeout=20)
            if r.status_code != 200:
                raise RuntimeError(f"http {r.status_code}: {r.text[:200]}")

        calls = {
            "grpc": lambda: run_group(stub, request("1+2=", n=1, max_new_tokens=3), timeout=20),
            "status": lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=20),
        }
        threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in kinds for _ in range(CALLERS[k])]
        for t in threads:
            t.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(e.is_set() for e in first.values()) and time.monotonic() < deadline and not stop.is_set():
            first["status"].wait(0.1)
        waiting = [k for k in kinds if not first[k].is_set()]
        print(f"not ready: {waiting} {record.failures[:3]}" if waiting else "ready", flush=True)
        # Waited with a timeout: Python runs a signal's handler only in the main thread, and a
        # SIGTERM that the kernel hands to one of the calling threads would never wake a wait
        # without one (seen: a run that did not stop within 60 s).
        while not stop.wait(0.1):
            pass
        for t in threads:
            t.join(MAX_EXTRA_S + 30)
    Path(out).write_text(json.dumps({"latencies": record.latencies, "failures": record.failures}))


if __name__ == "__main__":
    _main(*sys.argv[1:4])
