"""The maps stay honest (issue 53): every module of a package that has a README.md is named in
that README, and every module and room directly inside a package the top README's architecture
map lists is named in that package's entry of the map.

Named means the README holds the module's path within the package (`http/dialect/tokenizer.py`),
that path less its leading rooms (`dialect/tokenizer.py`), or its dotted name from the package
(`dialect.tokenizer`); its file name alone (`tokenizer.py`) counts only where no other module of
the package shares it. A room (a sub-package) is named as `room/`. Generated stubs (`*_pb2*`) and
`__init__.py` files are left out: a room's `__init__.py` is named with the room.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGE_ROOTS = ("client", "server", "learner")


def readme_packages() -> list[Path]:
    return sorted(
        path.parent
        for root in PACKAGE_ROOTS
        for path in (ROOT / root).rglob("README.md")
        if (path.parent / "__init__.py").exists()
    )


def modules(package: Path, deep: bool = True) -> list[Path]:
    found = package.rglob("*.py") if deep else package.glob("*.py")
    return sorted(p for p in found if p.name != "__init__.py" and "_pb2" not in p.name)


def rooms(package: Path, deep: bool = True) -> list[Path]:
    found = package.rglob("__init__.py") if deep else package.glob("*/__init__.py")
    return sorted(p.parent for p in found if p.parent != package)


def names_of(module: Path, package: Path, shared: Counter[str]) -> list[str]:
    """The ways a README may name `module` of `package` (see the module's docstring)."""
    parts = module.relative_to(package).parts
    names = ["/".join(parts[i:]) for i in range(len(parts) - 1)]
    names += [".".join(parts[i:])[: -len(".py")] for i in range(len(parts) - 1)]
    if shared[module.name] == 1 or len(parts) == 1:
        names.append(module.name)
    return names


def named(text: str, candidates: list[str]) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(c)}(?![\w])", text) for c in candidates)


def unnamed(text: str, package: Path, deep: bool = True) -> list[str]:
    """The modules and rooms of `package` that `text` does not name."""
    everything = modules(package, deep=True)
    shared = Counter(p.name for p in everything)
    missing = [
        p.relative_to(package).as_posix()
        for p in modules(package, deep)
        if not named(text, names_of(p, package, shared))
    ]
    missing += [
        f"{r.relative_to(package).as_posix()}/"
        for r in rooms(package, deep)
        if not named(text, [f"{r.relative_to(package).as_posix()}/", f"{r.name}/"])
    ]
    return missing


def test_the_walk_finds_the_packages_with_a_readme():
    found = {p.relative_to(ROOT).as_posix() for p in readme_packages()}
    assert {"server/rollwire/proxy", "server/rollwire/push", "learner/rollwire/learner"} <= found


@pytest.mark.parametrize("package", readme_packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_module_of_a_package_is_named_in_its_readme(package: Path):
    missing = unnamed((package / "README.md").read_text(), package)
    assert not missing, f"{package.relative_to(ROOT)}/README.md names none of: {', '.join(missing)}"


def map_entries() -> dict[str, str]:
    """The top README's architecture map: each `- \\`PATH/\\` — ...` entry's text, by PATH."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    entries: dict[str, str] = {}
    for block in re.split(r"\n(?=- `)", section):
        head = re.match(r"- `((?:client|server|learner)/rollwire/[\w/]+)/`", block)
        if head:
            entries[head.group(1)] = block
    return entries


def test_the_map_lists_every_package():
    listed = set(map_entries())
    packages = {
        p.parent.relative_to(ROOT).as_posix()
        for root in PACKAGE_ROOTS
        for p in (ROOT / root).glob("rollwire/*/__init__.py")
    }
    assert packages - {"client/rollwire/v1"} <= listed, sorted(packages - listed)


@pytest.mark.parametrize("path", sorted(map_entries()))
def test_every_module_and_room_of_a_mapped_package_is_named_in_its_entry(path: str):
    missing = unnamed(map_entries()[path], ROOT / path, deep=False)
    assert not missing, f"README.md's entry for {path}/ names none of: {', '.join(missing)}"
