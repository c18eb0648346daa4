"""Safer defaults (issue 11, item 6): loud warnings on exposed binds, token files that reload,
loopback learner metrics, checkpoints that load as data only and are fsynced."""

from __future__ import annotations

import json
import os
import pickle
import time
from dataclasses import dataclass

import grpc
import pytest
from support.processes import start_generator

from rollwire.runtime import security, token_files
from rollwire.runtime.security import AuthSection, TlsSection, TokenAuth, is_loopback, warn_if_exposed
from rollwire.runtime.token_files import MAX_TOKEN_FILE_BYTES, TokenFile
from rollwire.v1 import generator_pb2

GET_STATUS = "/rollwire.v1.GeneratorService/GetStatus"


def status_code(target: str, token: str) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        try:
            channel.unary_unary(GET_STATUS, request_serializer=generator_pb2.GetStatusRequest.SerializeToString)(
                generator_pb2.GetStatusRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=10
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def wait_for(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout:.0f}s")
        time.sleep(0.1)


def replace_file(path, text: str) -> None:
    """Write like a Secret rotation or an editor's save: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


# --- exposed binds ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("[::]", False),
        ("10.0.0.7", False),
        ("192.168.1.20", False),
    ],
)
def test_loopback_detection(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    "auth,tls,warned",
    [
        (AuthSection(), TlsSection(), True),
        (AuthSection(admin_tokens_file="a"), TlsSection(), True),  # tokens in clear text
        (AuthSection(), TlsSection(cert_file="c", key_file="k"), True),  # anyone may push
        (AuthSection(admin_tokens_file="a"), TlsSection(cert_file="c", key_file="k"), False),
    ],
)
def test_warning_rules_and_once(auth, tls, warned, capsys, monkeypatch):
    monkeypatch.setattr(security, "_warned", set())
    sentence = warn_if_exposed("proxy", "0.0.0.0", 50050, auth, tls, 9400)
    assert bool(sentence) is warned
    err = capsys.readouterr().err
    assert (f"WARNING: {sentence}" in err) is warned
    if warned:
        assert "127.0.0.1" in sentence and "docs/deploy.md" in sentence
        assert warn_if_exposed("proxy", "0.0.0.0", 50050, auth, tls, 9400) == ""  # once
    assert warn_if_exposed("proxy", "127.0.0.1", 50050, AuthSection(), TlsSection()) == ""


def test_generator_on_all_interfaces_without_auth_warns_on_stderr(tiny_model, tmp_path):
    svc = start_generator(tiny_model, tmp_path, "exposed", "--host", "0.0.0.0")  # we connect on 127.0.0.1 only
    try:
        log = svc.log_path.read_text()
        assert "WARNING: rollwire generator listens on 0.0.0.0" in log  # the plain stderr line
        assert '"insecure_bind"' in log  # and the structured one
        assert log.count("WARNING: rollwire generator") == 1
    finally:
        svc.stop()


# --- token files reload ----------------------------------------------------------------------


@pytest.fixture
def rotating(tiny_model, tmp_path):
    (tmp_path / "generate.tokens").write_text("gen-old-000\n")
    (tmp_path / "admin.tokens").write_text("admin-000\n")
    svc = start_generator(
        tiny_model,
        tmp_path,
        "rotating",
        "--set",
        f"auth.generate_tokens_file={tmp_path / 'generate.tokens'}",
        "--set",
        f"auth.admin_tokens_file={tmp_path / 'admin.tokens'}",
    )
    yield svc, tmp_path / "generate.tokens"
    svc.stop()


def refused_reloads(svc, path, poke: str, count: int) -> list[str]:
    """Wait until the replica has logged `count` refused reloads of `path` (requests poke its
    check, which runs at most every RELOAD_INTERVAL_S); their reasons, in order."""
    reasons: list[str] = []

    def logged() -> bool:
        status_code(svc.target, poke)
        lines = [json.loads(x) for x in svc.log_path.read_text().splitlines() if x.startswith("{")]
        reasons[:] = [
            e["reason"] for e in lines if e.get("event") == "token_file_reload_failed" and e.get("path") == str(path)
        ]
        return len(reasons) >= count

    wait_for(logged, what=f"{count} refused reload(s) of {path.name} logged")
    assert len(reasons) == count, reasons
    return reasons


def test_rotated_token_file_takes_effect_without_restart(rotating):
    svc, path = rotating
    ok, bad = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED
    assert "insecure_bind" not in svc.log_path.read_text()  # loopback: nothing to warn about
    assert status_code(svc.target, "gen-old-000") == ok
    assert status_code(svc.target, "gen-new-111") == bad

    replace_file(path, "gen-new-111\n")  # rename over (how a Kubernetes Secret rotates)
    wait_for(lambda: status_code(svc.target, "gen-new-111") == ok, what="the new token works")
    assert status_code(svc.target, "gen-old-000") == bad

    path.write_text("gen-new-222\n")  # rewritten in place, same size
    wait_for(lambda: status_code(svc.target, "gen-new-222") == ok, what="the in-place token works")
    assert status_code(svc.target, "gen-new-111") == bad

    path.write_text("# nothing here yet\n")  # an empty file never opens or closes the server
    (reason,) = refused_reloads(svc, path, poke="gen-new-222", count=1)  # checked, refused
    assert reason.endswith(f"is {str(path)!r}, which holds no token; put a token in it, one per line"), reason
    assert status_code(svc.target, "gen-new-222") == ok
    assert status_code(svc.target, "") == bad
    path.unlink()  # a vanished file: same
    assert "which cannot be read" in refused_reloads(svc, path, poke="gen-new-222", count=2)[-1]
    assert status_code(svc.target, "gen-new-222") == ok
    assert status_code(svc.target, "admin-000") == ok  # the other file is untouched
    log = svc.log_path.read_text()
    assert "gen-new-222" not in log and "gen-old-000" not in log  # tokens are never logged

    replace_file(path, "gen-new-333\n")  # repaired: reloads again
    wait_for(lambda: status_code(svc.target, "gen-new-333") == ok, what="the repaired file works")
    assert status_code(svc.target, "gen-new-222") == bad


def test_token_file_keeps_old_tokens_on_any_bad_version(tmp_path, caplog):
    path = tmp_path / "t"
    path.write_text("one\ntwo\n")
    tokens = TokenFile(str(path), interval=0, reread=0)
    auth = TokenAuth(tokens, set())

    def role(token):
        return (auth._grant_of(token) or (None,))[0]

    assert role("one") == role("two") == "generate"
    for bad, problem in (
        (b"", "is empty"),
        (b"# only a comment\n\n", "holds no token"),
        (b"\xff\xfe not utf-8\n", "is not UTF-8 text"),
        (b"x" * (MAX_TOKEN_FILE_BYTES + 1), f"is larger than {MAX_TOKEN_FILE_BYTES} bytes"),
        (None, "cannot be read"),
    ):
        path.unlink() if bad is None else path.write_bytes(bad)
        assert role("one") == "generate", problem
        assert tokens._error.startswith(f"the token file is {str(path)!r}, which {problem}"), tokens._error
    path.write_text("three\n")
    assert role("three") == "generate" and role("one") is None


def test_token_comparison_is_by_digest_in_constant_time(tmp_path):
    path = tmp_path / "t"
    path.write_text("secret-token\n")
    auth = TokenAuth(TokenFile(str(path)), {"admin-token"})
    assert (auth._grant_of("secret-token") or (None,))[0] == "generate"
    assert (auth._grant_of("admin-token") or (None,))[0] == "admin"
    for wrong in ("secret-toke", "secret-token ", "secret-token\x00", "", "s" * 10_000):
        assert (auth._grant_of(wrong) or (None,))[0] is None
    assert all(len(d) == 32 for f, _ in auth._files for d in f.current())  # only digests are kept


def test_the_peer_role_shares_versions_between_proxies_and_nothing_else():
    auth = TokenAuth({"gen"}, {"adm"}, peer={"peer"})

    class Call:
        def __init__(self, token: str) -> None:
            self.metadata = (("authorization", f"Bearer {token}"),)

        def invocation_metadata(self):
            return self.metadata

    push, status = "/rollwire.v1.GeneratorService/PushAdapter", "/rollwire.v1.GeneratorService/GetStatus"
    for method in (push, status):  # what a peer proxy calls passes the interceptor
        auth.check(method, Call("peer").metadata)
    for method in ("/rollwire.v1.GeneratorService/Generate", "/rollwire.v1.GeneratorService/CommitAdapter"):
        with pytest.raises(security.PermissionDenied):
            auth.check(method, Call("peer").metadata)
    with pytest.raises(security.PermissionDenied, match="peer token only shares"):
        security.require_stage_only(security.caller_role(auth, Call("peer")), stage_only=True)  # a replica's check
    security.require_peer(auth, security.caller_role(auth, Call("peer")))
    for other in ("adm", "gen"):  # the marker from anyone else, an admin included, is refused
        with pytest.raises(security.PermissionDenied, match="only a peer proxy's token"):
            security.require_peer(auth, security.caller_role(auth, Call(other)))
    security.require_peer(None, security.caller_role(None, Call("anyone")))  # auth off: every call may do anything


def test_metadata_check_costs_at_most_one_stat_per_interval(tmp_path, monkeypatch):
    path = tmp_path / "t"
    path.write_text("tok\n")
    tokens = TokenFile(str(path), interval=60)
    calls = []
    real_stat = os.stat
    monkeypatch.setattr(token_files.os, "stat", lambda *a, **k: calls.append(a) or real_stat(*a, **k))
    for _ in range(1000):
        tokens.current()
    assert calls == []


# --- learner metrics -------------------------------------------------------------------------


def test_learner_metrics_bind_loopback_by_default():
    from rollwire.learner.config import LearnerConfig

    field = LearnerConfig.model_fields["metrics_host"]
    assert field.default == "127.0.0.1" and field.description


# --- checkpoints ---------------------------------------------------------------------------


@dataclass
class Smuggled:
    value: int = 1


def _state(step=1):
    from rollwire.learner.run import checkpoint

    return checkpoint.LearnerState(step=step, version=step, data_cursor=0, python_rng=[3, [1], None])


def test_checkpoint_loads_as_data_only(tmp_path):
    import torch

    from rollwire.learner.run import checkpoint

    checkpoint.save(tmp_path, _state(), b"adapter", {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]})
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded.trainer["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert isinstance(loaded.trainer["torch_rng"], torch.Tensor)
    # a trainer.pt holding an arbitrary object (it could run code when unpickled) is refused
    torch.save({"optimizer": {}, "torch_rng": torch.get_rng_state(), "x": Smuggled()}, loaded.path / "trainer.pt")
    with pytest.raises(pickle.UnpicklingError):
        checkpoint.load_latest(tmp_path)


def test_checkpoint_files_and_folders_are_fsynced(tmp_path, monkeypatch):
    from rollwire.learner.run import checkpoint

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    (tmp_path / ".step-000001.tmp-99999").mkdir(parents=True)  # left by a crashed save
    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    final = checkpoint.save(tmp_path, _state(2), b"adapter", {"state": {}, "param_groups": []})
    names = [s.rsplit("/", 1)[-1] for s in synced]
    for name in ("adapter.safetensors", "trainer.pt", "state.json", f".latest.tmp-{os.getpid()}"):
        assert name in names, name
    assert str(tmp_path) in synced  # the renames are durable: the folder itself is fsynced
    assert (tmp_path / "latest").read_text().strip() == final.name
    assert not list(tmp_path.glob(".*tmp*"))


pytestmark = pytest.mark.integration  # starts processes or servers: not in make test-fast
