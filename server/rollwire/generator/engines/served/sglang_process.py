"""Launching SGLang: its command line and its private key file.

The transport, the process group, readiness, health and restart are shared with the vllm
engine (engine.py); this module holds what only SGLang's launch needs.

Invariants:
- API keys travel in headers and, for a launched server, in a private config file passed
  with `--config`, so they never appear in a command line or a log.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rollwire.generator.engines.served.process import free_port


# -- launching -----------------------------------------------------------------------------
def launch_argv(
    *,
    command: list[str],
    model: str,
    host: str,
    port: int,
    max_lora_rank: int,
    target_modules: list[str],
    max_loaded: int,
    deterministic: bool,
    random_seed: int | None,
    config_file: Path | None,
    extra_args: list[str],
) -> list[str]:
    """SGLang's command line: LoRA on, its rank and adapter limits sized for the window.

    `--max-loaded-loras` is sglang.adapter_names x (the window plus one for the swap); the
    replica never loads more (its registry evicts its own least recently used free version
    first), so SGLang's own LRU eviction (which would unload a version still being served)
    never runs.
    """
    argv = [*(command or [sys.executable, "-m", "sglang.launch_server"])]
    argv += ["--model-path", model, "--host", host, "--port", str(port)]
    argv += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--lora-target-modules", *target_modules]
    argv += ["--max-loras-per-batch", str(max_loaded), "--max-loaded-loras", str(max_loaded)]
    if deterministic:
        argv.append("--enable-deterministic-inference")
    if random_seed is not None:
        argv += ["--random-seed", str(random_seed)]
    if config_file is not None:
        argv += ["--config", str(config_file)]
    return argv + list(extra_args)


def write_key_config(path: Path, api_key: str | None, admin_key: str | None) -> Path | None:
    """A private SGLang `--config` file holding the keys (JSON is valid YAML); None if no key."""
    keys = {k: v for k, v in (("api_key", api_key), ("admin_api_key", admin_key)) if v}
    if not keys:
        return None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(keys, fh)
    return path


__all__ = ["free_port", "launch_argv", "write_key_config"]
