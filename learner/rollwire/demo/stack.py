"""Starting rollwire processes on this machine and waiting until they serve: the one stack
starter of the demo, the tests and the benchmarks.

Invariants:
- a process started here runs `rollwire <command> ... --ready-file F` with this interpreter
  and logs to `workdir/<name>.log`; `start` returns only once the process wrote F (it serves:
  the servers write it after they listen), and otherwise raises with the end of that log,
  the process killed. Every wait has a deadline.
- `Service.stop` and `stop_all` end only processes this module started, never others.
- `start_stack` leaves nothing running when it raises: what it started is stopped.

Why here: the SDK (rollwire.client, rollwire.common) must not launch servers, and the demo
is the one user-facing program that runs the whole local stack; this module imports nothing
heavy (no torch), so tests and benchmarks use it freely.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from rollwire.v1 import generator_pb2 as pb
from rollwire.v1 import generator_pb2_grpc

ONE_THREAD = ("--set", "transformers.threads=1")
"""Several model processes on a few cores with torch's default threads fight over them and
run up to 20x slower, so a local replica gets one torch thread."""
LOCAL_REPLICAS = 1
"""Replicas of the stack a laptop runs for a learner (the demo, bench/peer_trl.py). Measured on
2 cores (docs/benchmarks.md §7): one replica batching every group generates about 20% more groups
a second than two replicas splitting them, which pay for a second process and half-full batches."""
VLLM_CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; unset, vLLM's CPU worker takes ~21 of 24 GiB
    "VLLM_SERVER_DEV_MODE": "1",  # /abort_requests and /server_info
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # no pinning: its cores are the ones the replica was given
    "OMP_NUM_THREADS": "1",  # the tiny model needs no more; two would fight the other processes
}
"""A local vLLM server on CPU (docs/engines.md): what each of these settings saves."""
VLLM_START_S = 600.0
"""How long a vLLM-backed replica may take to serve: vLLM starts in ~40-65 s and compiles its
first batch in ~15 s on 2 idle cores, several times that on busy ones."""
READY_POLL_S = 0.01
"""How often `start` looks for the ready file again: a look is one stat, and a process is seen
serving within this of writing it (at 0.05 s the wait added ~25 ms to each of the suite's ~100
process starts, issue 33)."""
ROUTABLE_POLL_S = 0.02
"""How often `wait_routable` asks the proxy again: one GetStatus on a new channel, a few
milliseconds of the proxy's CPU (at 0.1 s the wait added ~50 ms to each stack)."""
WHOLE_GROUPS = ("--set", "stream_interval=16")
"""A learner reads whole groups: its replicas send a sample's tokens 16 at a time (or at its
end), not one message per token, which saves gRPC work in the replica, the proxy and the learner."""


@dataclass(frozen=True)
class Placement:
    """The cores (Linux CPU affinity) each part of a local stack runs on; empty: anywhere."""

    learner: frozenset[int] = frozenset()
    replicas: frozenset[int] = frozenset()
    proxy: frozenset[int] = frozenset()


def local_placement(replicas: int, cores: Collection[int] | None = None) -> Placement:
    """Where the local stack's processes run on this machine's `cores` (default: those this
    process may use).

    When the learner, the proxy and the replicas (one torch thread each) outnumber the cores,
    the scheduler moves them around and the learner's step, the loop's critical path, waits
    behind the others. Then the learner gets the first core to itself and the replicas and the
    proxy share the rest. Measured on 2 cores (docs/benchmarks.md §7, 1 replica, 6 alternating
    pairs): the learner's training phase 0.057 s a step placed against 0.073 s with every
    process anywhere, 1.07x the groups a second; neutral where generation is the bottleneck.
    With a core for each, or off Linux, nothing is pinned."""
    if cores is None:
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
    ordered = sorted(cores)
    if len(ordered) < 2 or len(ordered) >= replicas + 2:
        return Placement()
    rest = frozenset(ordered[1:])
    return Placement(learner=frozenset(ordered[:1]), replicas=rest, proxy=rest)


def pin(pid: int, cpus: Collection[int]) -> None:
    """Run every thread of process `pid` on `cpus` (Linux; nothing elsewhere or when empty).

    Called as soon as the process is started, before its interpreter has started threads:
    the threads it starts later inherit the mask (the sweep covers any that started sooner)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def vllm_replica_args(python: str | Path, max_lora_rank: int = 16) -> tuple[str, ...]:
    """A replica backed by a vLLM server it launches from `python`'s environment (`make
    .venv-vllm` builds one: vLLM pins its own torch), float32 on CPU with VLLM_CPU_ENV."""
    launch = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    settings = {
        "vllm.launch_command": json.dumps(launch),
        "vllm.env": json.dumps(VLLM_CPU_ENV),
        "vllm.dtype": "float32",
        "vllm.max_lora_rank": str(max_lora_rank),
        "vllm.startup_timeout_s": str(VLLM_START_S),
    }
    return ("--engine", "vllm", *(a for k, v in settings.items() for a in ("--set", f"{k}={v}")))


def rollwire_cmd(*args: str) -> list[str]:
    """The `rollwire` command line run by this interpreter."""
    return [sys.executable, "-m", "rollwire.client.cli", *args]


@dataclass
class Service:
    """A rollwire process this module started; `stop` ends only it."""

    name: str
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path
    host: str = "127.0.0.1"
    """Where it listens (another address for a process in a network namespace)."""
    http_port: int | None = None
    """A proxy's HTTP front door, when it serves one (docs/http.md)."""

    @property
    def http_url(self) -> str:
        if self.http_port is None:
            raise ValueError(f"{self.name} serves no HTTP door (start the proxy with --http-port)")
        return f"http://{self.host}:{self.http_port}"

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def log_tail(self, chars: int = 3000) -> str:
        return _tail(self.log_path, chars)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM (the process drains and exits), then SIGKILL after `timeout` seconds."""
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


LAUNCH: Callable[..., subprocess.Popen] = subprocess.Popen
"""How `start` runs a command when it is given no `popen`. The test suite sets it to fork
replicas from a process that already imported torch (tests/support/zygote.py), the one
thing that differs from a real start; the demo and the benchmarks spawn."""


def start(
    args: Sequence[str],
    workdir: str | Path,
    name: str,
    timeout: float = 120,
    *,
    probe: bool = False,
    host: str = "127.0.0.1",
    popen: Callable[..., subprocess.Popen] | None = None,
    cpus: Collection[int] = (),
) -> Service:
    """Run `rollwire <args> --ready-file ...`, logging to workdir/name.log, and wait until it
    serves. `probe`: also wait, within the same deadline, until a plaintext gRPC channel to it
    is ready (a server without TLS). `popen` and `host`: how to run it and where it listens,
    for a process in another network namespace (netlab's `Host.popen` and address; default
    LAUNCH). `cpus`:
    the cores it runs on (`pin`; empty: anywhere)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ready, log_path = workdir / f"{name}.ready.json", workdir / f"{name}.log"
    ready.unlink(missing_ok=True)
    with log_path.open("ab") as log:
        proc = (popen or LAUNCH)(rollwire_cmd(*args, "--ready-file", str(ready)), stdout=log, stderr=subprocess.STDOUT)
    pin(proc.pid, cpus)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}; see {log_path}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"{name} was not ready after {timeout:.0f}s; see {log_path}:\n{_tail(log_path)}")
        time.sleep(READY_POLL_S)
    info = json.loads(ready.read_text())
    service = Service(name, proc, info["port"], info["metrics_port"], log_path, host, info.get("http_port"))
    if probe:
        try:
            with grpc.insecure_channel(service.target) as channel:
                grpc.channel_ready_future(channel).result(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            service.kill()
            raise
    return service


def generator_args(model: str | Path, *extra: str) -> list[str]:
    """`rollwire generator` of `model` on free ports, then `extra` flags."""
    return ["generator", "--model", str(model), "--port", "0", "--metrics-port", "0", *extra]


def start_generators(
    model: str | Path,
    workdir: str | Path,
    names: Iterable[str],
    *extra: str,
    parallel: bool = False,
    probe: bool = False,
    cpus: Collection[int] = (),
    timeout: float = 120,
) -> list[Service]:
    """One replica per name. `parallel` starts them at once (each loads torch and the model:
    faster with spare cores, slower on two busy ones). If one fails, the others are stopped."""
    names = list(names)

    def one(name: str) -> Service:
        return start(generator_args(model, *extra), workdir, name, timeout, probe=probe, cpus=cpus)

    if not parallel:
        started: list[Service] = []
        try:
            for name in names:
                started.append(one(name))
        except BaseException:
            stop_all(started)
            raise
        return started
    with ThreadPoolExecutor(max(1, len(names))) as pool:
        futures = [pool.submit(one, name) for name in names]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        stop_all([f.result() for f in futures if f.exception() is None])
        raise failed[0]  # type: ignore[misc]
    return [f.result() for f in futures]


def start_proxy(
    workdir: str | Path,
    name: str,
    generators: Sequence[Service],
    *extra: str,
    probe: bool = False,
    cpus: Collection[int] = (),
) -> Service:
    """`rollwire proxy` on free ports in front of `generators`, then `extra` flags."""
    args = ["proxy", "--port", "0", "--metrics-port", "0", *(a for g in generators for a in ("--generator", g.target))]
    return start([*args, *extra], workdir, name, probe=probe, cpus=cpus)


def routable(proxy: Service) -> set[str]:
    """Addresses of the replicas the proxy routes to now (healthy ones)."""
    with grpc.insecure_channel(proxy.target) as channel:
        status = generator_pb2_grpc.GeneratorServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
    return {r.address for r in status.replicas if r.healthy}


def wait_routable(proxy: Service, replicas: Sequence[Service], timeout: float = 30) -> None:
    """Wait until the proxy routes to every one of `replicas`; TimeoutError naming its log."""
    want, deadline = {r.target for r in replicas}, time.monotonic() + timeout
    while not want <= routable(proxy):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{proxy.name} does not route to {sorted(want)} after {timeout:g}s; see {proxy.log_path}"
            )
        time.sleep(ROUTABLE_POLL_S)


def routing(proxy: Service, replicas: Sequence[Service], timeout: float = 30) -> Service:
    """`proxy`, once it routes to every one of `replicas`; if it does not in time, it is stopped
    and wait_routable's TimeoutError raised."""
    try:
        wait_routable(proxy, replicas, timeout)
    except BaseException:
        proxy.stop()
        raise
    return proxy


def stop_all(services: Iterable[Service], timeout: float = 20) -> None:
    """SIGTERM every one at once, then wait for each (a replica takes seconds to drain)."""
    services = list(services)
    for s in services:
        if s.proc.poll() is None:
            s.proc.terminate()
    for s in services:
        s.stop(timeout)


class VLLMServer:
    """A real vLLM OpenAI server started by a test (or a benchmark), as a user runs it beside
    rollwire: launch_argv's flags (LoRA on, processed logprobs), VLLM_CPU_ENV, runtime adapter loads,
    `names` as its served model names, launched from `python` (vLLM's own environment) on
    `cpus` (empty: anywhere). Its own process group, so `stop` ends every process it
    started (API server, engine core, worker) and only those."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        names: tuple[str, ...] = (),
        max_loras: int = 4,
        python: Path = Path(".venv-vllm/bin/python"),
        cpus: Collection[int] = (),
        extra_args: Sequence[str] = (),
    ) -> None:
        """`extra_args`: vLLM flags beyond these (a test's tool-call parser, say)."""
        from rollwire.generator.engines.served.engine import free_port
        from rollwire.generator.engines.served.vllm_engine import SERVER_MODULE, launch_argv

        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        argv = launch_argv(
            command=[str(python), "-m", SERVER_MODULE],
            model=str(model),
            host="127.0.0.1",
            port=self.port,
            max_lora_rank=16,
            max_loras=max_loras,
            dtype="float32",
            max_model_len=0,
            extra_args=[*(["--served-model-name", *names] if names else []), *extra_args],
        )
        env = {**os.environ, **VLLM_CPU_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        pin(self.proc.pid, cpus)  # its engine and worker processes inherit the cores

    def wait_healthy(self, timeout: float = 300) -> None:
        """Until /health answers 200 and a first token was generated (vLLM compiles its first
        batch then: ~15 s on CPU); raises with the end of its log if it exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not healthy after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as reply:
            model = json.loads(reply.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": [5], "max_tokens": 1, "temperature": 0.0}).encode()
        first = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(first, timeout=max(30.0, deadline - time.monotonic())):
            pass

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM the process group, then SIGKILL whatever of it is left after `grace_s` (or once the
        server exited: its engine and worker may outlive it)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):  # whatever of the group is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@dataclass
class Stack:
    """Replicas behind one proxy, all started by `start_stack`."""

    proxy: Service
    replicas: list[Service]
    workdir: Path

    @property
    def services(self) -> list[Service]:
        """In the order they started: the replicas, then the proxy."""
        return [*self.replicas, self.proxy]

    def stop(self) -> None:
        stop_all([self.proxy, *self.replicas])


def start_stack(
    model: str | Path,
    workdir: str | Path,
    replicas: int = 2,
    *,
    generator_args: Sequence[str] = (),
    proxy_args: Sequence[str] = (),
    prefix: str = "",
    routable_timeout: float | None = None,
    placement: Placement = Placement(),
    start_timeout: float = 120,
) -> Stack:
    """`replicas` replicas of `model` (one torch thread each, started at once, named
    `<prefix>generator-<i>` from 1, each given `start_timeout` seconds to serve) behind a proxy
    named `<prefix>proxy`, on the cores `placement` gives them; with `routable_timeout`,
    returned only once the proxy routes to every replica."""
    gens = start_generators(
        model, workdir, [f"{prefix}generator-{i}" for i in range(1, replicas + 1)], *ONE_THREAD, *generator_args,
        parallel=True, cpus=placement.replicas, timeout=start_timeout,
    )  # fmt: skip
    try:
        proxy = start_proxy(workdir, f"{prefix}proxy", gens, *proxy_args, cpus=placement.proxy)
    except BaseException:
        stop_all(gens)
        raise
    stack = Stack(proxy, gens, Path(workdir))
    if routable_timeout is not None:
        try:
            wait_routable(proxy, gens, routable_timeout)
        except BaseException:
            stack.stop()
            raise
    return stack


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]
