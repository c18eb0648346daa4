"""netlab: hosts in network namespaces behind shaped links, torn down whatever the exit.

Skipped, with netlab's own reason, where namespaces cannot be built (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import netlab
from support.netlab import Netlab, copy_time

pytestmark = pytest.mark.integration

# The lab lives in tests/support, so a child that imports it needs tests/ on its path.
TESTS_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])
    ),
}

ECHO_SERVER = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
def echo(conn):
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)
while True:
    conn, _ = server.accept()
    threading.Thread(target=echo, args=(conn,), daemon=True).start()
"""

CHILD_LAB = """
import json, subprocess, sys, time
from support.netlab import Netlab
lab = Netlab(rate_mbit=100)
host = lab.add_host("a")
inside = host.popen(["sleep", "300"])
outside = lab.outside.popen(["sleep", "300"])
print(json.dumps({"prefix": lab.prefix, "pids": [inside.pid, outside.pid]}), flush=True)
time.sleep(300)
"""


@pytest.fixture(autouse=True, scope="module")
def _needs_netlab():
    netlab.require()  # a skip here, a failure under CI


@pytest.fixture
def lab():
    with Netlab(rate_mbit=50) as lab:
        yield lab


def _names(prefix: str) -> list[str]:
    """Namespaces and root-namespace links whose name starts with `prefix`."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [n for n in namespaces if n.startswith(prefix)] + [
        line.split(":")[1].strip() for line in links.splitlines() if line.split(":")[1].strip().startswith(prefix)
    ]


def _gone(pid: int, wait_s: float = 3.0) -> bool:
    """Whether process `pid` is dead (a zombie no one reaped counts as dead) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _echo(conn: socket.socket, data: bytes) -> bytes:
    conn.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = conn.recv(len(data) - len(got))
        assert chunk, "the connection closed"
        got += chunk
    return got


def test_hosts_reach_each_other_and_the_outside_and_nothing_else(lab):
    a, b = lab.add_host("a"), lab.add_host("b")
    assert len({a.ip, b.ip, lab.outside_ip}) == 3
    assert all(ip.startswith(str(lab.subnet.network_address)[:-1]) for ip in (a.ip, b.ip, lab.outside_ip))
    for src, dst in ((a, b), (b, a), (lab.outside, a), (b, lab.outside)):
        assert copy_time(src, dst, 10_000, timeout=10) < 5
    # no route out of the lab: an address beyond it is unreachable at once from inside a host
    probe = "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=2)\nexcept OSError as e:\n    print(e.errno)"
    assert a.run([sys.executable, "-c", probe]).stdout.strip() == "101"  # ENETUNREACH


def test_links_are_shaped_both_ways(lab):
    a = lab.add_host("a")
    nominal = 50e6 / 8
    seconds = copy_time(lab.outside, a, 4_000_000)  # a's download (and the outside's upload)
    assert 0.75 < 4_000_000 / seconds / nominal < 1.25, f"{4e6 / seconds / 1e6:.2f} MB/s on a 50 Mbit/s link"
    a.set_rate(20)  # a's upload is now the narrowest link
    seconds = copy_time(a, lab.outside, 2_000_000)
    assert 0.75 < 2_000_000 / seconds / (20e6 / 8) < 1.25, f"{2e6 / seconds / 1e6:.2f} MB/s on a 20 Mbit/s link"


def test_cut_is_silent_and_heal_restores(lab):
    b = lab.add_host("b")
    server = b.popen([sys.executable, "-c", ECHO_SERVER, b.ip], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    old = socket.create_connection((b.ip, port), timeout=5)
    assert _echo(old, b"before") == b"before"
    b.cut()
    assert b.is_cut
    with pytest.raises(TimeoutError):  # silence, not ConnectionRefusedError (RST)
        socket.create_connection((b.ip, port), timeout=0.5)
    old.settimeout(0.5)
    old.sendall(b"during")
    with pytest.raises(TimeoutError):  # not ConnectionResetError: the peer never hears of the cut
        old.recv(100)
    b.heal()
    with socket.create_connection((b.ip, port), timeout=5) as new:
        assert _echo(new, b"after") == b"after"
    old.settimeout(10)  # the bytes sent during the cut arrive by TCP retransmission
    assert old.recv(100) == b"during"
    old.close()


def test_an_exception_in_the_block_leaves_nothing_behind():
    with pytest.raises(RuntimeError, match="boom"), Netlab(rate_mbit=100) as lab:
        a = lab.add_host("a")
        procs = [a.popen(["sleep", "300"]), lab.outside.popen(["sleep", "300"])]
        prefix = lab.prefix
        assert len(_names(prefix)) == 3  # the switch, host a, and the outside's link
        raise RuntimeError("boom")
    assert _names(prefix) == []
    assert all(p.poll() is not None for p in procs)
    assert not (netlab.STATE_DIR / f"{prefix}.json").exists()


def _start_child() -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen([sys.executable, "-c", CHILD_LAB], stdout=subprocess.PIPE, text=True, env=TESTS_ENV)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, f"the child lab failed (exit {child.wait()})"
    return child, json.loads(line)


def test_a_killed_creator_leaves_leftovers_that_the_next_lab_and_sweep_remove():
    for remover in ("next lab", "--sweep"):
        child, info = _start_child()
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert len(_names(info["prefix"])) == 3, "SIGKILL leaves the lab in place"
        assert info["prefix"] + "-a" in netlab.leftovers()["netns"]
        if remover == "next lab":
            Netlab(rate_mbit=100).close()
        else:
            out = subprocess.run(
                [sys.executable, "-m", "support.netlab", "--sweep"],
                capture_output=True,
                text=True,
                check=True,
                env=TESTS_ENV,
            )
            assert info["prefix"] + "-a" in out.stdout
        assert _names(info["prefix"]) == [], remover
        assert all(_gone(pid) for pid in info["pids"]), f"{remover} left the lab's processes running"


def test_sigterm_tears_down_then_terminates():
    child, info = _start_child()
    child.send_signal(signal.SIGTERM)
    assert child.wait(10) == -signal.SIGTERM  # the handler chained to the default action
    assert _names(info["prefix"]) == []
    assert all(_gone(pid) for pid in info["pids"])


def test_leftover_check_respects_live_labs(lab):
    lab.add_host("a")
    assert not any(n.startswith(lab.prefix) for names in netlab.leftovers().values() for n in names)
    netlab.sweep()
    assert len(_names(lab.prefix)) == 3
    assert os.getpid() == int(netlab.NAME_RE.match(lab.prefix).group(1))  # type: ignore[union-attr]
