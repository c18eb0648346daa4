"""The SDK and CLI where a process or a socket is the point: --help answers without torch in a
fresh interpreter, `python -m` runs the CLI, and calls that reach nothing listening (or a
listener that never answers) end with the status, the address and the deadline."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.peft_folders import write_peft_dir
from support.processes import free_port

from rollwire.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    Unavailable,
    cli,
)
from rollwire.v1 import generator_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]


def tokens(i, ids, text, version=3, logprobs=None):
    lp = logprobs if logprobs is not None else [-0.5] * len(ids)
    return pb.GenerateResponse(
        tokens=[pb.TokenChunk(sample_index=i, token_ids=ids, logprobs=lp, text=text, adapter_version=version)]
    )


def test_a_final_transport_error_names_the_address_and_the_attempts():
    port = free_port()
    with Client(f"127.0.0.1:{port}", timeout=10, max_attempts=2) as client, pytest.raises(Unavailable) as info:
        client.get_status()
    assert f"127.0.0.1:{port}" in str(info.value) and "2 attempt(s)" in str(info.value)


def test_nothing_listening_is_unavailable():
    with Client(f"127.0.0.1:{free_port()}", timeout=10, max_attempts=2) as client, pytest.raises(Unavailable):
        client.get_status()


@pytest.fixture
def silent_listener():
    """A TCP socket that accepts and never answers, so calls can only end by deadline or cancel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_every_call_has_a_deadline(silent_listener):
    with Client(silent_listener, timeout=0.5) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.get_status()
        with pytest.raises(DeadlineExceeded):
            client.generate("hi")
        assert time.monotonic() - start < 5


async def test_async_unavailable_and_cancellation(silent_listener):
    async with AsyncClient(f"127.0.0.1:{free_port()}", timeout=10, max_attempts=2) as client:
        with pytest.raises(Unavailable):
            await client.generate("hi", n=2)
    async with AsyncClient(silent_listener, timeout=60) as client:
        for coro in (client.get_status(), client.generate("hi")):
            task = asyncio.create_task(coro)
            await asyncio.sleep(0.2)
            task.cancel()
            start = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - start < 2


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    paths = [str(ROOT / d) for d in ("client", "server", "learner")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_help_answers_without_torch():
    code = (
        "import sys\n"
        "import rollwire.client, rollwire.client.cli\n"
        "for argv in (['--help'], ['generate', '--help']):\n"
        "    try:\n"
        "        rollwire.client.cli.main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, exc.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert "push-adapter" in proc.stdout and "status" in proc.stdout
    assert "--max-new-tokens" in proc.stdout and "--adapter NAME@VERSION" in proc.stdout
    assert proc.stdout.strip().endswith("NO-TORCH")


def test_module_entry_point_help():
    proc = run_python(
        "import sys, runpy; sys.argv = ['rollwire', '--help']; "
        "runpy.run_module('rollwire.client.cli', run_name='__main__')"
    )
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout


def test_status_error_prints_code_and_exits_1(capsys):
    assert cli.main(["status", "--target", f"127.0.0.1:{free_port()}", "--timeout", "5"]) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: ")


def test_push_reaching_no_server_exits_1(tmp_path, capsys):
    folder = write_peft_dir(tmp_path / "adapter")
    argv = [
        "push-adapter",
        "--target",
        f"127.0.0.1:{free_port()}",
        "--timeout",
        "5",
        "--name",
        "lora",
        "--version",
        "1",
        "--base-fingerprint",
        "sha256:x",
        str(folder),
    ]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: ")
