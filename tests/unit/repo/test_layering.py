"""The import graph has no circles (issue 26): no rollwire module reaches itself through its
imports, lazy ones inside functions and TYPE_CHECKING ones included.

A circle is a strongly connected component of more than one module in grimp's graph of
`rollwire` (generated `*_pb2*` stubs left out); the failure names each import in it with its
line, so the seam to cut is in the message. lint-imports' acyclic_siblings contract checks the
same between sibling packages too (make lint runs it; tests/integration/repo/
test_layering_contracts.py runs it as a process)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grimp


def circles(imports: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(imports[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(imports[target])))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return found


def test_circles_are_found_and_nothing_else():
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d"], "f": ["a"], "g": []}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_no_module_of_rollwire_imports_itself_back():
    graph = grimp.build_graph("rollwire", include_external_packages=False)
    modules = {m for m in graph.modules if not m.endswith(("_pb2", "_pb2_grpc"))}
    imports = {m: sorted(t for t in graph.find_modules_directly_imported_by(m) if t in modules) for m in modules}
    lines = []
    for circle in circles(imports):
        lines.append("circle: " + ", ".join(circle))
        for importer in circle:
            for imported in (t for t in imports[importer] if t in circle):
                for detail in graph.get_import_details(importer=importer, imported=imported):
                    lines.append(f"  {importer}:{detail['line_number']}  {detail['line_contents']}")
    assert not lines, "import circles (cut each at a seam):\n" + "\n".join(lines)
