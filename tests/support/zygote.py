"""Replicas forked from a process that already imported torch and transformers (a "zygote").

Importing torch and transformers' model classes is most of a replica's start-up here (~5 CPU
seconds of ~6, docs/benchmarks.md §16), and the suite starts dozens of replicas. The zygote
imports them once, then forks one child per `rollwire generator`, `learner` or `proxy` command; the child runs the
same `rollwire.client.cli.main` a spawned process would, with the caller's argv, environment,
working directory and log file, so the replica under test is the real program, only started
from warm memory. Everything else (engine servers, TRL, other commands) is spawned as before.

Invariants:
- the zygote never runs a torch operation and starts no thread of its own before forking, so
  a child starts from a single-threaded image (as PyTorch's own fork-based data loaders do);
- a child is a real process: its pid takes signals (SIGKILL, SIGSTOP), it has its own ports and
  log; its exit code is kept by the zygote, which reaps it, and read back by `Forked.poll`;
- the zygote dies with the test session (it polls its parent and exits when it is gone), and
  a failure to start it falls back to spawning, said once on stderr;
- ROLLWIRE_TESTS_FORK=0 turns it off.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

FORKED_COMMANDS = frozenset({"generator", "learner", "proxy"})
"""`rollwire` commands started from the zygote: replicas and learners, whose start is mostly
importing torch, transformers and peft (~5 CPU seconds), and proxies (~1 s of imports each,
but the suite starts more of them than of anything else)."""
REAP_EVERY_S = 0.02


# -- the test process's side ----------------------------------------------------------------
class Forked:
    """The handle of a forked replica, with the subprocess.Popen methods the tests use."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None
        self.stdout = self.stderr = self.stdin = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(REAP_EVERY_S)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


class Zygote:
    """The client of one zygote process, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._file = None
        self.broken = os.environ.get("ROLLWIRE_TESTS_FORK", "1") == "0"

    def popen(self, cmd: Sequence[str], stdout=None, stderr=None, **kwargs) -> subprocess.Popen | Forked:
        """subprocess.Popen's signature: a `rollwire generator` command is forked from the
        zygote (its output to `stdout`'s file), anything else is spawned."""
        argv = list(cmd)
        forkable = (
            not self.broken
            and not kwargs
            and argv[1:3] == ["-m", "rollwire.client.cli"]
            and len(argv) > 3
            and argv[3] in FORKED_COMMANDS
            and stdout is not None
            and hasattr(stdout, "fileno")
            and stderr in (subprocess.STDOUT, stdout)
        )
        if forkable:
            try:
                return self._fork(argv, stdout)
            except (OSError, ValueError, RuntimeError) as exc:
                self.broken = True
                print(f"support.zygote: forking replicas is off for this run ({exc}); spawning them", file=sys.stderr)
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, **kwargs)

    def _fork(self, argv: list[str], log) -> Forked:
        with self._lock:
            self._ensure()
            log_path = os.readlink(f"/proc/self/fd/{log.fileno()}")
            reply = self._ask(
                {"op": "fork", "argv": argv[3:], "env": dict(os.environ), "cwd": os.getcwd(), "log": log_path}
            )
        return Forked(self, int(reply["pid"]), argv)

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            if self._sock is None:
                return None
            return self._ask({"op": "status", "pid": pid})["code"]

    def _ask(self, message: dict) -> dict:
        assert self._sock is not None and self._file is not None
        self._sock.sendall(json.dumps(message).encode() + b"\n")
        line = self._file.readline()
        if not line:
            raise RuntimeError("the zygote closed its socket")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def _ensure(self) -> None:
        if self._sock is not None:
            return
        folder = Path(tempfile.mkdtemp(prefix="rollwire-zygote-"))
        path = folder / "socket"
        self._proc = subprocess.Popen(
            [sys.executable, __file__, str(path), str(os.getpid())], stdin=subprocess.DEVNULL, stderr=None
        )
        deadline = time.monotonic() + 120
        while not path.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the zygote did not start (exit code {self._proc.poll()})")
            time.sleep(0.05)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        self._sock, self._file = sock, sock.makefile("rb")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()


ZYGOTE = Zygote()


# -- the zygote's side -----------------------------------------------------------------------
def _preload() -> None:
    """What a replica, a learner and a proxy import before they serve (the expensive part of
    their start). Imports only: nothing here may run a torch operation or start a thread."""
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import rollwire.client.cli
    import rollwire.generator.app
    import rollwire.generator.cli
    import rollwire.generator.engines.embedded.transformers_engine
    import rollwire.learner.cli
    import rollwire.learner.run.loop
    import rollwire.learner.run.wiring
    import rollwire.learner.train.trainer
    import rollwire.proxy.app
    import rollwire.proxy.cli  # noqa: F401


def _child(request: dict, listener: socket.socket, clients: list[socket.socket]) -> None:
    """In the forked child: become the `rollwire` process the request describes; never returns."""
    code = 1
    try:
        listener.close()
        for c in clients:
            c.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # as a freshly started Python has them
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        import random

        import torch

        import rollwire.client.cli
        from rollwire.client.cli import main

        sys.argv = [rollwire.client.cli.__file__, *request["argv"]]
        random.seed()  # a spawned process draws its own seeds; a fork would share the zygote's
        torch.seed()

        code = int(main(request["argv"]) or 0)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str, parent: int) -> None:
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(4)
    os.rename(path + ".tmp", path)
    clients: list[socket.socket] = []
    buffers: dict[socket.socket, bytes] = {}
    codes: dict[int, int] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener, *clients], [], [], 0.2)
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            codes[pid] = os.waitstatus_to_exitcode(status)
        for s in readable:
            if s is listener:
                conn, _ = listener.accept()
                clients.append(conn)
                buffers[conn] = b""
                continue
            data = s.recv(1 << 20)
            if not data:
                clients.remove(s)
                s.close()
                continue
            buffers[s] += data
            while b"\n" in buffers[s]:
                line, buffers[s] = buffers[s].split(b"\n", 1)
                request = json.loads(line)
                if request["op"] == "fork":
                    pid = os.fork()
                    if pid == 0:
                        _child(request, listener, clients)
                    reply = {"pid": pid}
                elif request["op"] == "status":
                    pid = request["pid"]
                    if pid not in codes:  # it may have ended since the last reaping
                        try:
                            done, status = os.waitpid(pid, os.WNOHANG)
                        except ChildProcessError:
                            done, status = 0, 0
                        if done:
                            codes[pid] = os.waitstatus_to_exitcode(status)
                    reply = {"code": codes.get(pid)}
                else:
                    reply = {"error": f"unknown op {request['op']!r}"}
                s.sendall(json.dumps(reply).encode() + b"\n")


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
