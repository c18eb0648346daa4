"""The one dial section and credentials function (rollwire.runtime.dialing): every link reads its
files once, names the setting it cannot use, and refuses the keys' older names with the new ones."""

from __future__ import annotations

import pytest

from rollwire.generator.config import GeneratorConfig
from rollwire.learner.config import LearnerConfig
from rollwire.proxy.config import PeeringSection, ProxyConfig
from rollwire.proxy.upstream import UpstreamSection, peer_dialer
from rollwire.runtime.config import ConfigError, load_config
from rollwire.runtime.dialing import DialSection, dial_credentials


@pytest.mark.parametrize(
    ("model", "old", "new"),
    [
        (GeneratorConfig, "registration.tls_ca_file", "registration.ca_file"),
        (LearnerConfig, "client.tls_ca_file", "client.ca_file"),
        (LearnerConfig, "client.tls_cert_file", "client.cert_file"),
        (LearnerConfig, "client.tls_key_file", "client.key_file"),
        (LearnerConfig, "client.tls_server_name", "client.server_name"),
    ],
)
def test_an_old_key_is_refused_with_its_new_name(model, old, new):
    with pytest.raises(ConfigError, match=f"{old} is now {new}"):
        load_config(model, overrides=[f"{old}=x"])


def test_every_link_takes_the_same_keys():
    sections = [ProxyConfig.model_fields[name].annotation for name in ("upstream", "peering")]
    sections += [GeneratorConfig.model_fields[name].annotation for name in ("relay", "registration")]
    sections.append(LearnerConfig.model_fields["client"].annotation)
    for section in sections:
        assert isinstance(section, type) and issubclass(section, DialSection), section


def test_each_problem_names_its_setting(tmp_path):
    token = tmp_path / "token"
    token.write_text("# the admin token\nsecret\n")
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n")
    cases = [
        (DialSection(ca_file=str(tmp_path / "missing.pem")), "relay.ca_file is .*cannot be read"),
        (DialSection(cert_file=str(token)), "relay.cert_file and relay.key_file go together"),
        (DialSection(token_file=str(empty)), "relay.token_file is .*holds no token"),
    ]
    for section, sentence in cases:
        with pytest.raises(SystemExit, match=sentence):
            dial_credentials(section, "relay")
    found = dial_credentials(DialSection(token_file=str(token), server_name="proxy.internal"), "client")
    assert (found.tls, found.token, found.server_name) == (False, "secret", "proxy.internal")
    assert "secret" not in repr(found)


def test_peers_take_each_empty_setting_from_upstream(tmp_path):
    ca, token = tmp_path / "ca.pem", tmp_path / "token"
    ca.write_bytes(b"roots")
    token.write_text("admin\n")
    upstream = DialSection(ca_file=str(ca), token_file=str(token))
    found = dial_credentials(DialSection(server_name="peer.internal"), "peering", (upstream, "upstream"))
    assert (found.tls, found.root_certificates, found.token, found.server_name) == (
        True,
        b"roots",
        "admin",
        "peer.internal",
    )
    with pytest.raises(SystemExit, match="peering.token_file is"):
        dial_credentials(DialSection(token_file=str(tmp_path / "nope")), "peering", (upstream, "upstream"))
    dialer = peer_dialer(PeeringSection(server_name="peer.internal"), UpstreamSection(token_file=str(token)))
    assert dialer.metadata == (("authorization", "Bearer admin"),)
    assert ("grpc.ssl_target_name_override", "peer.internal") in dialer.options


def test_a_server_s_bad_token_file_names_its_auth_key(tmp_path):
    from rollwire.runtime.security import AuthSection, TokenAuth

    good, empty, binary = tmp_path / "good", tmp_path / "empty", tmp_path / "binary"
    good.write_text("a-token\n")
    empty.write_text("\n# none yet\n")
    binary.write_bytes(b"\xff\xfe\x00token")
    for role in ("generate", "admin", "relay", "register", "peer"):
        others = {f"{r}_tokens_file": str(good) for r in ("generate", "admin") if r != role}
        for path, problem in (
            (tmp_path / "missing", "cannot be read"),
            (empty, "holds no token"),
            (binary, "not UTF-8"),
        ):
            auth = AuthSection(**others, **{f"{role}_tokens_file": str(path)})
            with pytest.raises(SystemExit, match=f"auth.{role}_tokens_file is '{path}', which .*{problem}"):
                TokenAuth.from_config(auth)
    assert TokenAuth.from_config(AuthSection(generate_tokens_file=str(good), admin_tokens_file=str(good)))


def test_every_secret_file_is_read_by_one_rule(tmp_path):
    """The SDK's token file, an engine server's API key, the servers' token files and the fleet key
    go through one reader (rollwire.common.secrets): one sentence per problem, naming the setting."""
    from rollwire.common.errors import FailedPrecondition
    from rollwire.common.secrets import SecretFileError, read_secret_file
    from rollwire.generator.engines.served.files import read_secret
    from rollwire.runtime.members import read_member_key
    from rollwire.runtime.token_files import read_tokens

    missing, empty, binary, key = (tmp_path / n for n in ("missing", "empty", "binary", "key"))
    empty.write_text("\n  \n")
    binary.write_bytes(b"\xff\xfe\x00 a key of sixteen bytes or more")
    key.write_text("  sk-the-api-key\n")
    for path, problem in ((missing, "cannot be read"), (empty, "is empty"), (binary, "is not UTF-8 text")):
        sentence = f"the_key_file is '{path}', which {problem}"
        with pytest.raises(SecretFileError, match=sentence):
            read_secret_file(path, "the_key_file")
        with pytest.raises(FailedPrecondition, match=sentence):
            read_secret(str(path), "the_key_file")
        with pytest.raises(SystemExit, match=sentence):
            read_tokens(str(path), "the_key_file")
    assert read_secret_file(key, "the_key_file") == read_secret(str(key), "k") == "sk-the-api-key"
    with pytest.raises(SystemExit, match="is empty; a fleet key needs at least 16 bytes"):
        read_member_key(str(empty), "auth.member_key_file")
    assert read_member_key(str(binary), "auth.member_key_file") == binary.read_bytes().strip()  # a fleet key is bytes


def test_a_server_whose_tls_file_cannot_be_read_exits_naming_it(tmp_path):
    """Before any port is added: the server is never touched (here it is not even one)."""
    from rollwire.runtime.security import TlsSection, add_port

    (tmp_path / "server.key").write_text("key")
    tls = TlsSection(cert_file=str(tmp_path / "server.pem"), key_file=str(tmp_path / "server.key"))
    with pytest.raises(SystemExit, match=f"cannot read TLS file {tmp_path / 'server.pem'}: No such file"):
        add_port(None, "127.0.0.1:0", tls)  # type: ignore[arg-type]
