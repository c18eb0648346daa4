"""Member tokens bound so one replica cannot act as another (audit 2026-12-07 S6;
runtime/members.py): the proxy signs each member's address, a replica holds only public keys
and accepts its own address's token, so what one replica holds mints nothing another accepts.
Over real processes: tests/integration/proxy/test_proxy_security.py."""

from __future__ import annotations

import pytest

from rollwire.common.signing import SigningKey, TrustedKeys
from rollwire.runtime.members import MemberCheck, member_token, signed_member_token
from rollwire.runtime.security import ADMIN, MEMBER, TokenAuth


def trusting(*keys: SigningKey) -> TrustedKeys:
    return TrustedKeys({k.key_id: k.private.public_key() for k in keys})


def test_a_replica_accepts_the_proxys_signature_of_its_own_address_only():
    proxy, rogue = SigningKey.generate("proxy-1"), SigningKey.generate("proxy-1")
    check = MemberCheck(trusting(proxy), "10.0.0.5:50051")
    assert check(signed_member_token(proxy, "10.0.0.5:50051"))
    assert check(signed_member_token(proxy, "10.0.0.5:50051"))  # remembered
    assert not check(signed_member_token(proxy, "10.0.0.6:50051"))  # another member's: no good here
    assert not check(signed_member_token(rogue, "10.0.0.5:50051"))  # the same id, another key
    token = signed_member_token(proxy, "10.0.0.5:50051")
    for forged in (token[:-2] + "AA", token.replace("proxy-1", "proxy-2"), "rwm2.", "rwm2.proxy-1.!!", "rwm2.proxy-1"):
        assert not check(forged)


def test_what_a_replica_holds_mints_no_token_another_replica_accepts():
    """Before: HMAC(fleet key, address), so every replica, holding the key, minted every other's.
    A replica with a trust file accepts no fleet-key token at all."""
    proxy = SigningKey.generate("proxy-1")
    fleet_key = b"k" * 32
    auth = TokenAuth(set(), {"admin-token"})
    auth.accept_signed_members(MemberCheck(trusting(proxy), "10.0.0.6:50051"))
    minted = member_token(fleet_key, "10.0.0.6:50051")  # what a rogue replica holding the key computes
    assert auth.role([("authorization", f"Bearer {minted}")]) is None
    assert auth.role([("authorization", f"Bearer {signed_member_token(proxy, '10.0.0.6:50051')}")]) == MEMBER
    assert auth.role([("authorization", "Bearer admin-token")]) == ADMIN  # collateral: other roles unchanged


def test_a_member_key_file_that_is_no_signing_key_stops_the_process(tmp_path):
    from rollwire.runtime.members import read_signing_key, read_trusted

    bad = tmp_path / "key.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="upstream.member_signing_key_file"):
        read_signing_key(str(bad), "upstream.member_signing_key_file")
    with pytest.raises(SystemExit, match="auth.member_trust_file"):
        read_trusted(str(bad), "auth.member_trust_file")
    assert read_signing_key("", "x") is None and read_trusted("", "x") is None
