"""Several proxies, one truth (server/rollwire/proxy/publish/peers.py), with real processes: a push
never waits for a peer that is down, a peer that starts late gets every version it lacks from
the others, and a peer's copy is stored without a second fan-out and without a loop."""

from __future__ import annotations

import json
import time

import pytest
from support.processes import free_port, start_generators, start_service, stop_all, wait_routable, wait_until
from support.wire import fingerprint, make_adapter, metric_value

from rollwire.client import Client

NAME = "peered"


def spooled(workdir, proxy: str) -> list[int]:
    return sorted(int(f.stem) for f in (workdir / f"{proxy}-spool" / NAME).glob("*.json"))


def events(service, event: str) -> list[dict]:
    lines = service.log_path.read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e.get("event") == event]


def start_proxy(workdir, name: str, port: int, replica, peers: list[str]):
    args = ["proxy", "--port", str(port), "--metrics-port", "0", "--proxy-id", name, "--generator", replica.target]
    args += ["--spool-dir", str(workdir / f"{name}-spool"), "--set", "health.interval_s=0.2"]
    args += ["--set", "peers=" + json.dumps(peers), "--set", "peering.interval_s=0.2"]
    return start_service(args, workdir, name)


def test_a_late_peer_is_caught_up_and_peer_copies_are_not_fanned_out_again(tiny_model, tmp_path):
    (replica,) = start_generators(tiny_model, tmp_path, ["p1"], "--set", "grace_seconds=1")
    a_port, b_port = free_port(), free_port()
    both = [f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"]
    a = start_proxy(tmp_path, "a", a_port, replica, both)
    services = [replica, a]
    try:
        wait_routable(a, [replica])
        fp = fingerprint(replica.target)
        adapters = [make_adapter(tiny_model, seed=s) for s in (41, 42, 43)]
        with Client(a.target, timeout=60) as to_a:
            started = time.monotonic()
            for version in (1, 2):
                adapter = adapters[version - 1]
                to_a.push_adapter(NAME, version, adapter.payload, adapter.shape, fp)
            assert time.monotonic() - started < 20  # b is down: the pushes did not wait for it
        assert metric_value(a.metrics(), "rollwire_proxy_peer_synced", f'peer="{both[1]}"') == 0

        b = start_proxy(tmp_path, "b", b_port, replica, both)  # late, with an empty spool
        services.append(b)
        wait_until(lambda: spooled(tmp_path, "b") == [1, 2], 30, "a sent b every version b lacked")
        wait_until(
            lambda: metric_value(a.metrics(), "rollwire_proxy_peer_synced", f'peer="{both[1]}"') == 1,
            30,
            "a saw b synced",
        )
        b_pushes = metric_value(
            b.metrics(), "rollwire_proxy_replica_pushes_total", f'replica="{replica.target}",code="OK"'
        )
        assert b_pushes == 0  # b stored a's copies; it did not fan them out to the replica again

        with Client(b.target, timeout=60) as to_b:
            reply = to_b.push_adapter(NAME, 3, adapters[2].payload, adapters[2].shape, fp)
        assert reply.version == 3 and spooled(tmp_path, "a") == [1, 2, 3]  # in a's spool before b returned
        received = [(e["peer"], e["version"]) for e in events(a, "adapter_received_from_peer")]
        assert received == [("b", 3)]  # b's push reached a once...
        sent_back = [e["version"] for e in events(b, "adapter_received_from_peer")]
        assert 3 not in sent_back  # ...and a did not send it back (no loop)
        assert [e["peer"] for e in events(a, "peer_is_this_proxy")] == [both[0]]  # each skips itself
        with Client(both, timeout=60) as anywhere:
            assert {anywhere.generate("x", adapter=NAME, max_new_tokens=2).adapter.version for _ in range(4)} == {3}
    finally:
        stop_all(services)


pytestmark = pytest.mark.integration  # starts processes: not in make test-fast
