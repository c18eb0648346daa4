"""The unit tier's one promise, enforced: a test under tests/unit starts no process and opens no
socket, in its fixtures' setup and teardown as much as in its body. Each phase of each unit test
runs with process starts (subprocess, fork, posix_spawn), socket binds and connects, and gRPC
servers made to raise UnitTierViolation, whose message names the test and says where it belongs
(tests/integration/). Sockets made by socketpair (an event loop's self-pipe) are untouched."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest


class UnitTierViolation(RuntimeError):
    """A unit test started a process or opened a socket."""


@contextlib.contextmanager
def _no_processes_no_sockets(nodeid: str) -> Iterator[None]:
    def refuse(what: str):
        def raiser(*args, **kwargs):
            raise UnitTierViolation(
                f"{nodeid} {what} in the unit tier (no processes, no sockets): "
                "move it to tests/integration/ (docs/testing.md)"
            )

        return raiser

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", refuse("started a process"))
        mp.setattr(os, "fork", refuse("forked"))
        mp.setattr(os, "posix_spawn", refuse("spawned a process"))
        mp.setattr(socket.socket, "bind", refuse("bound a socket"))
        mp.setattr(socket.socket, "connect", refuse("connected a socket"))
        mp.setattr(grpc, "server", refuse("made a gRPC server"))
        mp.setattr(grpc.aio, "server", refuse("made a gRPC server"))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _no_processes_no_sockets(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _no_processes_no_sockets(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    with _no_processes_no_sockets(item.nodeid):
        return (yield)
