"""The proxy's doors reach the fleet, the spool and publishing only through the core's verbs
(issue 53): an import contract (pyproject.toml) keeps them from importing those rooms, and this
test keeps them from reaching them by attribute (`core.state.fanout`, `self.state.spool`, ...),
which no import contract can see. What a door may read of the state: its config, metrics and auth.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROXY = ROOT / "server" / "rollwire" / "proxy"
DOORS = sorted([PROXY / "servicer.py", *(PROXY / "http").rglob("*.py")])
BEHIND_THE_CORE = {"fanout", "peers", "spool", "replicas", "dispatcher"}
"""ProxyState's parts a door must not touch: the core's verbs do."""


def reaches(source: str) -> list[tuple[int, str]]:
    """Each `<something>.state.<part>` of a part behind the core, with its line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in BEHIND_THE_CORE:
            inner = node.value
            name = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "")
            if name == "state":
                found.append((node.lineno, f"state.{node.attr}"))
    return found


def test_the_walk_sees_a_reach_and_not_a_request_state():
    assert reaches("x = door.core.state.fanout.push\n") == [(1, "state.fanout")]
    assert reaches("state = core.state\nstate.spool.get(1)\n") == [(2, "state.spool")]
    assert reaches("request.state.scope\ncore.state.config.http\n") == []


def test_no_door_reaches_past_the_core():
    found = [f"{path.relative_to(ROOT)}:{line} {what}" for path in DOORS for line, what in reaches(path.read_text())]
    assert DOORS and not found, "a door reaches past the core (add a verb to core.py):\n" + "\n".join(found)
