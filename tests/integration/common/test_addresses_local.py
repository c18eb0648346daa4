"""A host resolves to its IPs, and only this machine's are local (rollwire.runtime.hosts: a
bind on the machine's own sockets decides)."""

from __future__ import annotations


async def test_a_host_resolves_to_its_ips_and_only_this_machine_s_are_local():
    import ipaddress
    import socket

    from rollwire.runtime.hosts import is_local_ip, resolve_ips

    loopback = ipaddress.ip_address("127.0.0.1")
    assert loopback in await resolve_ips("localhost")
    assert await resolve_ips("[::1]") == {ipaddress.ip_address("::1")}
    for nowhere in ("no-such-host.invalid", "a" * 300, "\udcff", "bad..name"):
        assert await resolve_ips(nowhere) == set(), nowhere
    assert is_local_ip(loopback) and is_local_ip(ipaddress.ip_address("0.0.0.0"))
    assert not is_local_ip(ipaddress.ip_address("192.0.2.7"))  # TEST-NET-1: no machine's address
    # An interface address of this machine (not loopback) is local: the one a UDP socket would leave from.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.7", 9))  # no packet is sent: this only picks the source address
        except OSError:
            return  # no route off loopback here: nothing more to check
        own = ipaddress.ip_address(probe.getsockname()[0])
    assert own.is_loopback or is_local_ip(own)
