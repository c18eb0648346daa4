"""Shared fixtures: the tiny model (built once per session) and real generator processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rollwire.learner.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@dataclass
class Service:
    """A rollwire process started by a test; tests stop only what they started."""

    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rollwire_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollwire.client.cli", *args]


def start_service(args: list[str], workdir: Path, name: str, timeout: float = 90, plaintext: bool = True) -> Service:
    """Start `rollwire <args> --ready-file F` and wait until it reports its ports
    (and, for a plaintext server, until a channel to it is ready)."""
    ready = workdir / f"{name}.ready.json"
    log_path = workdir / f"{name}.log"
    log = log_path.open("w")
    proc = subprocess.Popen(rollwire_cmd(*args, "--ready-file", str(ready)), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{name} did not become ready in {timeout}s:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    svc = Service(proc, info["port"], info["metrics_port"], log_path)
    if plaintext:
        with grpc.insecure_channel(svc.target) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
    return svc


def start_generator(model: Path, workdir: Path, name: str = "generator", *extra: str, plaintext: bool = True) -> Service:
    return start_service(
        ["generator", "--model", str(model), "--port", "0", "--metrics-port", "0", *extra], workdir, name, plaintext=plaintext
    )


@pytest.fixture(scope="session")
def generator(tiny_model, tmp_path_factory):
    """One generator replica shared by the tests that do not need special settings."""
    svc = start_generator(tiny_model, tmp_path_factory.mktemp("generator"), "generator", "--set", "limits.max_n=16",
                          "--set", "limits.max_new_tokens=128")
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def reference_model(tiny_model):
    """The same tiny model loaded in the test process: the independent computation."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
