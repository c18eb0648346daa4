"""Shared fixtures: the tiny model (built once per session) and real generator processes."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from rollwire.common.services import ServiceProcess, rollwire_cmd, start  # noqa: F401 (re-exported for tests)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rollwire.demo.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


Service = ServiceProcess


def start_service(args: list[str], workdir: Path, name: str, timeout: float = 90, plaintext: bool = True) -> Service:
    """Start a rollwire process and wait until it serves (a plaintext one: until a channel is ready)."""
    svc = start(args, workdir, name, timeout)
    if plaintext:
        with grpc.insecure_channel(svc.target) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
    return svc


def start_generator(
    model: Path, workdir: Path, name: str = "generator", *extra: str, plaintext: bool = True
) -> Service:
    return start_service(
        ["generator", "--model", str(model), "--port", "0", "--metrics-port", "0", *extra],
        workdir,
        name,
        plaintext=plaintext,
    )


@pytest.fixture(scope="session")
def generator(tiny_model, tmp_path_factory):
    """One generator replica shared by the tests that do not need special settings."""
    svc = start_generator(
        tiny_model,
        tmp_path_factory.mktemp("generator"),
        "generator",
        "--set",
        "limits.max_n=16",
        "--set",
        "limits.max_new_tokens=200",
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
