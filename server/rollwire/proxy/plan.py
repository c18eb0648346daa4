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

Stripes (`striped_layout`): with S stripes the payload's chunks are dealt round robin over S
trees, chunk j down tree j mod S. Each tree has one replica under the proxy and fan-out S
below it, over the replicas in an order rotated by N/S per tree, so a replica's subtree is
in at most one tree (exactly when N mod S <= 1, always for S = 2) and every uplink, the
proxy's included, carries about one copy of the payload: S children x 1/S of the chunks.
That is NCCL's double binary tree for S = 2: a push to N replicas takes about one link time
plus depth x S chunk-times, flat in N, where a single k-ary tree costs k link times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rollwire.common.push import MAX_CHUNK, MIN_STRIPE_CHUNK, Child, plan_from_parents
from rollwire.v1 import generator_pb2 as pb


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
    return _tree(targets, [-1 if i < k else (i - k) // k for i in range(len(targets))])


def stripe_chunk_bytes(size: int, stripes: int) -> int:
    """The chunk a striped push of `size` bytes is cut into: about 8 per stripe, so a chunk's
    wait at each hop stays a small share of the push, in multiples of 64 KiB from 64 KiB
    (fewer, larger messages) to MAX_CHUNK."""
    want = math.ceil(size / (8 * stripes))
    return min(MAX_CHUNK, max(MIN_STRIPE_CHUNK, -(-want // MIN_STRIPE_CHUNK) * MIN_STRIPE_CHUNK))


def _stripe_order(n: int, stripes: int, s: int) -> list[int]:
    """Stripe s's tree, breadth first: replicas 0..n-1 rotated left by round(s x n / stripes);
    position p > 0 hangs under position (p - 1) // stripes, position 0 under the proxy."""
    shift = round(s * n / stripes)
    return [(shift + p) % n for p in range(n)]


def _stripe_position_parents(n: int, stripes: int) -> list[int]:
    return [-1 if p == 0 else (p - 1) // stripes for p in range(n)]


def stripe_parents(n: int, stripes: int) -> list[list[int]]:
    """For each stripe, the parent of every replica 0..n-1 (-1 = the proxy): one replica
    under the proxy, fan-out `stripes` below it, breadth first over the replicas rotated
    left by round(s x n / stripes) for stripe s."""
    trees = []
    for s in range(stripes):
        order = _stripe_order(n, stripes, s)
        parent = [0] * n
        for node, up in zip(order, _stripe_position_parents(n, stripes), strict=True):
            parent[node] = -1 if up < 0 else order[up]
        trees.append(parent)
    return trees


def striped_layout(targets: Sequence[Target], stripes: int, leaves: Sequence[Target] = ()) -> list[list[Child]]:
    """The proxy's children in each stripe's tree: one over `targets`, with its subtree as a
    flat RelayPlan, then each of `leaves` (replicas the caller trusts least: since every
    target is an inner node of some tree, they hang right under the proxy in every tree, at
    the cost of one more copy each on the proxy's link)."""
    n = len(targets)
    below = [Child(t.address, t.name, pb.RelayPlan()) for t in leaves]
    if not n:
        return [list(below) for _ in range(stripes)] if leaves else []
    trees = []
    for s in range(stripes):
        order = _stripe_order(n, stripes, s)  # breadth first: every parent before its children
        trees.append(_tree([targets[i] for i in order], _stripe_position_parents(n, stripes)) + below)
    return trees


def _tree(targets: Sequence[Target], parent: list[int]) -> list[Child]:
    """The proxy's children of the tree in which targets[i] hangs under targets[parent[i]]
    (-1 = the proxy); every parent comes before its children."""
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
