"""A client that outlives a proxy: real replicas, real proxies killed with SIGKILL, real SDK
clients (sync threads and asyncio tasks) sampling in a loop while adapters are pushed.

What must hold (docs/deploy.md, "Several proxies"):
- no request fails: a connection failure is retried within the call's deadline, a stream cut
  mid-group starts over (the client sees at most `Restarted` events);
- each client's adapter versions never go backwards, across the restart or the move to the
  other proxy;
- every replica ends on the last pushed version, and so does every surviving proxy's spool.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.processes import free_ports, start_generators, start_service, stop_all, wait_routable, wait_until
from support.wire import fingerprint, make_adapter, status

from rollwire.client import AsyncClient, Client, RollwireError
from rollwire.common.keepalive import Keepalive

CLIENTS = 8
"""Half threads with `Client`, half asyncio tasks with `AsyncClient`."""
FAST = Keepalive(time_s=1.0, timeout_s=1.0)
"""Short keepalive so a killed proxy's streams are seen broken at once even if no RST came."""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("failover-client")


@pytest.fixture(scope="module")
def replicas(tiny_model, workdir):
    reps = start_generators(tiny_model, workdir, ["r1", "r2"], "--set", "grace_seconds=1")
    yield reps
    stop_all(reps)


@pytest.fixture(scope="module")
def adapters(tiny_model):
    """Three real adapters; version v carries adapters[v % 3] (a version's bytes never change)."""
    return [make_adapter(tiny_model, seed=70 + i) for i in range(3)]


def start_proxy(workdir: Path, name: str, replicas, *extra: str, port: int = 0, spool: Path | None = None):
    args = ["proxy", "--port", str(port), "--metrics-port", "0", "--proxy-id", name, "--set", "health.interval_s=0.2"]
    args += ["--spool-dir", str(spool or workdir / f"{name}-spool")]
    for r in replicas:
        args += ["--generator", r.target]
    return start_service([*args, *extra], workdir, name)


@dataclass
class Load:
    """Clients sampling in a loop and a pusher, until `stop`; what each saw."""

    name: str
    """The adapter name of this run (each test its own: the replicas are shared)."""
    targets: list[str]
    adapters: list
    fp: str
    stop: threading.Event = field(default_factory=threading.Event)
    versions: dict[int, list[int]] = field(default_factory=dict)
    restarts: int = 0
    errors: list = field(default_factory=list)
    pushed: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def done(self, client: int, version: int, restarts: int) -> None:
        with self.lock:
            self.versions.setdefault(client, []).append(version)
            self.restarts += restarts

    def count(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.versions.values())

    def sync_client(self, i: int) -> None:
        with Client(self.targets, timeout=60, keepalive=FAST) as client:
            while not self.stop.is_set():
                try:
                    r = client.generate(f"c{i}: ", n=2, max_new_tokens=8, adapter=self.name, seed=i)
                except RollwireError as exc:
                    self.errors.append((i, exc))
                    return
                self.done(i, r.adapter.version, r.restarts)

    async def async_clients(self, first: int, count: int) -> None:
        async with AsyncClient(self.targets, timeout=60, keepalive=FAST) as client:

            async def one(i: int) -> None:
                while not self.stop.is_set():
                    try:
                        r = await client.generate(f"c{i}: ", n=2, max_new_tokens=8, adapter=self.name, seed=i)
                    except RollwireError as exc:
                        self.errors.append((i, exc))
                        return
                    self.done(i, r.adapter.version, r.restarts)

            await asyncio.gather(*(one(i) for i in range(first, first + count)))

    def push(self, client: Client, version: int) -> None:
        a = self.adapters[version % len(self.adapters)]
        reply = client.push_adapter(self.name, version, a.payload, a.shape, self.fp, timeout=90)
        assert reply.version == version
        self.pushed.append(version)

    def run(self, during) -> None:
        """Push v1, start the clients, run `during(pusher client)`, stop and join them."""
        with Client(self.targets, timeout=90, keepalive=FAST) as pusher:
            self.push(pusher, 1)
            half = CLIENTS // 2
            threads = [threading.Thread(target=self.sync_client, args=(i,)) for i in range(half)]
            threads.append(threading.Thread(target=lambda: asyncio.run(self.async_clients(half, CLIENTS - half))))
            for t in threads:
                t.start()
            try:
                during(pusher)
            finally:
                self.stop.set()
                for t in threads:
                    t.join(120)
        assert not any(t.is_alive() for t in threads), "a client did not finish within 120 s"

    def wait_each(self, more: int, timeout: float = 120) -> None:
        """Until every client completed `more` groups after now (or one failed)."""
        with self.lock:
            want = {i: len(self.versions.get(i, [])) + more for i in range(CLIENTS)}

        def done() -> bool:
            with self.lock:
                return all(len(self.versions.get(i, [])) >= n for i, n in want.items())

        wait_until(lambda: done() or self.errors, timeout, f"every client sampled {more} more groups")

    def check(self, replicas, proxies) -> None:
        assert self.errors == [], f"failed requests: {self.errors[:3]}"
        assert len(self.versions) == CLIENTS and all(len(v) >= 3 for v in self.versions.values())
        for client, seen in self.versions.items():
            assert seen == sorted(seen), f"client {client} saw versions go backwards: {seen}"
        last = self.pushed[-1]
        assert self.pushed == list(range(1, last + 1))
        for r in replicas:
            held = {a.name: list(a.versions) for a in status(r.target).adapters}
            assert held[self.name][-1] == last, f"{r.name} holds {held}"
        for p in proxies:
            spooled = sorted(int(f.stem) for f in (p.spool / self.name).glob("*.json"))
            assert spooled and spooled[-1] == last, f"{p.name}'s spool holds {spooled}"


@dataclass
class Proxy:
    service: object
    spool: Path

    @property
    def name(self) -> str:
        return self.service.name


def test_one_proxy_killed_and_restarted_on_its_port_loses_no_request(replicas, adapters, workdir):
    spool = workdir / "one-spool"
    proxy = start_proxy(workdir, "one", replicas, spool=spool)
    wait_routable(proxy, replicas)
    load = Load("failover-one", [proxy.target], adapters, fingerprint(replicas[0].target))
    restarted = []

    def during(pusher: Client) -> None:
        load.push(pusher, 2)
        load.wait_each(1)
        proxy.kill()  # SIGKILL mid-load: streams break, connections are refused until it is back
        killed = time.monotonic()
        back = start_proxy(workdir, "one-again", replicas, port=proxy.port, spool=spool)
        restarted.append(back)
        load.push(pusher, 3)  # through the restarted proxy, from its reloaded spool
        load.wait_each(2)
        load.push(pusher, 4)
        load.wait_each(1)
        print(f"proxy back and serving {time.monotonic() - killed:.1f}s after the kill")

    try:
        load.run(during)
        load.check(replicas, [Proxy(restarted[0], spool)])
    finally:
        stop_all([proxy, *restarted])
    print(f"one proxy: {load.count()} groups, restarts seen {load.restarts}, versions {load.pushed}")


def test_two_proxies_one_killed_for_good_loses_no_request(replicas, adapters, workdir):
    a_port, b_port = free_ports(2)
    peers = ("--set", f'peers=["127.0.0.1:{a_port}","127.0.0.1:{b_port}"]')  # each lists both: itself is skipped
    a = start_proxy(workdir, "a", replicas, *peers, port=a_port)
    b = start_proxy(workdir, "b", replicas, *peers, port=b_port)
    proxies = [Proxy(a, workdir / "a-spool"), Proxy(b, workdir / "b-spool")]
    try:
        for p in (a, b):
            wait_routable(p, replicas)
        wait_until(lambda: peer_synced(a) and peer_synced(b), 30, "each proxy has synced its peer")
        load = Load("failover-two", [a.target, b.target], adapters, fingerprint(replicas[0].target))

        def during(pusher: Client) -> None:
            load.push(pusher, 2)
            for v in (1, 2):  # in both spools as soon as the push returned
                assert all((p.spool / load.name / f"{v}.json").exists() for p in proxies)
            load.wait_each(1)
            load.push(pusher, 3)
            a.kill()  # for good: clients and the pusher move to b
            load.wait_each(2)
            load.push(pusher, 4)
            load.wait_each(1)

        load.run(during)
        load.check(replicas, proxies[1:])
        assert sorted(int(f.stem) for f in (proxies[0].spool / load.name).glob("*.json"))[-1] >= 3
        print(f"two proxies: {load.count()} groups, restarts seen {load.restarts}, versions {load.pushed}")
    finally:
        stop_all([a, b])


def peer_synced(proxy) -> bool:
    lines = [x for x in proxy.metrics().splitlines() if x.startswith("rollwire_proxy_peer_synced{")]
    return bool(lines) and any(float(x.split()[-1]) == 1.0 for x in lines)


pytestmark = pytest.mark.integration  # starts processes: not in make test-fast
