"""What a process imports before it serves (issue 33): a process starts as fast as its imports
allow, so the proxy's start path stays free of the model libraries (torch, transformers, peft:
seconds) and of the HTTP door's (FastAPI, uvicorn: ~0.4 s) when it serves no door, and
`rollwire --help` lists the commands without building their config models. How long each start
takes is measured by bench/startup.py, not here (timings on shared cores are noise).
"""

from __future__ import annotations

import json
import subprocess
import sys

MODEL_LIBRARIES = ("torch", "transformers", "peft")
DOOR_LIBRARIES = ("fastapi", "uvicorn", "starlette")


def imported_by(code: str, watched: tuple[str, ...]) -> list[str]:
    """Which of `watched` a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {list(watched)!r} if m in sys.modules]))\n"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_proxy_starts_without_the_model_libraries_or_a_door_it_does_not_serve():
    # what `rollwire proxy` imports up to serving: the console script, its parser with every
    # command registered, the command module and the proxy's assembly
    code = (
        "from rollwire.client import cli\n"
        "cli.build_parser()\n"
        "import rollwire.proxy.cli, rollwire.proxy.app\n"
        "from rollwire.runtime.config import load_config\n"
        "from rollwire.proxy.config import ProxyConfig\n"
        "load_config(ProxyConfig, None, ['generators=[\"127.0.0.1:1\"]'], {})\n"
    )
    assert imported_by(code, MODEL_LIBRARIES + DOOR_LIBRARIES) == []


def test_the_http_door_still_imports_where_it_is_served():
    # the control of the test above: the door's modules do bring FastAPI, so its absence there
    # means the proxy did not import them
    assert imported_by("import rollwire.proxy.http.door", DOOR_LIBRARIES) != []


def test_rollwire_help_lists_every_command_without_their_config_models():
    code = (
        "import contextlib, io, json, sys\n"
        "from rollwire.client import cli\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "imported = [m for m in ('pydantic', 'torch') if m in sys.modules]\n"
        "print(json.dumps([out.getvalue() == cli.build_parser().format_help(), imported]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    same_as_every_command_registered, imported = json.loads(proc.stdout.splitlines()[-1])
    assert same_as_every_command_registered
    assert imported == []
