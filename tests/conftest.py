"""Shared fixtures: what has a lifetime (the tiny and the taught model, generator processes,
a learner stack), built once per session. Plain helpers live in the `support` package.

The folder is the tier (docs/testing.md): tests/unit (no processes, no sockets:
tests/unit/conftest.py enforces it), tests/integration (real processes; marked `integration`
here) and tests/e2e (demos, TRL, vLLM-backed, teaching runs; marked `integration` and `slow`)."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import pytest
from support.door_fleet import chat_model, door  # noqa: F401  # the HTTP door's session fleet
from support.fleets import fleets  # noqa: F401  # replica fleets shared by the tests that only read them
from support.learner import taught_model as build_taught
from support.processes import FAST_STOP, start_generator, start_stack
from support.vllm import vllm_server  # noqa: F401  # the one vLLM server of the run
from support.zygote import ZYGOTE

from rollwire.demo import stack as demo_stack

TIERS = {"integration": ("integration",), "e2e": ("integration", "slow")}
"""The markers each tier's folder gives its tests: `-m "not slow"` leaves out tests/e2e."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        tier = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""
        for marker in TIERS.get(tier, ()):
            item.add_marker(marker)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown where it is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's workers (`make test`: -n 2) take whole work units, as `--dist loadscope`
    does, but a unit is `worker_group`'s, not only a module."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByGroup(config, log)


@functools.cache
def worker_group(nodeid: str) -> str:
    """Which tests one worker runs together: a module's tests stay together, in their order, so
    its module-scoped processes start once; every module of the run's vLLM server shares one
    worker, so the server (~70 s, several GiB) starts once; the network-namespace labs share
    one, so two labs never shape the host at once. Read from the module's text, as the
    controller, which collects nothing, only has test ids."""
    module = nodeid.split("::", 1)[0]
    text = _module_text(module)
    if "vllm_server" in text:
        return "vllm-server"
    if re.search(r"support(\.| import )netlab", text):
        return "netlab"
    return module


@functools.cache
def _module_text(module: str) -> str:
    try:
        return (Path(__file__).parent.parent / module).read_text()
    except OSError:
        return ""


@pytest.fixture(scope="session", autouse=True)
def forked_replicas():
    """Replicas start forked from one process that already imported torch (support/zygote.py:
    a replica's start is mostly that import); it starts at the first replica, so the unit
    tier never starts it. ROLLWIRE_TESTS_FORK=0 spawns them instead."""
    demo_stack.LAUNCH = ZYGOTE.popen
    yield
    demo_stack.LAUNCH = subprocess.Popen
    ZYGOTE.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rollwire.demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, request) -> Path:
    """One folder per test module for the processes it starts (their logs and ready files)."""
    return tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))


@pytest.fixture(scope="session")
def receipt_keys(tmp_path_factory) -> Path:
    """The shared replica's receipt key (a file beside it) and the trust file naming it, which a
    learner that requires receipts is given (ingest.receipt_keys_file)."""
    import json

    from rollwire.common.signing import SigningKey

    folder = tmp_path_factory.mktemp("receipt-keys")
    key = SigningKey.generate("shared-replica")
    key.save(folder / "replica.key")
    (folder / "trust.json").write_text(json.dumps({"keys": [key.trust_entry()]}))
    return folder


@pytest.fixture(scope="session")
def generator(tiny_model, tmp_path_factory, receipt_keys):
    """One generator replica shared by the tests that do not need special settings; it signs a
    receipt for every sample (receipt_key_file)."""
    svc = start_generator(
        tiny_model,
        tmp_path_factory.mktemp("generator"),
        "generator",
        "--set",
        "limits.max_n=16",
        "--set",
        "limits.max_new_tokens=200",
        "--set",
        f"receipt_key_file={receipt_keys / 'replica.key'}",
    )
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def reference_model(tiny_model):
    """The same tiny model loaded in the test process: the independent computation."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


@pytest.fixture(scope="session")
def taught_model() -> Path:
    """The tiny model taught the addition task to a partial skill, cached across sessions."""
    return build_taught()


@pytest.fixture(scope="session")
def chain_model() -> Path:
    """The tiny model taught chained addition (make demo-agent's), cached across sessions by its key."""
    from rollwire.demo.teach_chain import CHAIN_SPEC

    return build_taught(CHAIN_SPEC)


@pytest.fixture(scope="session")
def stack(taught_model, tmp_path_factory):
    """One proxy with 2 replicas of the taught model, shared: each test uses its own adapter name."""
    s = start_stack(taught_model, tmp_path_factory.mktemp("learner-stack"), generator_args=FAST_STOP)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    d = tmp_path_factory.mktemp("pki")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=rollwire-test-ca",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
        )
    return d
