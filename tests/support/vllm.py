"""The vLLM environment the tests run a real vLLM server from (`make .venv-vllm` builds it).

vLLM pins its own torch and transformers, so it lives in `.venv-vllm` beside rollwire's venv
and the tests reach it only over HTTP. Where that venv is missing the vLLM tests skip with
the reason, except under CI=true (`make test` builds it), where they fail instead: CI must
never pass by skipping the real server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rollwire.demo.stack import VLLM_CPU_ENV
from rollwire.generator.config import VLLMSection

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_STAMP = ROOT / ".venv-vllm" / ".installed"
SERVER = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
CPU_ENV = VLLM_CPU_ENV  # the demo's: a 1 GiB KV cache, dev mode, no core pinning, one OpenMP thread


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


class VLLMServer:
    """A real vLLM OpenAI server started by a test (or a benchmark), as a user runs it beside
    rollwire: launch_argv's flags (LoRA on, processed logprobs), CPU_ENV, runtime adapter loads,
    `names` as its served model names. Its own process group, so `stop` ends every process it
    started (API server, engine core, worker) and only those."""

    def __init__(self, model: Path, log_path: Path, names: tuple[str, ...] = (), max_loras: int = 4) -> None:
        from rollwire.generator.engines.vllm_engine import launch_argv
        from support.processes import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = launch_argv(
            command=SERVER,
            model=str(model),
            host="127.0.0.1",
            port=self.port,
            max_lora_rank=16,
            max_loras=max_loras,
            dtype="float32",
            max_model_len=0,
            extra_args=["--served-model-name", *names] if names else [],
        )
        env = {**os.environ, **CPU_ENV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_healthy(self, timeout: float = 300) -> None:
        """Until /health answers 200 and a first token was generated (vLLM compiles its first
        batch then: ~15 s on CPU); raises with the end of its log if it exits or times out."""
        import requests

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not healthy after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.5)
        model = requests.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": [5], "max_tokens": 1, "temperature": 0.0}
        requests.post(self.url + "/v1/completions", json=body, timeout=max(30.0, deadline - time.monotonic()))

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM the process group, then SIGKILL whatever of it is left after `grace_s` (or once the server exited)."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # whatever of the group is left
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
