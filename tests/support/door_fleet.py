"""The HTTP door's fleet, shared by every module that drives the door (test_http_door.py,
test_http_conformance.py): two replicas of the tiny model with a chat template, an open proxy
with the door (tool calls parsed: http.tool_call_parser hermes), and a guarded one over the same replicas (tokens,
one request per client, no tool call parser: vLLM's default).
One fleet for the session (conftest.py registers the fixtures): the suite's time is a budget."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests

from .processes import start_generators, start_proxy, stop_all, wait_routable

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
"""A chat template for the tiny model (its tokenizer is one character per token)."""
ADMIN_TOKEN, GENERATE_TOKEN = "admin-secret-1", "generate-secret-1"


@pytest.fixture(scope="session")
def chat_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with a chat template in its tokenizer config."""
    folder = tmp_path_factory.mktemp("chat-model") / "tiny"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="session")
def door(chat_model, tmp_path_factory):
    """Two replicas, an open proxy with the door, and a second proxy over the same replicas
    with tokens and a per-client limit of one request."""
    work = tmp_path_factory.mktemp("http-door")
    root = work / "adapters"
    root.mkdir()
    (work / "admin").write_text(ADMIN_TOKEN + "\n")
    (work / "generate").write_text(GENERATE_TOKEN + "\n")
    gens = start_generators(chat_model, work, ["h1", "h2"], "--set", "adapter_window=4")
    door_args = ("--http-port", "0", "--http-model", str(chat_model), "--http-adapter-root", str(root))
    proxy = start_proxy(work, "hp", gens, *door_args, "--set", "http.tool_call_parser=hermes")
    guarded = start_proxy(
        work,
        "hg",
        gens,
        *door_args,
        "--set",
        f"auth.admin_tokens_file={work / 'admin'}",
        "--set",
        f"auth.generate_tokens_file={work / 'generate'}",
        "--set",
        "fairness.max_in_flight_per_client=1",
    )
    try:
        wait_routable(proxy, gens)
        yield {"proxy": proxy, "guarded": guarded, "gens": gens, "root": root, "work": work, "model": chat_model}
    finally:
        stop_all([proxy, guarded, *gens])


def openai_client(url: str, key: str = "unused"):
    """The official `openai` client on the door at `url`: no retries, a 60 s timeout."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def post(url: str, path: str, body, token: str | None = None, **kw) -> requests.Response:
    """POST `body` (JSON unless bytes or str) to the door, with a bearer `token` if given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(
        url + path, data=data, headers={"Content-Type": "application/json", **headers}, timeout=60, **kw
    )
