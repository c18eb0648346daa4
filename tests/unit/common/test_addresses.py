"""One address rule for every rollwire process (rollwire.common.addresses): what the proxy's
config, its admin API and a replica's relay-plan check accept is the same, and an address
written from a resolved IP is one they accept. Locality checked against this machine's
sockets: tests/integration/common/test_addresses_local.py."""

from __future__ import annotations

import pytest

from rollwire.common.addresses import (
    check_address,
    check_target,
    format_address,
    is_address,
    parse_dns_target,
    split_address,
)


@pytest.mark.parametrize("text", ["10.0.0.5:50051", "gen-0.gens.default.svc:1", "[::1]:65535", "a_b:80"])
def test_host_port_addresses_are_accepted(text):
    assert is_address(text) and check_address(text) == text and check_target(text) == text


@pytest.mark.parametrize(
    "text",
    ["", "host", "host:", ":50051", "host:0", "host:65536", "host:123456", "::1:50051", "a b:1", "h" * 254 + ":1"],
)
def test_anything_else_is_refused_with_a_sentence(text):
    assert not is_address(text)
    with pytest.raises(ValueError, match="is not a HOST:PORT address"):
        check_address(text)


def test_formatting_and_splitting_round_trip():
    for host, port in [("10.0.0.5", 50051), ("::1", 7), ("gen.svc", 1)]:
        address = format_address(host, port)
        assert is_address(address) and split_address(address) == (host, port)
    assert format_address("::1", 7) == "[::1]:7"


def test_dns_targets_name_every_address_a_name_resolves_to():
    assert parse_dns_target("dns:///gens.default.svc:50051") == ("gens.default.svc", 50051)
    assert check_target("dns:///gens:1") == "dns:///gens:1"
    with pytest.raises(ValueError, match="must look like dns:///NAME:PORT"):
        parse_dns_target("dns://gens:1")
    with pytest.raises(ValueError, match="is not a HOST:PORT address"):
        check_target("dns:///gens")


# -- which machine a host names (rollwire.runtime.hosts) -----------------------------------------
def test_peer_strings_and_literals_parse_to_one_ip_whatever_their_spelling():
    import ipaddress

    from rollwire.runtime.hosts import parse_ip, peer_ip

    v4, v6 = ipaddress.ip_address("10.1.2.3"), ipaddress.ip_address("fe80::1")
    assert peer_ip("ipv4:10.1.2.3:5051") == v4 == parse_ip(" 10.1.2.3 ")
    assert peer_ip("ipv6:[fe80::1%eth0]:5051") == v6 == parse_ip("[fe80::1%eth0]") == parse_ip("fe80::1")
    for junk in ("unix:/tmp/sock", "ipv4:", "ipv4:host.name:5", "ipv6:[zz::1]:5", "", "in-process", "ipv4:1.2.3.4"):
        assert peer_ip(junk) is None, junk
    assert parse_ip("gen-0.gens.svc") is None and parse_ip("") is None
