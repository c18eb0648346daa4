"""The one rule between OpenAI/vLLM model names and rollwire's (adapter name, version).

- the base model answers to its served id and to its folder's path string (TRL names it so);
- `NAME-vN` is version N of adapter NAME (TRL's `trl-policy-v3` is `trl-policy@3`);
- any other adapter name is NAME at its newest version; loading under such a name publishes
  NAME's next version;
- /v1/models lists every served version as `NAME-vN`, so what it lists can be sent back.
A trailing `-v<digits>` always means a version; pick another name for an adapter whose own
name ends so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollwire.common.errors import InvalidArgument
from rollwire.common.manifest import MAX_VERSION, name_ok
from rollwire.common.reasons import Reason

_VERSIONED = re.compile(r"^(?P<name>.+)-v(?P<version>[0-9]{1,19})$")


@dataclass(frozen=True)
class ModelRef:
    """What a `model` field selects: the base model (name ""), or adapter `name` at `version`
    (0 = its newest)."""

    name: str = ""
    version: int = 0

    @property
    def is_base(self) -> bool:
        return not self.name


def parse_model(model: str, base_names: frozenset[str]) -> ModelRef:
    """A request's `model` as a ModelRef; InvalidArgument for a name rollwire could never serve."""
    if model in base_names:
        return ModelRef()
    match = _VERSIONED.fullmatch(model)
    name, version = (match["name"], int(match["version"])) if match else (model, 0)
    if match and not 1 <= version <= MAX_VERSION:
        raise InvalidArgument(
            f"model {model!r} names version {version} of {name!r}; versions start at 1",
            reason=Reason.BAD_ADAPTER_NAME,
        )
    if not name_ok(name):
        raise InvalidArgument(
            f"model {model[:80]!r} is neither the base model ({', '.join(sorted(base_names))}) nor a valid adapter "
            "name (letters, digits, '.', '_', '-'; see GET /v1/models)",
            reason=Reason.BAD_ADAPTER_NAME,
        )
    return ModelRef(name, version)


def model_id(name: str, version: int) -> str:
    """The `model` id under which /v1/models lists a served version."""
    return f"{name}-v{version}"
