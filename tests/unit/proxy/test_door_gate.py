"""The HTTP door's connection gate at its limit (issue 51's flood): a newcomer takes the place of
an idle connection of the peer holding the most, never of a peer holding no more than it would,
never of a connection in a request. Pure (edge.connections.Gate); the flood itself, on a real
proxy: tests/integration/proxy/test_listener_budgets.py."""

from __future__ import annotations

from rollwire.proxy.http.edge.connections import Gate
from rollwire.serving.scaffold import connection_budget


def filled(gate: Gate, peer: str, count: int, closed: list[str]) -> list:
    slots = [gate.admit(peer) for _ in range(count)]
    for i, slot in enumerate(slots):
        assert slot is not None
        slot.evict = lambda i=i: closed.append(f"{peer}#{i}")
    return slots


def test_at_the_limit_a_newcomer_displaces_the_oldest_idle_connection_of_the_largest_peer():
    gate, closed = Gate(6, 100), []
    filled(gate, "flood-1", 4, closed)
    filled(gate, "flood-2", 2, closed)
    assert gate.full()
    probe = gate.admit("probe")
    assert probe is not None and closed == ["flood-1#0"] and gate.open == 6
    assert dict(gate.by_peer) == {"flood-1": 3, "flood-2": 2, "probe": 1}
    # the flood's own newcomer gains nothing: no peer holds more than it would
    assert gate.admit("flood-2") is None and gate.admit("flood-1") is None and len(closed) == 1


def test_a_connection_in_a_request_never_gives_way_and_fresh_idle_ones_go_before_served_ones():
    gate, closed = Gate(4, 100), []
    slots = filled(gate, "big", 4, closed)
    slots[0].idle = False  # its request is being read or served
    slots[1].served = True  # idle between two requests (keep-alive)
    assert gate.admit("p1") is not None and closed == ["big#2"]
    assert gate.admit("p2") is not None and closed == ["big#2", "big#3"]
    assert gate.admit("p3") is not None and closed[-1] == "big#1"  # the served one, once no fresh one is left
    assert gate.admit("p4") is None  # big's one left is busy, and holds no more than p4 would
    slots[0].release()
    assert gate.admit("p4") is not None and len(closed) == 3  # room: no one displaced


def test_a_released_slot_is_counted_once_whoever_releases_it_first():
    gate, closed = Gate(2, 100), []
    a = filled(gate, "a", 2, closed)
    b = gate.admit("b")
    assert b is not None and closed == ["a#0"]
    a[0].release()  # its connection_lost, after the gate freed it already
    assert (gate.open, dict(gate.by_peer)) == (2, {"a": 1, "b": 1})


def test_the_per_peer_cap_bites_before_the_limit():
    gate, closed = Gate(10, 2), []
    filled(gate, "a", 2, closed)
    assert gate.admit("a") is None and not gate.full()


def test_the_grpc_ports_budget_is_at_most_a_quarter_of_the_descriptor_limit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_budget(10**9) == (10**9 if soft == resource.RLIM_INFINITY else soft // 4)
    assert connection_budget(3) == 3
