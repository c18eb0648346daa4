"""Relay plans: the trees a push travels down, their stripes, and the grants that bind them.

The proxy plans (`layout`, `striped_layout`, `choose_fanout`) and signs (`grant_plan`) every
node; a relaying replica reads its part (`split_plan`) and relays only to nodes whose grant
verifies (`unplanned`). Pure functions; docs/protocol.md ("The push", "Stripes") derives the
cost model and the stripe trees.

Invariants:
- a relay plan is a flat list in which every node follows its parent, so a receiver checks
  it in one pass, with bounded size (MAX_PLAN_NODES) and no recursion; every address appears
  once; a node's children and their subtrees come from `split_plan`;
- every node keeps the grant its proxy signed it with (`relay_grant`: an HMAC bound to the
  push's name, version, digest and the node's address, keyed by the admin token's digest),
  so a replica with auth on relays only to the members its proxy planned; and every node is
  sent its own grant when dialled (`granted`), so with a relay token it takes only the
  version its proxy planned, whatever its parent sends;
- with fan-out k the replicas fill a complete k-ary tree breadth first (the proxy's children
  are the first k): callers put the replicas they trust least last, where a failure costs no
  subtree; "auto" picks the k of least modelled cost (`cost`: k x (chunks + depth - 1));
- with S stripes the chunks are dealt round robin over S trees (chunk j down tree j mod S),
  one replica under the proxy and fan-out S below it, over the replicas rotated by N/S per
  tree, so every uplink carries about one copy of the payload.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rollwire.common.addresses import is_address
from rollwire.common.errors import InvalidArgument, clip
from rollwire.common.reasons import Reason
from rollwire.common.writer import MAX_CHUNK, MIN_STRIPE_CHUNK
from rollwire.v1 import generator_pb2 as pb

MAX_PLAN_NODES = 8192
"""Most replicas in one relay plan (a plan of 8192 nodes is ~300 KB on the wire)."""


@dataclass(frozen=True)
class Child:
    """A direct child of a relay node: where to dial it and the plan it forwards in turn."""

    address: str
    name: str
    plan: pb.RelayPlan
    grant: bytes = b""
    """The proxy's grant for this child (its RelayNode.grant), sent to it in the opening
    (`granted`): with a relay token, a replica takes only a version its proxy planned."""

    def subtree(self) -> list[tuple[str, str]]:
        """(address, name) of every replica below this child."""
        return [(n.address, n.name) for n in self.plan.nodes]

    def height(self) -> int:
        """Levels of replicas below this child (0 for a leaf); parents come first in a plan."""
        level: list[int] = []
        for n in self.plan.nodes:
            level.append(1 if n.parent == 0 else level[n.parent - 1] + 1)
        return max(level, default=0)


def plan_from_parents(nodes: Sequence[tuple[str, str, int] | tuple[str, str, int, bytes]]) -> pb.RelayPlan:
    """A RelayPlan from (address, name, parent[, grant]) rows, parent 0 = the receiver, i = row i-1."""
    return pb.RelayPlan(
        nodes=[pb.RelayNode(address=r[0], name=r[1], parent=r[2], grant=r[3] if len(r) > 3 else b"") for r in nodes]
    )


GRANT_CONTEXT = b"rollwire relay grant v1"


def grant_key(admin_token_digest: bytes) -> bytes:
    """The key relay grants are signed and checked with, derived from the sha256 of an admin
    token: the proxy hashes the token it dials replicas with, a replica holds only digests."""
    return hmac.new(admin_token_digest, GRANT_CONTEXT, hashlib.sha256).digest()


def relay_grant(key: bytes, manifest: pb.AdapterManifest, address: str) -> bytes:
    """The proxy's grant to relay this push (name, version, digests) to `address`: its BLAKE3
    too when set, which the proxy verified beside the sha256, so no hop can swap it with the bytes."""
    blake3 = f"\0blake3:{manifest.blake3}" if manifest.blake3 else ""
    message = f"{manifest.name}\0{manifest.version}\0{manifest.sha256}\0{address}{blake3}".encode()
    return hmac.new(key, message, hashlib.sha256).digest()


def grant_plan(plan: pb.RelayPlan, key: bytes, manifest: pb.AdapterManifest) -> None:
    """Sign every node of `plan` for this push (the proxy, for the plans it sends)."""
    for node in plan.nodes:
        node.grant = relay_grant(key, manifest, node.address)


def grant_children(children: Sequence[Child], key: bytes, manifest: pb.AdapterManifest) -> list[Child]:
    """The proxy's children of a tree and every node below them, each granted for this push."""
    granted = []
    for child in children:
        grant_plan(child.plan, key, manifest)
        granted.append(dataclasses.replace(child, grant=relay_grant(key, manifest, child.address)))
    return granted


def is_granted(node: pb.RelayNode, keys: Sequence[bytes], manifest: pb.AdapterManifest) -> bool:
    """Whether some key verifies `node`'s grant for this push (name, version, digest, address)."""
    return any(hmac.compare_digest(node.grant, relay_grant(k, manifest, node.address)) for k in keys)


def unplanned(plan: pb.RelayPlan, keys: Sequence[bytes], manifest: pb.AdapterManifest) -> str | None:
    """The first node whose grant no key verifies (its address), or None when all verify."""
    for node in plan.nodes:
        if not is_granted(node, keys, manifest):
            return node.address
    return None


def split_plan(plan: pb.RelayPlan, *, max_children: int, max_nodes: int = MAX_PLAN_NODES) -> list[Child]:
    """The receiver's children, each with its own subtree re-indexed; INVALID_ARGUMENT for a
    plan that is too large, names a parent after its child, repeats an address, gives a
    bad address, or gives the receiver more than `max_children` children. One pass."""
    nodes = plan.nodes
    if len(nodes) > max_nodes:
        raise InvalidArgument(
            f"the relay plan has {len(nodes)} replicas; at most {max_nodes}", reason=Reason.BAD_RELAY_PLAN
        )
    owner: list[int] = []  # for node i: the index of the direct child whose subtree holds it
    rows: dict[int, list[tuple[str, str, int, bytes]]] = {}
    position: list[int] = []  # node i's 1-based index inside its owner's plan (0 for the owner itself)
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if not is_address(node.address):
            raise InvalidArgument(
                f"relay plan node {i} has address {clip(node.address)}; use HOST:PORT", reason=Reason.BAD_RELAY_PLAN
            )
        if node.address in seen:
            raise InvalidArgument(f"relay plan names {node.address} twice", reason=Reason.BAD_RELAY_PLAN)
        seen.add(node.address)
        if len(node.name) > 256:
            raise InvalidArgument(f"relay plan node {i} has a name over 256 characters", reason=Reason.BAD_RELAY_PLAN)
        if node.parent > i:
            raise InvalidArgument(
                f"relay plan node {i} names parent {node.parent}, which does not come before it",
                reason=Reason.BAD_RELAY_PLAN,
            )
        if node.parent == 0:
            owner.append(i)
            position.append(0)
            rows[i] = []
            if len(rows) > max_children:
                raise InvalidArgument(
                    f"the relay plan gives this replica more than {max_children} children (relay.max_children); "
                    "plan a smaller fan-out",
                    reason=Reason.BAD_RELAY_PLAN,
                )
            continue
        parent = node.parent - 1
        top = owner[parent]
        owner.append(top)
        rows[top].append((node.address, node.name, position[parent], node.grant))
        position.append(len(rows[top]))
    return [Child(nodes[i].address, nodes[i].name, plan_from_parents(rows[i]), nodes[i].grant) for i in rows]


# -- the proxy's trees ---------------------------------------------------------------------
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
