"""netlab: an emulated multi-host network on one Linux machine, for tests and benchmarks.

Every host is a network namespace with one interface, `eth0`, joined by a veth link to a
bridge that lives in the lab's own "switch" namespace. The process that builds the lab (the
root namespace: "the outside", e.g. a pusher or a test) is attached to the same bridge by a
veth link of its own, so it reaches every host at `Netlab.outside_ip`. Each link is shaped
in both directions (the host's upload and its download) by a token bucket (`tc tbf`, root
qdisc) whose child queue is `tc netem` (delay, random loss) where the kernel has sch_netem,
else a byte FIFO (`bfifo`, QUEUE_S of the rate deep). A cut link's child drops everything
(netem loss 100%, or a FIFO of 0 bytes).

    with Netlab(rate_mbit=200) as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        server = b.popen([sys.executable, "-m", "http.server", "--bind", b.ip, "8000"])
        ...  # a reaches b at b.ip, the outside reaches both; a.cut() silences a's link

Invariants:
- Only the lab's namespaces, the one veth link in the root namespace (`<prefix>o`) and its
  address are created; every address is inside one private /24 (10.213.X.0/24, X chosen so
  that it overlaps no address or route of the root namespace, under a lock shared by every
  lab on the machine). No namespace has a default route, nothing forwards or NATs: no packet
  of the lab leaves the machine.
- Every name starts with the lab's prefix `rwl<pid>-<seq>` (pid: the creating process), and
  /run/rollwire-netlab/<prefix>.json records that process's start time. A lab whose creator is
  dead (or whose pid now belongs to a younger process) is a leftover: a new Netlab, `sweep()`
  and `python -m support.netlab --sweep` delete it, processes inside it first. This covers
  a creator killed by SIGKILL.
- A lab is torn down exactly once, whatever the exit: `close()`, the end of its `with` block
  (an exception included), interpreter exit (atexit), or SIGINT/SIGTERM (the handler tears
  down, then runs the handler that was installed before it, so SIGTERM's default action still
  ends the process; a signal the process ignores leaves the lab alone). Teardown kills the
  processes the lab started (their process groups, then anything still inside its namespaces
  and any process carrying its marker in its environment), then deletes its namespaces and
  its link. Only the creating process tears down (not a forked child).
- A link's rate and `delay_ms` apply to each direction of that link: a packet between two
  hosts crosses two links, so its one-way delay is the sum of both links' delays. Delay and
  loss need sch_netem (`netem_available()`); without it, asking for them raises NetlabError
  rather than silently measuring something else.
- `Host.cut()` drops every packet of the link in both directions without answering (no RST,
  no ICMP): peers see silence and time out. `Host.heal()` restores the link's shaping.

Needs root, iproute2 (`ip`, `tc`) and the kernel's veth, bridge, sch_tbf and sch_fifo;
`available()` says whether this machine has them. Standard library only.
Command line (from tests/, or with tests/ on PYTHONPATH): `python -m support.netlab --sweep | --list |
--selftest [--rate MBIT]`. Not shipped: it lives with the tests; bench/ finds it through bench/common.py.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_DIR = Path("/run/rollwire-netlab")
"""Lock file and one <prefix>.json per live lab (its creator's pid and start time)."""
MARKER_ENV = "ROLLWIRE_NETLAB"
"""Set to the lab's prefix in the environment of every process a lab starts (found by sweeps)."""
SUBNET_BASE = "10.213"
NAME_RE = re.compile(r"^rwl(\d+)-(\d+)")
HOST_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
IFNAMSIZ = 15

# tbf: the bucket holds BURST_S of the rate (at least MIN_BURST bytes: a whole GSO packet of
# veth, so big packets are not split), and queues at most QUEUE_S of the rate before it drops.
BURST_S = 0.002
MIN_BURST = 64 * 1024
QUEUE_S = 0.05

_seq = 0
_seq_lock = threading.Lock()


def _next_prefix() -> str:
    global _seq
    with _seq_lock:
        _seq += 1
        return f"rwl{os.getpid()}-{_seq}"


# --------------------------------------------------------------------------- commands


class NetlabError(RuntimeError):
    """A command that builds or changes the lab failed; the message holds its stderr."""


def _cmd(argv: Sequence[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NetlabError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ip(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _cmd(["ip", *(("-n", ns) if ns else ()), *args], check=check)


def _tc(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _cmd(["tc", *(("-n", ns) if ns else ()), *args], check=check)


_probed: tuple[bool, str, bool] | None = None  # (ok, why not, netem too)


def available() -> tuple[bool, str]:
    """(True, "") when labs can be built here, else (False, why): root, `ip`, `tc`, and a
    throwaway namespace holding a bridge, a veth pair and the tbf + bfifo qdiscs. Whether
    delay and loss can be emulated too (sch_netem) is `netem_available()`. Probed once."""
    global _probed
    if _probed is None:
        netem: list[bool] = []
        ok, why = _probe(netem)
        _probed = (ok, why, ok and netem == [True])
    return _probed[0], _probed[1]


def require() -> None:
    """Skip the calling test where labs cannot be built here, or, under CI (CI=true), fail it,
    as support.vllm.require_vllm does: an unprivileged CI runner must not pass by skipping."""
    ok, why = available()
    if ok:
        return
    import pytest

    why = f"netlab cannot build namespaces here: {why}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; under CI the runner must be root with iproute2, so this is a failure, not a skip")
    pytest.skip(why)


def netem_available() -> bool:
    """Whether this kernel has sch_netem (delay and random loss); False where netlab is unavailable."""
    available()
    assert _probed is not None
    return _probed[2]


def _probe(netem: list[bool]) -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "netlab needs root (network namespaces)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"netlab needs iproute2: {', '.join(missing)} not found"
    probe = f"{_next_prefix()}-probe"
    try:
        _ip(None, "netns", "add", probe)
    except (NetlabError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot create a network namespace: {exc}"
    try:
        _ip(probe, "link", "add", "b0", "type", "bridge")
        _ip(probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        _ip(probe, "link", "set", "v0", "up")
        _tc(probe, "qdisc", "add", "dev", "v0", "root", "handle", "1:", *_tbf_args(100))
        _tc(probe, "qdisc", "add", "dev", "v0", "parent", "1:1", "handle", "10:", "bfifo", "limit", "0")
        netem.append(_tc(probe, "qdisc", "add", "dev", "v1", "root", *_netem_args(1, 0), check=False).returncode == 0)
    except (NetlabError, OSError, subprocess.TimeoutExpired) as exc:
        return False, f"namespaces work but veth, bridge or tbf do not: {exc}"
    finally:
        _ip(None, "netns", "del", probe, check=False)
    return True, ""


def _tbf_args(rate_mbit: float) -> list[str]:
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(int(rate_bytes * BURST_S), MIN_BURST)
    return ["tbf", "rate", f"{int(rate_mbit * 1000)}kbit", "burst", str(burst), "limit", str(_queue_bytes(rate_mbit))]


def _queue_bytes(rate_mbit: float) -> int:
    rate_bytes = rate_mbit * 1e6 / 8
    return int(rate_bytes * QUEUE_S) + max(int(rate_bytes * BURST_S), MIN_BURST)


def _netem_args(delay_ms: float, loss_pct: float, limit_packets: int = 10000) -> list[str]:
    return ["netem", "delay", f"{delay_ms:g}ms", "loss", f"{loss_pct:g}%", "limit", str(limit_packets)]


# --------------------------------------------------------------------------- liveness and sweep


def _start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot, or None if it does not exist or
    has exited (a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])  # field 22 of stat


def _creator_alive(prefix: str) -> bool:
    """Whether the process that made lab `prefix` still runs (the same process, not a reused pid)."""
    match = NAME_RE.match(prefix)
    if not match:
        return True  # not ours to judge
    pid = int(match.group(1))
    ticks = _start_ticks(pid)
    if ticks is None:
        return False
    try:
        recorded = json.loads((STATE_DIR / f"{prefix}.json").read_text())["start_ticks"]
    except (OSError, ValueError, KeyError):
        return True  # no record: only a dead pid proves a leftover
    return recorded == ticks


def _prefix_of(name: str) -> str | None:
    match = NAME_RE.match(name)
    return match.group(0) if match else None


def _netns_names() -> list[str]:
    out = _cmd(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _root_links() -> list[str]:
    out = _cmd(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _marked_pids(prefixes: set[str]) -> list[int]:
    """Processes whose environment carries MARKER_ENV=<one of prefixes>."""
    wanted = {f"{MARKER_ENV}={p}".encode() for p in prefixes}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted.intersection(env):
            found.append(int(entry.name))
    return found


def _kill_pids(pids: Sequence[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def _ns_pids(ns: str) -> list[int]:
    out = _cmd(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _remove(prefixes: set[str], namespaces: Sequence[str], links: Sequence[str]) -> None:
    """Kill every process inside `namespaces` or marked with one of `prefixes`, delete the
    links and namespaces, and forget the labs' records."""
    for _ in range(3):  # a process may fork while we kill; a few rounds catch its children
        pids = [p for ns in namespaces for p in _ns_pids(ns)] + _marked_pids(prefixes)
        if not pids:
            break
        _kill_pids(pids)
        time.sleep(0.05)
    for link in links:
        _ip(None, "link", "del", link, check=False)
    for ns in sorted(namespaces, key=lambda n: n.endswith("-sw")):  # hosts first, the switch last
        _ip(None, "netns", "del", ns, check=False)
    for prefix in prefixes:
        (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)


def leftovers() -> dict[str, list[str]]:
    """Namespaces and root links of labs whose creator is dead: {"netns": [...], "links": [...]}."""
    dead: dict[str, bool] = {}

    def is_dead(name: str) -> bool:
        prefix = _prefix_of(name)
        if prefix is None:
            return False
        if prefix not in dead:
            dead[prefix] = not _creator_alive(prefix)
        return dead[prefix]

    return {
        "netns": [n for n in _netns_names() if is_dead(n)],
        "links": [n for n in _root_links() if is_dead(n)],
    }


def sweep() -> dict[str, list[str]]:
    """Delete every leftover lab (its processes, namespaces, link and record); returns what
    was removed. Safe to run any time: live labs are never touched."""
    with _state_lock():
        found = leftovers()
        records = [p.stem for p in STATE_DIR.glob("rwl*.json")]
        prefixes = {_prefix_of(n) for n in [*found["netns"], *found["links"]]}
        prefixes |= {p for p in records if not _creator_alive(p)}
        prefixes.discard(None)
        _remove({p for p in prefixes if p}, found["netns"], found["links"])
    return found


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    """Machine-wide lock over building and sweeping labs (choosing a free subnet is a race)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    out = _cmd(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    nets += [ipaddress.ip_interface(m).network for m in re.findall(r"inet (\S+)", out)]
    out = _cmd(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    for line in out.splitlines():
        words = line.split()
        if not words:
            continue
        dest = words[1] if words[0] in ("local", "broadcast", "unicast", "multicast", "anycast") else words[0]
        if dest == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(dest, strict=False))
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    for x in range(256):
        net = ipaddress.IPv4Network(f"{SUBNET_BASE}.{x}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetlabError(f"no free /24 left in {SUBNET_BASE}.0.0/16")


# --------------------------------------------------------------------------- the lab


@dataclass(frozen=True)
class LinkShape:
    """A host link's rate (Mbit/s), added delay (ms) and random loss (%), each direction."""

    rate_mbit: float
    delay_ms: float
    loss_pct: float


class Host:
    """One emulated host: a namespace (None for the outside, the root namespace) with one
    shaped link to the lab's bridge. Processes started with `popen` are the lab's to kill."""

    def __init__(self, lab: Netlab, name: str, ns: str | None, ip: str, devices: list[tuple[str | None, str]]):
        self.lab, self.name, self.ns, self.ip = lab, name, ns, ip
        self._devices = devices  # (namespace, device): the host's end (its upload), the switch's end (its download)
        self.link = LinkShape(lab.rate_mbit, lab.delay_ms, lab.loss_pct)
        """The link's shape now (`shape` changes it)."""
        self._cut = False

    def __repr__(self) -> str:
        return f"Host({self.name!r}, ip={self.ip!r}, ns={self.ns!r})"

    # -- processes

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run inside this host (prefixed by `ip netns exec NS` unless outside)."""
        return [*(("ip", "netns", "exec", self.ns) if self.ns else ()), *map(str, argv)]

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start `argv` inside this host. Defaults to a new session (the lab kills its whole
        process group at teardown); the environment gets the lab's marker."""
        env = dict(kw.pop("env", None) or os.environ)
        env[MARKER_ENV] = self.lab.prefix
        kw.setdefault("start_new_session", True)
        return self.lab._track(subprocess.Popen(self.command(argv), env=env, **kw))

    def run(self, argv: Sequence[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside this host to completion; output captured as text."""
        env = {**os.environ, MARKER_ENV: self.lab.prefix}
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, check=check, env=env)

    # -- the link

    @property
    def is_cut(self) -> bool:
        return self._cut

    def shape(
        self, rate_mbit: float | None = None, delay_ms: float | None = None, loss_pct: float | None = None
    ) -> None:
        """Change the link's rate (Mbit/s, each direction), added delay (ms, each direction) or
        random loss (%, each direction); what is not given is kept. A cut link stays cut.
        Delay and loss need sch_netem (`netem_available()`); NetlabError otherwise."""
        new = LinkShape(
            self.link.rate_mbit if rate_mbit is None else rate_mbit,
            self.link.delay_ms if delay_ms is None else delay_ms,
            self.link.loss_pct if loss_pct is None else loss_pct,
        )
        _check_shape(new, self.lab.netem)
        old, self.link = self.link, new
        for ns, dev in self._devices:
            if new.rate_mbit != old.rate_mbit:
                _tc(ns, "qdisc", "change", "dev", dev, "root", "handle", "1:", *_tbf_args(new.rate_mbit))
            if not self._cut:
                _tc(ns, "qdisc", "change", "dev", dev, "parent", "1:1", "handle", "10:", *self._child_args())

    def set_rate(self, rate_mbit: float) -> None:
        """The link's rate in Mbit/s, each direction."""
        self.shape(rate_mbit=rate_mbit)

    def cut(self) -> None:
        """Drop every packet on this link, both ways, silently: no RST, no ICMP, no error
        to the peers; connections through it stall and time out."""
        for ns, dev in self._devices:
            _tc(ns, "qdisc", "change", "dev", dev, "parent", "1:1", "handle", "10:", *self._child_args(cut=True))
        self._cut = True

    def heal(self) -> None:
        """Undo `cut()`: the link's rate, delay and loss as before."""
        for ns, dev in self._devices:
            _tc(ns, "qdisc", "change", "dev", dev, "parent", "1:1", "handle", "10:", *self._child_args())
        self._cut = False

    def _child_args(self, cut: bool = False) -> list[str]:
        """The qdisc under the token bucket: netem (delay, loss) where the kernel has it, else a
        byte FIFO as deep as QUEUE_S of the rate; a cut is 100% loss or a FIFO of 0 bytes."""
        if self.lab.netem:
            return _netem_args(self.link.delay_ms, 100 if cut else self.link.loss_pct)
        return ["bfifo", "limit", "0" if cut else str(_queue_bytes(self.link.rate_mbit))]

    def _install(self) -> None:
        for ns, dev in self._devices:
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *_tbf_args(self.link.rate_mbit))
            _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *self._child_args())


def _check_shape(shape: LinkShape, netem: bool = True) -> None:
    if not shape.rate_mbit > 0:
        raise ValueError(f"rate_mbit must be > 0, not {shape.rate_mbit}")
    if shape.delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0, not {shape.delay_ms}")
    if not 0 <= shape.loss_pct <= 100:
        raise ValueError(f"loss_pct must be within 0-100, not {shape.loss_pct}")
    if (shape.delay_ms or shape.loss_pct) and not netem:
        raise NetlabError(
            "this kernel has no sch_netem: links can be rate-limited and cut, but delay and loss cannot be emulated"
        )


class Netlab:
    """A lab: a bridge, the outside's link to it, and hosts added with `add_host`.

    `rate_mbit`, `delay_ms` and `loss_pct` are every link's defaults (each direction);
    `outside_rate_mbit` shapes the outside's own link (default: `rate_mbit`). Built when
    constructed; torn down by `close()` (see the module's invariants for every other exit).
    `sweep_leftovers` first deletes labs whose creator died."""

    def __init__(
        self,
        rate_mbit: float = 200,
        delay_ms: float = 0,
        loss_pct: float = 0,
        outside_rate_mbit: float | None = None,
        sweep_leftovers: bool = True,
    ) -> None:
        ok, why = available()
        if not ok:
            raise NetlabError(f"netlab cannot run here: {why}")
        self.netem = netem_available()
        """Whether links emulate delay and loss (sch_netem); without it they are rate-limited only."""
        _check_shape(LinkShape(rate_mbit, delay_ms, loss_pct), self.netem)
        self.rate_mbit, self.delay_ms, self.loss_pct = rate_mbit, delay_ms, loss_pct
        self.prefix = _next_prefix()
        self.switch_ns = f"{self.prefix}-sw"
        self.outside_link = f"{self.prefix}o"
        if len(self.outside_link) > IFNAMSIZ:
            raise NetlabError(f"interface name {self.outside_link!r} is longer than {IFNAMSIZ} characters")
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self._closed = self._closing = False
        self._pending_signal: tuple[int, Any] | None = None
        self._previous: dict[int, Any] = {}
        self._namespaces: list[str] = []
        self._pid = os.getpid()  # a forked child inherits atexit and handlers: only the creator tears down
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build(outside_rate_mbit or rate_mbit, sweep_leftovers)
        except BaseException:
            self.close()
            raise

    # -- building

    def _build(self, outside_rate_mbit: float, sweep_leftovers: bool) -> None:
        if sweep_leftovers:
            sweep()
        with _state_lock():
            (STATE_DIR / f"{self.prefix}.json").write_text(
                json.dumps({"pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()), "created": time.time()})
            )
            self._add_netns(self.switch_ns)
            _ip(self.switch_ns, "link", "set", "lo", "up")
            _ip(self.switch_ns, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
            _ip(self.switch_ns, "link", "set", "br0", "up")
            self.subnet = _free_subnet()
            self._addresses = self.subnet.hosts()
            self.outside_ip = str(next(self._addresses))
            _ip(None, "link", "add", self.outside_link, "type", "veth", "peer", "name", "out", "netns", self.switch_ns)
            with contextlib.suppress(OSError):  # no IPv6 chatter on the outside's link
                Path(f"/proc/sys/net/ipv6/conf/{self.outside_link}/disable_ipv6").write_text("1")
            _ip(None, "addr", "add", f"{self.outside_ip}/{self.subnet.prefixlen}", "dev", self.outside_link)
        self.outside = Host(
            self, "outside", None, self.outside_ip, [(None, self.outside_link), (self.switch_ns, "out")]
        )
        self.outside.link = dataclasses.replace(self.outside.link, rate_mbit=outside_rate_mbit)
        self._attach(self.outside, "out", None, self.outside_link)

    def _add_netns(self, ns: str) -> None:
        self._namespaces.append(ns)  # before it exists: a failure right after still deletes it
        _ip(None, "netns", "add", ns)

    def _attach(self, host: Host, peer: str, ns: str | None, dev: str) -> None:
        _ip(self.switch_ns, "link", "set", peer, "master", "br0")
        _ip(self.switch_ns, "link", "set", peer, "up")
        _ip(ns, "link", "set", dev, "up")
        host._install()

    def add_host(
        self,
        name: str,
        rate_mbit: float | None = None,
        delay_ms: float | None = None,
        loss_pct: float | None = None,
    ) -> Host:
        """A new host `name` (lowercase letters, digits, - and _) with its own namespace
        (`<prefix>-<name>`), address and link; the link's shape defaults to the lab's."""
        if not HOST_NAME_RE.fullmatch(name) or name in ("sw", "probe", "outside"):
            raise ValueError(f"host name {name!r}: use 1-32 of a-z 0-9 - _ (not sw, probe or outside)")
        with self._lock:
            if self._closed:
                raise NetlabError("this lab is closed")
            if name in self.hosts:
                raise ValueError(f"host {name!r} already exists")
            ns, peer = f"{self.prefix}-{name}", f"h{len(self.hosts)}"
            ip = str(next(self._addresses))
            self._add_netns(ns)
            _ip(None, "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", peer, "netns", self.switch_ns)
            _ip(ns, "link", "set", "lo", "up")
            _ip(ns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0")
            host = Host(self, name, ns, ip, [(ns, "eth0"), (self.switch_ns, peer)])
            host.link = LinkShape(
                self.rate_mbit if rate_mbit is None else rate_mbit,
                self.delay_ms if delay_ms is None else delay_ms,
                self.loss_pct if loss_pct is None else loss_pct,
            )
            _check_shape(host.link, self.netem)
            self._attach(host, peer, ns, "eth0")
            self.hosts[name] = host
            return host

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # -- processes

    def _track(self, proc: subprocess.Popen) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                proc.kill()
                raise NetlabError("this lab is closed")
            self._procs.append(proc)
        return proc

    def _stop_processes(self, grace_s: float) -> None:
        """SIGTERM to the process group of every process still running, SIGKILL after `grace_s`.
        (Only unreaped processes are signalled, so a pid number is never one reused by another
        process; children of a leader that is already gone are found by the marker later.)"""
        running = [p for p in self._procs if p.poll() is None]
        for p in running:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        for p in running:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)

    # -- teardown

    def close(self, grace_s: float = 3.0) -> None:
        """Tear the lab down (idempotent): SIGTERM its processes, SIGKILL after `grace_s`,
        then delete its namespaces and link."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            if self._closed or self._closing:
                return
            self._closing = True
        try:
            self._stop_processes(grace_s)
            with _state_lock():
                _remove(
                    {self.prefix},
                    [ns for ns in self._namespaces if ns in _netns_names()],
                    [self.outside_link] if self.outside_link in _root_links() else [],
                )
        finally:
            self._closed = True
            self._restore_signal_handlers()
            atexit.unregister(self.close)
        if self._pending_signal:
            self._chain(*self._pending_signal)

    def __enter__(self) -> Netlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- signals

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; atexit and close() still apply
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN:
                continue  # the process chose to survive this signal: so does the lab
            self._previous[sig] = previous
            signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:  # someone installed theirs on top: keep chaining
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            self._chain(signum, frame)
            return
        if self._closing and not self._closed:  # teardown under way (maybe below us): finish it first
            self._pending_signal = (signum, frame)
            return
        self.close()
        self._chain(signum, frame)

    def _chain(self, signum: int, frame: Any) -> None:
        self._pending_signal = None
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the process group `proc` leads (the whole session popen started), else to `proc`.
    `proc` must not be reaped yet, so its pid is still its own."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)


# --------------------------------------------------------------------------- measuring

_RECEIVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
server.settimeout(float(sys.argv[3]))
conn, _ = server.accept()
conn.settimeout(float(sys.argv[3]))
size, got, buf = int(sys.argv[2]), 0, bytearray(1 << 20)
while got < size:
    n = conn.recv_into(buf)
    if not n:
        sys.exit("short")
    got += n
conn.sendall(b"k")
conn.close()
"""

_SENDER = """
import socket, sys, time
size = int(sys.argv[3])
block = memoryview(bytes(1 << 20))
start = time.perf_counter()
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
left = size
while left > 0:
    n = min(left, len(block))
    conn.sendall(block[:n])
    left -= n
assert conn.recv(1) == b"k"
print(time.perf_counter() - start, flush=True)
"""


def copy_time(src: Host, dst: Host, size: int, timeout: float = 120) -> float:
    """Seconds to send `size` bytes over one TCP connection from `src` to `dst`, from the
    connect call until the receiver acknowledged the last byte (one round trip more)."""
    receiver = dst.popen(
        [sys.executable, "-c", _RECEIVER, dst.ip, str(size), str(timeout)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert receiver.stdout is not None
        port = receiver.stdout.readline().strip()
        if not port:
            raise NetlabError(f"the receiver on {dst.name} did not start (exit {receiver.wait()})")
        out = src.run([sys.executable, "-c", _SENDER, dst.ip, port, str(size), str(timeout)], timeout=timeout)
        receiver.wait(timeout)
        return float(out.stdout.strip())
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


# --------------------------------------------------------------------------- command line


def _selftest(rate_mbit: float, size: int) -> int:
    ok, why = available()
    if not ok:
        print(f"netlab is not available here: {why}")
        return 1
    with Netlab(rate_mbit=rate_mbit) as lab:
        a, b = lab.add_host("a"), lab.add_host("b")
        print(
            f"lab {lab.prefix}: subnet {lab.subnet}, outside {lab.outside_ip}, a {a.ip}, b {b.ip}; {rate_mbit:g} Mbit/s links"
        )
        nominal = rate_mbit * 1e6 / 8
        for label, src, dst in (("outside -> a", lab.outside, a), ("a -> b", a, b), ("b -> outside", b, lab.outside)):
            seconds = copy_time(src, dst, size)
            rate = size / seconds
            print(
                f"  {label:13s} {size / 1e6:.1f} MB in {seconds:.3f} s: {rate / 1e6:.2f} MB/s = {rate / nominal:.0%} of the link"
            )
    print("torn down; leftovers:", leftovers())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m support.netlab", description=(__doc__ or "").splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--sweep", action="store_true", help="delete labs whose creating process is dead")
    group.add_argument("--selftest", action="store_true", help="build 2 hosts and print the throughput measured")
    group.add_argument("--list", action="store_true", help="print the leftovers without deleting them")
    parser.add_argument("--rate", type=float, default=200, help="link rate of the selftest, Mbit/s")
    parser.add_argument("--bytes", type=int, default=20_000_000, help="bytes copied per selftest transfer")
    args = parser.parse_args(argv)
    if args.list:
        print(json.dumps(leftovers(), indent=2))
        return 0
    if args.sweep:
        print(json.dumps(sweep(), indent=2))
        return 0
    return _selftest(args.rate, args.bytes)


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["Host", "Netlab", "NetlabError", "available", "copy_time", "leftovers", "sweep"]
