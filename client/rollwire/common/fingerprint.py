"""The base-model fingerprint that ties an adapter to the weights it was trained on.

fingerprint = "sha256:" + hex digest over the model's config.json (canonical JSON) and the
bytes of every *.safetensors file, in name order. Computed from the folder with hashlib
alone, so the generator, the learner and the CLI (without torch) agree on it. A folder with
no weights has a fingerprint only when asked for `config_only` (the scripted benchmark
engine): the same digest over config.json alone.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

_CHUNK = 8 * 1024 * 1024
FINGERPRINT_RE = re.compile(r"^sha256:[0-9a-f]{32}$")


def check_fingerprint(value: str) -> str:
    """Empty, or a fingerprint as `model_fingerprint` makes it; raises ValueError with a sentence."""
    if value and not FINGERPRINT_RE.fullmatch(value):
        raise ValueError(
            f"{value[:80]!r} is not a base-model fingerprint; copy it from `rollwire status --target REPLICA` "
            "(model fingerprint), e.g. sha256:0123456789abcdef0123456789abcdef"
        )
    return value


def model_fingerprint(model_dir: str | Path, *, config_only: bool = False) -> str:
    """Fingerprint of a local HF model folder; raises FileNotFoundError when not one
    (with `config_only`, a folder holding only config.json is one)."""
    root = Path(model_dir)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{root} has no config.json; point at a local Hugging Face model folder")
    digest = hashlib.sha256()
    config = json.loads(config_path.read_text())
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    weights = sorted(root.glob("*.safetensors"))
    if not weights and not config_only:
        raise FileNotFoundError(f"{root} has no *.safetensors weights")
    for path in weights:
        digest.update(path.name.encode())
        with path.open("rb") as fh:
            while block := fh.read(_CHUNK):
                digest.update(block)
    return "sha256:" + digest.hexdigest()[:32]
