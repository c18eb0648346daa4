"""Planning a relay tree: which replica forwards a push to which (pure functions).

The proxy is the root. With fan-out k the replicas fill a complete k-ary tree in order,
breadth first: the proxy's children are the first k, the next k² are theirs, and so on, so
the tree is as shallow as k allows and the last replicas in the order are leaves. Callers
put the replicas they trust least (a recent failure, not caught up) last, where a failure
costs no subtree.

Cost model (what "auto" minimises): every node's uplink carries one copy per child, and a
chunk waits one chunk-time at each hop, so the last replica has the payload after about
k x (chunks + depth - 1) chunk-times at link speed. A chain (k = 1) costs chunks + N - 1,
a star (k = N) costs N x chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rollwire.common.push import MAX_CHUNK, Child, plan_from_parents


@dataclass(frozen=True)
class Target:
    """A replica to push to: where to dial it and its name for results."""

    address: str
    name: str


def depth(n: int, k: int) -> int:
    """Levels below the root of a complete k-ary tree holding n nodes."""
    levels, room, width = 0, 0, 1
    while room < n:
        width *= k
        room += width
        levels += 1
    return levels


def cost(n: int, k: int, chunks: int) -> float:
    """The model's time (in chunk-times at link speed) until n replicas hold `chunks` chunks."""
    if n <= 0:
        return 0.0
    k = min(k, n)
    return k * (chunks + depth(n, k) - 1)


def choose_fanout(setting: int | str, n: int, size: int, max_fanout: int, chunk: int = MAX_CHUNK) -> int:
    """The fan-out for a push of `size` bytes to n replicas: the setting, or for "auto" the k
    of least modelled cost (the smaller k on a tie: fewer copies on each uplink). 0 = star."""
    if setting != "auto":
        return n if setting == 0 else min(int(setting), max(n, 1))
    chunks = max(1, math.ceil(size / chunk))
    return min(range(1, max(1, min(max_fanout, n)) + 1), key=lambda k: (cost(n, k, chunks), k))


def layout(targets: Sequence[Target], k: int) -> list[Child]:
    """The proxy's children in a breadth-first k-ary tree over `targets` (in that order),
    each with its subtree as a flat RelayPlan."""
    if not targets:
        return []
    k = max(1, min(k, len(targets)))
    # node i (0-based) hangs under the proxy when i < k, else under node (i - k) // k
    parent = [-1 if i < k else (i - k) // k for i in range(len(targets))]
    owner: list[int] = []
    rows: dict[int, list[tuple[str, str, int]]] = {}
    position: list[int] = []
    for i, t in enumerate(targets):
        if parent[i] < 0:
            owner.append(i)
            position.append(0)
            rows[i] = []
            continue
        top = owner[parent[i]]
        owner.append(top)
        rows[top].append((t.address, t.name, position[parent[i]]))
        position.append(len(rows[top]))
    return [Child(targets[i].address, targets[i].name, plan_from_parents(rows[i])) for i in rows]
