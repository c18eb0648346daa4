"""Tenants' names and tokens (proxy/tenants.py, runtime/security.py): a tenant's names are
qualified so that no name it can give spells another tenant's or a shared one, each sees its
own names back, and a token maps to at most one tenant, whichever way it is presented."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollwire.common.errors import InvalidArgument
from rollwire.common.manifest import NAME_RE, QUALIFIED_RE, name_ok
from rollwire.proxy.config import ProxyConfig
from rollwire.proxy.tenants import FLEET, Scope
from rollwire.runtime.security import ADMIN, GENERATE, PUBLISH, Grant, TokenAuth
from rollwire.runtime.token_files import presented_token

tenant_names = st.from_regex(NAME_RE, fullmatch=True)
hostile = st.one_of(
    st.text(max_size=80),
    st.from_regex(NAME_RE, fullmatch=True),
    st.builds(lambda a, b: f"{a}:{b}", st.from_regex(NAME_RE, fullmatch=True), st.from_regex(NAME_RE, fullmatch=True)),
    st.sampled_from(["", ":", "a:", ":a", "a::b", "a/b", "../a", "a\n", "a:b:c", "ａ", "a b", "x" * 65]),
)


@settings(max_examples=300, deadline=None)
@given(a=tenant_names, b=tenant_names, name=hostile, other=hostile)
def test_no_name_a_tenant_gives_spells_another_tenants_or_a_shared_one(a, b, name, other):
    """Qualified names are injective across tenants: A's own(x) == B's own(y) only when A == B
    and x == y; a qualified name is never a shared (unqualified) one; what a tenant may give is
    exactly NAME_RE, and B never sees A's names."""
    if not name:  # no adapter: the base model, everyone's
        assert Scope(a).own(name) == ""
        return
    try:
        mine = Scope(a).own(name)
    except InvalidArgument as err:
        assert not NAME_RE.fullmatch(name) and err.reason == "BAD_ADAPTER_NAME"
        return
    assert NAME_RE.fullmatch(name) and name_ok(mine) and QUALIFIED_RE.fullmatch(mine)
    assert not NAME_RE.fullmatch(mine)  # never a shared name
    assert Scope(a).shown(mine) == name and Scope().shown(mine) == mine
    if a != b:
        assert Scope(b).shown(mine) is None
    try:
        theirs = Scope(b).own(other)
    except InvalidArgument:
        return
    if not other:
        return
    assert (mine == theirs) == (a == b and name == other)


def test_reads_take_the_tenants_own_name_else_the_shared_one_writes_always_their_own():
    held = {"team-a:policy", "shared-sft", "team-b:policy"}
    a = Scope("team-a")
    assert a.read("policy", held.__contains__) == "team-a:policy"
    assert a.read("shared-sft", held.__contains__) == "shared-sft"  # an admin's adapter, seen by all
    assert a.read("nothing", held.__contains__) == "team-a:nothing"  # not found as its own
    assert Scope("team-c").read("policy", held.__contains__) == "team-c:policy"  # never team-b's
    assert a.own("shared-sft") == "team-a:shared-sft"  # a load can never overwrite a shared adapter
    with pytest.raises(InvalidArgument):
        a.read("team-b:policy", held.__contains__)  # another tenant's name cannot be spelled
    assert Scope().read("team-b:policy", held.__contains__) == "team-b:policy"  # the fleet names any
    assert Scope("team-a").scrub("adapter 'team-a:policy.2' v3 not found") == "adapter 'policy.2' v3 not found"
    assert Scope("team-a").label == "team-a" and Scope().label == FLEET and not NAME_RE.fullmatch(FLEET)


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@settings(max_examples=200, deadline=None)
@given(user=st.text(max_size=30).filter(lambda u: ":" not in u), token=st.text(min_size=1, max_size=60))
def test_a_token_is_read_from_bearer_or_from_basics_password_and_the_user_is_ignored(user, token):
    assert presented_token(_basic(user, token)) == token
    if token.strip() == token and " " not in token:
        assert presented_token(f"Bearer {token}") == token


def test_headers_that_present_no_token():
    for header in (
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic",
        "Basic !!!",
        "Basic " + base64.b64encode(b"nocolon").decode(),
    ):
        assert presented_token(header) is None, header
    assert presented_token(_basic("team-a", "")) is None
    assert presented_token("Digest abc") is None


def test_a_token_maps_to_at_most_one_tenant_and_a_tenantless_token_is_the_fleets():
    auth = TokenAuth({"gen"}, {"root"})
    auth.add_tenant("team-a", GENERATE, {"a-gen", "both", "a-twice"})
    auth.add_tenant("team-a", PUBLISH, {"a-pub", "a-twice"})
    auth.add_tenant("team-b", PUBLISH, {"b-pub", "both", "root"})

    def grant(token):
        return auth.grant([("authorization", f"Bearer {token}")])

    assert grant("gen") == Grant(GENERATE) and grant("root") is None  # root is also team-b's: refused
    assert grant("a-gen") == Grant(GENERATE, "team-a") and grant("a-pub") == Grant(PUBLISH, "team-a")
    assert grant("a-twice") == Grant(PUBLISH, "team-a")  # one tenant, both roles: the wider
    assert grant("both") is None and grant("nobody") is None
    assert auth.grant([("authorization", _basic("anyone", "b-pub"))]) == Grant(PUBLISH, "team-b")
    with pytest.raises(ValueError):
        auth.add_tenant("team-a", ADMIN, {"x"})


def test_publish_may_call_what_generate_may_and_push_but_no_fleet_operation():
    from rollwire.common.errors import PermissionDenied

    auth = TokenAuth(set(), {"root"})
    auth.add_tenant("team-a", PUBLISH, {"a-pub"})
    meta = [("authorization", "Bearer a-pub")]
    for method in ("Generate", "Score", "GetStatus", "PushAdapter"):
        auth.check(f"/rollwire.v1.GeneratorService/{method}", meta)
    for method in ("/rollwire.v1.GeneratorService/CommitAdapter", "/rollwire.v1.AdminService/ListGenerators"):
        with pytest.raises(PermissionDenied):
            auth.check(method, meta)
    with pytest.raises(PermissionDenied):
        auth.check("/rollwire.v1.AdminService/DrainGenerator", meta)


def test_tenants_in_the_config_are_checked(tmp_path):
    tokens = tmp_path / "t"
    tokens.write_text("x\n")
    good = {
        "auth": {"admin_tokens_file": str(tokens)},
        "tenants": [{"name": "team-a", "publish_tokens_file": str(tokens)}],
    }
    config = ProxyConfig.model_validate(good)
    assert config.tenants[0].weight == 1.0
    for bad, says in (
        ({"tenants": good["tenants"]}, "need auth on"),
        ({**good, "tenants": [*good["tenants"], *good["tenants"]]}, "unique"),
        ({**good, "tenants": [{"name": "team:a", "publish_tokens_file": str(tokens)}]}, "tenant's name"),
        ({**good, "tenants": [{"name": "_fleet", "publish_tokens_file": str(tokens)}]}, "tenant's name"),
        ({**good, "tenants": [{"name": "team-a"}]}, "no token file"),
    ):
        with pytest.raises(ValueError, match=says):
            ProxyConfig.model_validate(bad)
