"""The vLLM environment the tests run a real vLLM server from (`make .venv-vllm` builds it).

vLLM pins its own torch and transformers, so it lives in `.venv-vllm` beside rollwire's venv
and the tests reach it only over HTTP. Where that venv is missing the vLLM tests skip with
the reason, except under CI=true (`make test` builds it), where they fail instead: CI must
never pass by skipping the real server.

One vLLM server per run serves every test that only talks to one (`vllm_server`, a session
fixture conftest.py registers: ~30-100 s to start on 2 cores), started as agent-RL users start
it (`TOOL_FLAGS`: hermes tool calls parsed, a request's own chat template taken); the vllm
engine's own tests (tests/e2e/test_vllm_engine.py) launch theirs, because launching,
supervising and killing the server is what they check.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollwire.demo.stack import VLLM_CPU_ENV, VLLMServer
from rollwire.generator.engines.settings import VLLMSection

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_STAMP = ROOT / ".venv-vllm" / ".installed"
SERVER = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
CPU_ENV = VLLM_CPU_ENV  # the demo's: a 1 GiB KV cache, dev mode, no core pinning, one OpenMP thread
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template")
"""The shared server's flags beyond VLLMServer's: tool calls parsed as the issue's harnesses expect
(tests/e2e/test_verifiers_conformance.py), and a request's `chat_template` taken, so a test can give
the tiny model the door fleet's template per request; neither changes an answer to a request
without tools or a template."""


def require_vllm() -> None:
    """Skip (or, under CI, fail) when the vLLM venv is not built."""
    if VLLM_STAMP.is_file():
        return
    why = f"the vLLM environment is not built ({VLLM_STAMP} missing): run `make .venv-vllm` (about 2-3 min)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; under CI `make test` must build it, so this is a failure, not a skip")
    pytest.skip(why)


def vllm_section(adapter_dir: Path, **changes) -> VLLMSection:
    """A launched vLLM on the tiny model, float32 on CPU, LoRA up to rank 16."""
    fields: dict = dict(
        launch_command=SERVER,
        env=CPU_ENV,
        dtype="float32",
        max_lora_rank=16,
        adapter_dir=str(adapter_dir),
        startup_timeout_s=300.0,
        request_timeout_s=120.0,
        health_interval_s=0.5,
    )
    fields.update(changes)
    return VLLMSection(**fields)


@pytest.fixture(scope="session")
def vllm_server(tiny_model, tmp_path_factory) -> Iterator[VLLMServer]:
    """A real vLLM server on the tiny model, healthy, serving it as its folder's name and its
    path, LoRA loads at run time, no API key, TOOL_FLAGS; stopped (its process group) at the session's end.
    Tests share it: each loads adapters under names of its own."""
    require_vllm()
    work = tmp_path_factory.mktemp("vllm-server")
    names = (tiny_model.name, str(tiny_model))
    server = VLLMServer(tiny_model, work / "vllm.log", names=names, python=VLLM_PYTHON, extra_args=TOOL_FLAGS)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
