"""A discrete-event model of an adapter push: star, relay trees, and NCCL's ring and trees.

What one machine cannot hold (64 or 1,000 replicas, 10-100 Gb/s links), this model predicts,
after it has been calibrated on netlab runs (bench/push_netlab.py: real processes in network
namespaces behind shaped links) and checked against them at the replica counts netlab holds.

The model (every host has a full-duplex link: its uplink and downlink are separate queues):
- a payload of S bytes moves in chunks of c bytes; sending one chunk occupies the sender's
  uplink for c / B seconds (B = the link's rate, times `efficiency` for protocol overhead) and
  reaches the receiver L seconds later (one-way latency);
- a host that forwards a chunk first pays a per-chunk cost `hop_s` (receive, hash, queue) and
  forwards at most at `cpu_bytes_s` (its processing rate): B_eff = min(B, cpu_bytes_s);
- a host with k children sends each chunk to each child in turn (k copies share its uplink);
  a host's uplink is one FIFO queue shared by everything it sends, served in the order its
  chunks become ready;
- star (push.fanout = 0): the proxy forwards each chunk to all N replicas as it arrives, so
  N copies share its one uplink (a tree of depth 1);
- relay: rollwire plans either a single cut-through tree of fan-out k (`push.fanout`; k=1 a
  chain) or S striped trees (`push.stripes`: chunk j goes down tree j mod S; each tree has one
  replica under the proxy and fan-out S below it, `rollwire.push.plan.stripe_parents`). The
  proxy is the root; every hop forwards chunk j as soon as it has it; done when the last
  replica has every chunk, has verified them (`verify_bytes_s`), its report has come back up
  the tree, and the stage/commit round trip has come back to the root. With S = 2 every
  replica is interior in at most one tree, so every uplink (the proxy's too) carries about
  one copy of the payload and depth is ~log2 N: NCCL's double binary tree, with rollwire's
  upload to the proxy, verification and commit on top;
- NCCL's ring broadcast (a pipelined chain over all ranks) and double binary tree, in closed
  form with no upload, checks or commit, as references.
rollwire's schedules (star, tree, stripes) are computed exactly per chunk, not sampled: a
max-plus scan (numpy) per uplink, hosts taken in the order their inputs are known (an event
simulation with a heap where no such order exists).

Calibration and the lab term (`calibrate`, `SharedCores`). netlab runs every emulated host
on one machine (2 cores for push_netlab.json), so past a few replicas a relay or striped push
there is bound by that machine's cores, not by its links: with 8 replicas the proxy and
replicas burn ~8 CPU seconds and the machine is ~97% busy. A fleet gives each host its own
CPU, which this model's hosts have, so the netlab check (and only it) adds one term:
  lab time = max(network schedule above,
                 services CPU seconds / (cores x services_share))
- services CPU seconds = size x ((n+1) x recv + n_proxy x proxy_send + (n - n_proxy) x send):
  every host takes in one copy (the proxy from the pusher), n copies are sent on, n_proxy of
  them by the proxy (star n, a k-ary tree k, stripes 1). recv, send and proxy_send are
  per-byte CPU costs fitted by non-negative least squares to each run's measured
  services_cpu_s (proxy + replicas), not to the times; the proxy's sends come out free (its
  CPU stays ~0.9 s whether it sends 1 copy or 8), a replica's forwarding does not;
- services_share: kernel work (softirq: shaping and bridging every emulated packet) and the
  pusher run on the same cores but are not in services_cpu_s; their share is read off
  machine_busy, as the median share of the busy CPU time the services got in the runs
  that saturated the machine (machine_busy >= 0.9).
The link's efficiency and per-chunk hop_s are then fitted by grid search on the push times
(hop_s, which netlab barely resolves, stays at its default unless the data favour another
by more than their noise).

The fleet gets the CPU costs only as each host's rate: Link.cpu_bytes_s = 1 / (recv + send),
one host taking in one copy and forwarding one (an inner replica of a chain or of striped
trees), on a core of its own, fitted the same way on the lab run at 2 Gbit/s per link
(push_netlab_2000mbit.json) when there is one, else on the 200 Mbit/s run. The 200 Mbit/s
costs describe slow links, not bytes: a replica taking in 37 MB there spends 0.25 s in user
space and 0.67 s in the kernel, against 0.09 s and 0.08 s over 2 Gbit/s links; segments that
trickle in wake the receiver (kernel, then gRPC's poller and threads) for a few KB at a time,
and that cost grows with how long the bytes take, so it would make every fleet host ~5x too
slow.

Run:
  .venv/bin/python bench/push_sim.py            # calibrate on bench/results/push_netlab.json, predict
  .venv/bin/python bench/push_sim.py --no-calibrate
  .venv/bin/python bench/push_sim.py --check    # self-checks only (writes nothing)
Writes bench/results/push_sim.json.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

import numpy as np
from common import RESULTS, write_result

from rollwire.common.writer import MAX_CHUNK, MIN_STRIPE_CHUNK
from rollwire.push.plan import choose_fanout, stripe_chunk_bytes, stripe_parents

MiB = 1 << 20
GBIT = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True)
class Link:
    """One host's network link and per-hop costs."""

    rate_bytes_s: float  # nominal link rate
    latency_s: float = 50e-6  # one way
    efficiency: float = 0.94  # TCP/IP + HTTP/2 + gRPC framing: 200 Mbit/s tbf measured 23.5 MB/s
    hop_s: float = 200e-6  # per chunk a forwarding host spends (receive, hash, queue, write)
    cpu_bytes_s: float = 1.5e9  # bytes/s one host can receive, hash and forward; calibrated: 1 / (recv + send)
    verify_bytes_s: float = 2e9  # tensor checks at the end (finiteness ~2 GB/s measured)
    commit_s: float = 2e-3  # applying a staged version

    @property
    def bytes_s(self) -> float:
        return min(self.rate_bytes_s * self.efficiency, self.cpu_bytes_s)


def _fifo(start: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Finish times of jobs that one server takes in the given order, job i no earlier than
    start[i], for t[i] seconds: finish[i] = max(finish[i-1], start[i]) + t[i], solved as a
    cumulative max over (start - time before i), so a whole uplink is one numpy scan."""
    prefix = np.cumsum(t)
    return prefix + np.maximum.accumulate(start - (prefix - t))


def _send(ready: np.ndarray, copies: int, link: Link, chunk_sizes: np.ndarray) -> list[np.ndarray]:
    """Arrival times at each of `copies` children of chunks that became ready at `ready`.

    One uplink sends chunk j to child 0, 1, ..., copies-1, then chunk j+1; a slot starts when
    both the uplink is free and the chunk is ready (after the host's `hop_s`)."""
    t = np.repeat(chunk_sizes / link.bytes_s, copies)
    start = np.repeat(ready + link.hop_s, copies)
    finish = _fifo(start, t)
    return [finish[m::copies] + link.latency_s for m in range(copies)]


def _chunks(size: float, chunk: int) -> np.ndarray:
    n = max(1, math.ceil(size / chunk))
    sizes = np.full(n, float(chunk))
    sizes[-1] = size - chunk * (n - 1)
    return sizes


def _upload(size: float, chunk: int, link: Link) -> np.ndarray:
    """Chunk arrival times at the proxy from a pusher behind its own link (the learner)."""
    sizes = _chunks(size, chunk)
    return _send(np.zeros(len(sizes)) - link.hop_s, 1, link, sizes)[0]


def _tree_children(n: int, k: int) -> list[list[int]]:
    """Node 0 is the proxy, 1..n the replicas; breadth-first k-ary tree (k=1: a chain)."""
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for node in range(1, n + 1):
        children[(node - 1) // k].append(node)
    return children


def _finish(last_arrival: float, size: float, link: Link) -> float:
    return last_arrival + size / link.verify_bytes_s


def relay_time(size: float, n: int, k: int, link: Link, chunk: int = MiB) -> float:
    """Push to n replicas down a cut-through k-ary tree rooted at the proxy, staged and committed."""
    sizes = _chunks(size, chunk)
    arrival: dict[int, np.ndarray] = {0: _upload(size, chunk, link)}
    children = _tree_children(n, k)
    depth = {0: 0}
    done = 0.0
    for node in range(n + 1):  # breadth-first order: parents before children
        kids = children[node]
        if kids:
            for kid, times in zip(kids, _send(arrival[node], len(kids), link, sizes), strict=True):
                arrival[kid] = times
                depth[kid] = depth[node] + 1
        if node:
            done = max(done, _finish(arrival[node][-1], size, link) + depth[node] * link.latency_s)
            del arrival[node]  # keep memory flat for 1,000 replicas
    return done + link.latency_s + link.commit_s  # the commit to every staged replica


def star_time(size: float, n: int, link: Link, chunk: int = MiB) -> float:
    """The proxy alone sends every replica its copy (push.fanout=0): cut-through, so a tree of
    depth 1 and fan-out n, whose n copies share the proxy's one uplink."""
    return relay_time(size, n, max(1, n), link, chunk)


def nccl_ring_time(size: float, n: int, link: Link, chunk: int = MiB) -> float:
    """NCCL ring broadcast from a root over n receivers: a pipelined chain, no upload or checks."""
    return size / link.bytes_s + (n - 1) * (chunk / link.bytes_s + link.latency_s + link.hop_s) + link.latency_s


def nccl_double_tree(size: float, n: int, link: Link, chunk: int = MiB) -> float:
    """NCCL's double binary tree broadcast over n receivers, in closed form, as a reference
    (as nccl_ring_time: no upload, checks or commit): two trees each carry half the chunks,
    every rank is interior in at most one, so each hop costs two chunk-times and the depth is
    ~log2 N. rollwire's own striped relay is `proxy_striped_time` (key relay_striped2)."""
    depth = max(1, math.ceil(math.log2(n + 1)))
    per_chunk = 2 * chunk / link.bytes_s + link.latency_s + link.hop_s
    return size / link.bytes_s + depth * per_chunk + link.latency_s


# ------------------------------------------------------------------ striped relay


def _stripe_forest(n: int, stripes: int) -> tuple[list[list[int]], list[list[list[int]]], np.ndarray]:
    """(parent, kids, depth) of every stripe's tree over hosts 0..n: host 0 is the proxy,
    replica i (as `stripe_parents` numbers it) is host i + 1; parent[s][0] = -1, kids[s][h]
    in host order, depth[h, s] the hops from the proxy.

    Checks what the model relies on: each tree spans every replica from the proxy."""
    parent = [[-1] + [p + 1 for p in tree] for tree in stripe_parents(n, stripes)]
    kids: list[list[list[int]]] = [[[] for _ in range(n + 1)] for _ in range(stripes)]
    depth = np.zeros((n + 1, stripes))
    for s, tree in enumerate(parent):
        for host in range(1, n + 1):
            kids[s][tree[host]].append(host)
        hops = _depths(kids[s])
        assert len(hops) == n + 1, f"stripe {s} does not reach every replica"
        depth[list(hops), s] = list(hops.values())
    return parent, kids, depth


def _depths(kids: list[list[int]]) -> dict[int, int]:
    """Hops from the proxy (host 0) to every host its tree reaches."""
    depth, todo = {0: 0}, deque([0])
    while todo:
        host = todo.popleft()
        for kid in kids[host]:
            if kid not in depth:
                depth[kid] = depth[host] + 1
                todo.append(kid)
    return depth


def _uplink_order(parent: list[list[int]], kids: list[list[list[int]]]) -> list[int] | None:
    """The hosts that forward, each after every host that forwards it the chunks it passes on,
    so that when a host's uplink is scanned every chunk it will send has a known ready time.
    None when that dependency has a cycle (an uplink waits on one that waits on it): chunk by
    chunk time still moves forward, but no order of whole uplinks exists, and the event
    simulation has to run. (stripe_parents gives none for S <= 8, N <= 1,000.)"""
    trees = range(len(kids))
    senders = [h for h in range(len(kids[0])) if any(kids[s][h] for s in trees)]
    waits = {h: {parent[s][h] for s in trees if kids[s][h] and parent[s][h] >= 0} for h in senders}
    feeds: dict[int, list[int]] = {h: [] for h in senders}
    for h, ups in waits.items():
        for up in ups:
            feeds[up].append(h)
    order, todo = [], deque(h for h in senders if not waits[h])
    while todo:
        host = todo.popleft()
        order.append(host)
        for h in feeds[host]:
            waits[h].discard(host)
            if not waits[h]:
                todo.append(h)
    return order if len(order) == len(senders) else None


def _uplink(
    got: dict[int, np.ndarray], kids: dict[int, list[int]], stripes: int, sizes: np.ndarray, link: Link
) -> Iterator[tuple[int, int, np.ndarray]]:
    """(stripe, child, arrival times there of the stripe's chunks) for one host that forwards,
    in each stripe s of `kids`, the stripe's chunks (it got them at `got[s]`, in chunk order)
    to kids[s] in turn. Its uplink is one FIFO queue: chunks go out in the order they become
    ready (arrival + hop_s, ties by chunk index), whatever their tree, as `_send` does for one
    tree; with one stripe this is exactly `_send`."""
    trees = list(kids)
    j = np.concatenate([np.arange(s, len(sizes), stripes) for s in trees])  # global chunk index
    ready = np.concatenate([got[s] for s in trees]) + link.hop_s
    copies = np.concatenate([np.full(len(got[s]), len(kids[s])) for s in trees])
    order = np.lexsort((j, ready))
    j, ready, copies = j[order], ready[order], copies[order]
    finish = _fifo(np.repeat(ready, copies), np.repeat(sizes[j] / link.bytes_s, copies)) + link.latency_s
    first = np.cumsum(copies) - copies  # the slot of each chunk's first copy
    for s in trees:
        mine = j % stripes == s
        slot, at = first[mine], j[mine] // stripes  # position within the stripe
        for m, child in enumerate(kids[s]):
            times = np.empty(len(at))
            times[at] = finish[slot + m]
            yield s, child, times


def _striped_done(last: np.ndarray, depth: np.ndarray, size: float, link: Link) -> float:
    """When the root has every replica's report, from last[host, s] (the arrival of its last
    chunk of stripe s) and depth[host, s]: a replica verifies once it has every stripe, and
    reports up the tree that completed it (as `relay_time`: one latency a level); its other
    trees' streams report when their part is in. Then the commit round trip."""
    rows = np.arange(len(last))
    done_by = np.argmax(last, axis=1)  # the stripe whose chunk completed the payload
    verdict = _finish(last.max(axis=1), size, link) + depth[rows, done_by] * link.latency_s
    streams = (last + depth * link.latency_s).max(axis=1)
    return float(np.maximum(verdict, streams).max()) + link.latency_s + link.commit_s


def striped_time(size: float, n: int, stripes: int, link: Link, chunk: int = MiB) -> float:
    """Push to n replicas over `stripes` cut-through trees from `stripe_parents`, chunk j down
    tree j mod stripes, staged and committed. Exact per chunk: every host's uplink (the proxy's
    and a replica's interior in several trees alike) is one FIFO queue, scanned once its
    inputs are known. With stripes = 1 the tree is a chain and this equals relay_time(k=1)."""
    sizes = _chunks(size, chunk)
    active = min(stripes, len(sizes))  # a stripe dealt no chunk takes no time
    parent, kids, depth = _stripe_forest(n, stripes)
    order = _uplink_order(parent, kids)
    if order is None:
        return _striped_events(size, n, stripes, link, chunk)
    upload = _upload(size, chunk, link)
    got = {(0, s): upload[s::stripes] for s in range(active)}  # (host, stripe) -> arrivals, in chunk order
    last = np.zeros((n + 1, active))
    for host in order:
        sending = {s: kids[s][host] for s in range(active) if kids[s][host]}
        if not sending:  # interior only in trees dealt no chunk
            continue
        mine = {s: got.pop((host, s)) for s in sending}
        for s, child, times in _uplink(mine, sending, stripes, sizes, link):
            last[child, s] = times.max()
            if kids[s][child]:
                got[(child, s)] = times
    return _striped_done(last[1:], depth[1:, :active], size, link)


def proxy_striped_time(size: float, n: int, stripes: int, link: Link, chunk: int = MiB) -> float:
    """A push with push.stripes = `stripes` as the proxy plans it (FanOut._relay): at most one
    stripe per replica and per MIN_STRIPE_CHUNK of payload; under two, one tree of the default
    push.fanout ("auto", max_fanout 16); else `striped_time`, cut into plan.stripe_chunk_bytes
    chunks (about 8 a stripe, at most 1 MiB), unless `chunk` is already coarser than any real
    chunk (the model's 8 MiB for multi-GB payloads, which keeps 1,000 replicas fast)."""
    count = min(stripes, n, math.ceil(size / MIN_STRIPE_CHUNK))
    if count < 2:
        return relay_time(size, n, choose_fanout("auto", n, int(size), 16, chunk), link, chunk)
    cut = stripe_chunk_bytes(int(size), count) if chunk <= MAX_CHUNK else chunk
    return striped_time(size, n, count, link, cut)


def _striped_events(size: float, n: int, stripes: int, link: Link, chunk: int = MiB) -> float:
    """striped_time's push simulated event by event (a clock and a heap): the reference that
    --check compares the scans with, and the fallback where uplinks cannot be ordered.

    Events are (time, kind, host, chunk): kind 0, the chunk arrives at the host; kind 1, the
    host's uplink may start its next chunk. Arrivals at a time come before starts at it, so a
    start sees every chunk ready by then and takes the earliest ready (ties: lowest index)."""
    sizes = _chunks(size, chunk)
    active = min(stripes, len(sizes))
    _, kids, depth = _stripe_forest(n, stripes)
    slot = sizes / link.bytes_s
    last = np.zeros((n + 1, active))
    free = [0.0] * (n + 1)
    queue: list[list[tuple[float, int]]] = [[] for _ in range(n + 1)]
    events = [(float(at), 0, 0, j) for j, at in enumerate(_upload(size, chunk, link))]
    heapq.heapify(events)
    while events:
        now, kind, host, j = heapq.heappop(events)
        if kind == 0:
            s = j % stripes
            last[host, s] = max(last[host, s], now)
            if kids[s][host]:
                heapq.heappush(queue[host], (now + link.hop_s, j))
                heapq.heappush(events, (now + link.hop_s, 1, host, -1))
        elif free[host] <= now and queue[host] and queue[host][0][0] <= now:
            _, j = heapq.heappop(queue[host])
            end = now  # = max(free, ready): an event fires at each of them, and the later one starts it
            for child in kids[j % stripes][host]:
                end += slot[j]
                heapq.heappush(events, (end + link.latency_s, 0, child, j))
            free[host] = end
            heapq.heappush(events, (end, 1, host, -1))
    return _striped_done(last[1:], depth[1:, :active], size, link)


# ------------------------------------------------------------------ sizes of what moves


def lora_bytes(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int, rank: int = 16) -> int:
    """bf16 bytes of a rank-`rank` LoRA on q,k,v,o,gate,up,down of every layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    pairs = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
    return 2 * rank * layers * sum(a + b for a, b in pairs)


SHAPES = {  # public config.json fields
    "0.5B": dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, head_dim=64),
    "1.5B": dict(hidden=1536, inter=8960, layers=28, heads=12, kv_heads=2, head_dim=128),
    "7B": dict(hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, head_dim=128),
    "70B": dict(hidden=8192, inter=28672, layers=80, heads=64, kv_heads=8, head_dim=128),
}
FULL_BYTES = {"0.5B": 0.99e9, "1.5B": 3.09e9, "7B": 15.2e9, "70B": 141.1e9}  # bf16 weights

ANCHORS = [
    {"system": "HF Jobs LoRA sync (published)", "what": "LoRA adapter to 2-3 vLLM replicas", "seconds": "6-8.5"},
    {"system": "checkpoint-engine (published)", "what": "1T-parameter model weights update", "seconds": "~20"},
]


# ------------------------------------------------------------------ calibration

MODELLED = ("star", "relay", "striped")  # netlab modes (push_netlab.json's `modes`) with a model here
SATURATED = 0.9  # machine_busy from which a netlab run counts as bound by the machine's cores
HOP_GRID = (50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3)
TIE = 0.005  # fits whose rms relative error is within this of the best: netlab cannot tell them apart
# (one point's two repeats differ by up to ~17%, relay N=4)


@dataclass(frozen=True)
class SharedCores:
    """netlab only: every emulated host runs on the same machine, `cores` cores in all.

    A push then cannot end before the machine has done its CPU work: the CPU seconds of the
    proxy and replicas (`services_cpu_s`: per copy a host takes in, per copy it sends on),
    over the cores they get. They get a share `services_share` of a saturated machine: the
    rest is softirq (shaping and bridging every packet of the emulated links) and the pusher
    (the learner, outside), both on the same cores. A real fleet gives each host its own CPU,
    so fleet predictions never use this; there a host's CPU shows only as its rate
    `Link.cpu_bytes_s` = 1 / (recv + send)."""

    cores: int
    recv_s_per_byte: float  # a host (proxy or replica) taking in one copy: receive, hash, checks, stage
    send_s_per_byte: float  # a replica forwarding one copy to one child
    proxy_send_s_per_byte: float  # the proxy sending one copy to one child (from its spool)
    services_share: float  # of a saturated machine's busy CPU time, the share the services got

    def services_s(self, size: float, n: int, proxy_copies: float) -> float:
        """CPU seconds of the proxy and n replicas for one push: n + 1 copies taken in (the
        proxy's from the pusher, one per replica), n sent on, `proxy_copies` of them by the proxy."""
        return size * (
            (n + 1) * self.recv_s_per_byte
            + proxy_copies * self.proxy_send_s_per_byte
            + (n - proxy_copies) * self.send_s_per_byte
        )

    def floor_s(self, size: float, n: int, proxy_copies: float) -> float:
        """The least time the machine's cores need for that CPU work."""
        return self.services_s(size, n, proxy_copies) / (self.cores * self.services_share)

    @property
    def host_bytes_s(self) -> float:
        """What one host with a core of its own handles when it takes in one copy and forwards
        one (a chain's or a striped tree's inner replica): Link.cpu_bytes_s for the fleet."""
        return 1 / (self.recv_s_per_byte + self.send_s_per_byte)


def _netlab_points(data: dict) -> tuple[Link, float, dict[str, dict[int, float]]]:
    """(link, payload bytes, {mode: {n: median seconds}}) from bench/results/push_netlab.json."""
    link = Link(
        rate_bytes_s=data["rate_mbit"] * 1e6 / 8,
        latency_s=data.get("delay_ms", 0) / 1e3 + 50e-6,
    )
    points: dict[str, dict[int, float]] = {}
    for mode, per_n in data["modes"].items():
        points[mode] = {int(n): v["median"] for n, v in per_n["push_s"].items()}
    return link, float(data["payload_bytes"]), points


def _relay_fanout(data: dict, n: int, size: float, chunk: int) -> int:
    """The fan-out the proxy used in a netlab relay run of n replicas: `fanout` when the run
    fixed one, else its choice for `fanout_setting` ("auto": plan.choose_fanout, with the
    proxy's default push.max_fanout of 16 unless the run recorded another)."""
    setting = data.get("fanout", data.get("fanout_setting", "auto"))
    setting = setting if setting == "auto" else int(setting)
    return choose_fanout(setting, n, int(size), int(data.get("max_fanout", 16)), chunk)


def _predict(mode: str, size: float, n: int, link: Link, data: dict, chunk: int) -> float:
    """The model's time for one netlab point, with the tree the proxy built for that mode."""
    if mode == "star":
        return star_time(size, n, link, chunk)
    if mode == "relay":
        return relay_time(size, n, _relay_fanout(data, n, size, chunk), link, chunk)
    if mode == "striped":
        return proxy_striped_time(size, n, int(data.get("stripes", 2)), link, chunk)
    raise ValueError(f"no model for netlab mode {mode!r}")


def _proxy_copies(mode: str, size: float, n: int, data: dict, chunk: int) -> float:
    """Copies of the payload the proxy itself sends in a netlab run (the rest of the n copies
    the replicas receive, inner replicas send): star n; a k-ary tree min(k, n); S >= 2 stripes
    one (each tree's top replica gets its 1/S of the chunks)."""
    if mode == "star":
        return float(n)
    if mode == "striped" and min(int(data.get("stripes", 2)), n, math.ceil(size / MIN_STRIPE_CHUNK)) >= 2:
        return 1.0
    fanout = _relay_fanout(data, n, size, chunk) if mode == "relay" else choose_fanout("auto", n, int(size), 16, chunk)
    return float(min(fanout, n))


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best over the subsets of columns whose
    unconstrained fit is non-negative (exact for the few columns here)."""
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 1 << x.shape[1]):
        cols = [i for i in range(x.shape[1]) if mask >> i & 1]
        coef = np.zeros(x.shape[1])
        coef[cols] = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        if (coef < 0).any():
            continue
        sse = float(np.sum(np.square(x @ coef - y)))
        if best is None or sse < best[0]:
            best = (sse, coef)
    assert best is not None
    return best[1]


def _r2(x: np.ndarray, coef: np.ndarray, y: np.ndarray) -> float:
    return 1 - float(np.sum(np.square(y - x @ coef)) / np.sum(np.square(y - y.mean())))


def fit_shared_cores(data: dict) -> tuple[SharedCores, dict]:
    """SharedCores from netlab's per-run CPU seconds: the per-byte costs by non-negative least
    squares of each run's services_cpu_s on the bytes each role moved (taken in by every host;
    sent by the proxy; sent by replicas), and the services' share of the cores from the runs
    that saturated the machine (median of services_cpu_s / (machine_busy x cores x served_s)).
    Also returns the fit's report, with the same fit over the bytes every host sent, the
    proxy's and the replicas' alike (what that fit misses: the proxy's sends cost ~nothing)."""
    size = float(data["payload_bytes"])
    chunk = int(data.get("chunk_bytes", MiB))
    cores = int(data["machine"]["cpus"])
    runs = [r for r in data["runs"] if r["mode"] in MODELLED and "services_cpu_s" in r]
    proxy = [_proxy_copies(r["mode"], size, r["n"], data, chunk) for r in runs]
    x = size * np.array([[r["n"] + 1, p, r["n"] - p] for r, p in zip(runs, proxy, strict=True)])
    y = np.array([r["services_cpu_s"] for r in runs])
    recv, proxy_send, send = (float(c) for c in _nnls(x, y))
    pooled_x = np.c_[x[:, 0], x[:, 1] + x[:, 2]]  # (taken in, sent by anyone)
    pooled = _nnls(pooled_x, y)
    busy = [r for r in runs if r.get("machine_busy", 0) >= SATURATED]
    share = float(np.median([r["services_cpu_s"] / (r["machine_busy"] * cores * r["served_s"]) for r in busy]))
    shared = SharedCores(cores, recv, send, proxy_send, share)
    fitted = {(r["mode"], r["n"]): shared.services_s(size, r["n"], p) for r, p in zip(runs, proxy, strict=True)}
    report = {
        "cores": cores,
        "runs": len(runs),
        "recv_s_per_byte": recv,
        "send_s_per_byte": send,
        "proxy_send_s_per_byte": proxy_send,
        "per_copy_s": {
            "recv": round(recv * size, 3),
            "send": round(send * size, 3),
            "proxy_send": round(proxy_send * size, 3),
        },
        "r2": round(_r2(x, np.array([recv, proxy_send, send]), y), 3),
        "services_cpu_s": {  # per mode and n: [median measured, fitted]
            m: {
                n: [round(float(v), 2), round(fitted[(m, int(n))], 2)]
                for n, v in data["modes"][m].get("services_cpu_s", {}).items()
            }
            for m in MODELLED
            if m in data["modes"]
        },
        "services_share": round(share, 3),
        "saturated_runs": len(busy),
        "host_bytes_s": round(shared.host_bytes_s),
        "sends_pooled": {  # one send cost for the proxy's and the replicas' sends
            "recv_per_copy_s": round(float(pooled[0]) * size, 3),
            "send_per_copy_s": round(float(pooled[1]) * size, 3),
            "r2": round(_r2(pooled_x, pooled, y), 3),
        },
    }
    return shared, report


def _predict_lab(
    mode: str, size: float, n: int, link: Link, shared: SharedCores, data: dict, chunk: int
) -> tuple[float, float]:
    """(the netlab time of one point, the network schedule's part of it): the later of the
    network schedule and the machine's CPU floor."""
    net = _predict(mode, size, n, link, data, chunk)
    return max(net, shared.floor_s(size, n, _proxy_copies(mode, size, n, data, chunk))), net


def calibrate(data: dict) -> dict:
    """Fit the model on a netlab run and report its error at every measured point.

    First the shared machine (`fit_shared_cores`, from CPU seconds: not from the times), whose
    per-host rate 1 / (recv + send) is the link's `cpu_bytes_s`; then efficiency and the
    per-chunk hop cost by grid search on the medians of every modelled mode at once (least
    relative squared error, each point weighing the same), each point predicted as
    `_predict_lab`: the network schedule, or the shared cores when they are the slower."""
    link, size, measured = _netlab_points(data)
    points = {m: per for m, per in measured.items() if m in MODELLED}
    chunk = int(data.get("chunk_bytes", MiB))
    shared, cpu = fit_shared_cores(data)
    link = replace(link, cpu_bytes_s=shared.host_bytes_s)
    scores: dict[tuple[float, float], float] = {}
    for eff in np.linspace(0.80, 1.0, 21):
        for hop in HOP_GRID:
            trial = replace(link, efficiency=float(eff), hop_s=hop)
            err = [
                (_predict_lab(m, size, n, trial, shared, data, chunk)[0] - t) / t
                for m, per in points.items()
                for n, t in per.items()
            ]
            scores[(float(eff), hop)] = float(np.mean(np.square(err)))
    least = math.sqrt(min(scores.values()))
    # hop_s barely moves netlab's times (a 1 MiB chunk takes ~45 ms on its link): of the
    # fits within TIE of the best, the one whose hop_s is nearest the default, not an end of the grid
    near = [key for key, score in scores.items() if math.sqrt(score) <= least + TIE]
    eff, hop = min(near, key=lambda key: (abs(math.log(key[1] / Link.hop_s)), scores[key]))
    fitted = replace(link, efficiency=eff, hop_s=hop)
    lab = {m: {n: _predict_lab(m, size, n, fitted, shared, data, chunk) for n in per} for m, per in points.items()}
    errors = {m: {n: round(float((lab[m][n][0] - t) / t), 3) for n, t in per.items()} for m, per in points.items()}
    out = {
        "link": asdict(fitted),
        "shared_cores": cpu,
        "relative_error": errors,
        "max_abs_error": max(abs(e) for per in errors.values() for e in per.values()),
        "max_abs_error_by_mode": {m: max(abs(e) for e in per.values()) for m, per in errors.items()},
        "bound_by": {
            m: {n: "cores" if lab[m][n][0] > lab[m][n][1] else "network" for n in per} for m, per in points.items()
        },
        "rms_error_by_hop_s": {  # the best over efficiency at each hop_s: how little netlab says about it
            hop: round(math.sqrt(min(v for (_, h), v in scores.items() if h == hop)), 4) for hop in HOP_GRID
        },
        "network_only_error": {
            m: {n: round(float((lab[m][n][1] - t) / t), 3) for n, t in per.items()} for m, per in points.items()
        },
    }
    if "relay" in points:
        out["relay_fanout"] = {n: _relay_fanout(data, n, size, chunk) for n in points["relay"]}
    if "striped" in points:
        out["stripes"] = int(data.get("stripes", 2))
    if skipped := sorted(set(measured) - set(points)):
        out["not_modelled"] = skipped
    return out


# ------------------------------------------------------------------ predictions


def _payloads() -> dict[str, float]:
    out: dict[str, float] = {f"{m} r16": lora_bytes(**SHAPES[m]) for m in ("0.5B", "7B", "70B")}
    return out | {f"{m} full": FULL_BYTES[m] for m in ("0.5B", "7B", "70B")}


def _chunk_for(size: float) -> int:
    return MiB if size < 2e9 else 8 * MiB  # big payloads: fewer, larger chunks


def predict(
    link_template: Link, fanouts=(1, 2, 4), stripes=(2, 4), replicas=(1, 2, 4, 8, 16, 64, 256, 1000)
) -> list[dict]:
    """Seconds to push each payload to n replicas at 10 and 100 Gb/s, per scheme: star (n <= 64),
    relay_k{k} (one k-ary tree, push.fanout = k), relay_striped{S} (push.stripes = S as the
    proxy plans it), nccl_ring and nccl_double_tree (references: no upload, checks or commit);
    and each scheme's time to the most replicas over its time to one."""
    rows = []
    for gbit in (10, 100):
        link = replace(link_template, rate_bytes_s=gbit * GBIT, latency_s=50e-6)
        for what, size in _payloads().items():
            chunk = _chunk_for(size)
            row = {"gbit": gbit, "payload": what, "bytes": int(size), "chunk": chunk, "replicas": {}}
            for n in replicas:
                cell = {
                    "star": star_time(size, n, link, chunk) if n <= 64 else None,
                    "nccl_ring": nccl_ring_time(size, n, link, chunk),
                    "nccl_double_tree": nccl_double_tree(size, n, link, chunk),
                }
                for k in fanouts:
                    cell[f"relay_k{k}"] = relay_time(size, n, k, link, chunk)
                for s in stripes:
                    cell[f"relay_striped{s}"] = proxy_striped_time(size, n, s, link, chunk)
                row["replicas"][n] = {key: (round(v, 4) if v is not None else None) for key, v in cell.items()}
            one = row["replicas"][1]
            top = row["replicas"][replicas[-1]]
            row["ratio_1000_over_1"] = {
                key: round(top[key] / one[key], 2) for key in top if top[key] is not None and one.get(key)
            }
            rows.append(row)
    return rows


# ------------------------------------------------------------------ self-check


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def check() -> None:
    """Assert what the striped model must satisfy; print the 1,000-over-1 ratios it gives.

    - one stripe is the chain relay_time(k=1) builds (stripe_parents(n, 1) is a chain);
    - the per-uplink scans equal the event simulation, for odd n and S > 2 too, where a
      replica is interior in two trees and its FIFO uplink interleaves them;
    - S = 2 at 10 Gb/s with the default Link: 1,000 replicas within 2x of one for a 7B r16."""
    base = Link(rate_bytes_s=10 * GBIT)
    cpu_bound = replace(base, rate_bytes_s=200e6 / 8, efficiency=0.82, hop_s=6.4e-3, cpu_bytes_s=1e8)
    sizes = (1.0, 0.5 * MiB, 17 * MiB + 3, 36985320.0)
    for link in (base, cpu_bound):
        for size in sizes:
            for n in (1, 2, 3, 8, 33):
                a, b = striped_time(size, n, 1, link), relay_time(size, n, 1, link)
                assert _close(a, b), f"stripes=1 {a} != chain {b} (size {size}, n {n})"
            for stripes in (2, 3, 4, 5):
                for n in (1, 2, 3, 5, 7, 8, 13, 33):
                    a, b = striped_time(size, n, stripes, link), _striped_events(size, n, stripes, link)
                    assert _close(a, b), f"scans {a} != events {b} (size {size}, n {n}, S {stripes})"
    shared = [(n, s) for s in (3, 4, 5) for n in (5, 7, 13, 33) if _interior_twice(n, s)]
    assert shared, "no case above has a replica interior in two trees"
    print(f"ok: stripes=1 == chain; scans == events (replica interior in two trees at (n, S) {shared})")
    for gbit in (10, 100):
        link = replace(base, rate_bytes_s=gbit * GBIT)
        for what, size in _payloads().items():
            chunk = _chunk_for(size)
            one = striped_time(size, 1, 2, link, chunk)
            ratios = {s: striped_time(size, 1000, s, link, chunk) / one for s in (2, 4)}
            print(f"{gbit:>3} Gb/s {what:>9}: 1000/1 striped2 {ratios[2]:.2f}x, striped4 {ratios[4]:.2f}x")
            if gbit == 10 and what == "7B r16":
                assert ratios[2] <= 2, f"7B r16 at 10 Gb/s: striped2 1000/1 is {ratios[2]:.2f}x > 2"
    print("ok: 7B r16 at 10 Gb/s, 1000 replicas within 2x of one (stripes=2)")
    _check_shared_cores()


def _check_shared_cores() -> None:
    """fit_shared_cores gives back the costs and share that made a synthetic netlab run, and
    the proxy's copies are what each mode's plan gives it (star n, a chain 1, stripes 1)."""
    size, truth = 36985320.0, SharedCores(2, 2.5e-8, 1.5e-8, 1e-9, 0.9)
    data: dict = {"payload_bytes": size, "chunk_bytes": MiB, "machine": {"cpus": 2}, "stripes": 2, "runs": []}
    data["modes"] = {m: {} for m in MODELLED}
    for mode in MODELLED:
        for n in (1, 2, 4, 8, 16):
            copies = _proxy_copies(mode, size, n, data, MiB)
            assert copies == (n if mode == "star" else 1), f"{mode} n={n}: the proxy sends {copies} copies"
            cpu = truth.services_s(size, n, copies)
            served = cpu / (2 * 0.95 * truth.services_share)
            data["runs"].append({"mode": mode, "n": n, "services_cpu_s": cpu, "served_s": served, "machine_busy": 0.95})
    fitted, report = fit_shared_cores(data)
    for field in ("recv_s_per_byte", "send_s_per_byte", "proxy_send_s_per_byte", "services_share"):
        assert _close(getattr(fitted, field), getattr(truth, field), 1e-6), f"{field}: {getattr(fitted, field)}"
    assert report["r2"] > 0.999
    print("ok: the netlab CPU fit recovers synthetic per-byte costs and the services' share")


def _interior_twice(n: int, stripes: int) -> bool:
    """Whether some replica has children in two of stripe_parents(n, stripes)'s trees."""
    interior = [sum(i in tree for tree in stripe_parents(n, stripes)) for i in range(n)]
    return max(interior, default=0) > 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--no-calibrate", action="store_true", help="use the default per-hop costs")
    parser.add_argument("--check", action="store_true", help="run the self-checks only (writes nothing)")
    args = parser.parse_args()
    if args.check:
        check()
        return 0
    link = Link(rate_bytes_s=10 * GBIT)
    out: dict = {"anchors": ANCHORS}
    netlab = RESULTS / "push_netlab.json"
    if not args.no_calibrate and netlab.exists():
        cal = calibrate(json.loads(netlab.read_text()))
        out["calibration"] = cal
        link = Link(**cal["link"])
        cpu = cal["shared_cores"]
        print(
            f"netlab CPU per copy (s): recv {cpu['per_copy_s']['recv']}, send {cpu['per_copy_s']['send']}, "
            f"proxy send {cpu['per_copy_s']['proxy_send']} (R^2 {cpu['r2']}; one send cost for all hosts: "
            f"R^2 {cpu['sends_pooled']['r2']}); services get {cpu['services_share']:.0%} of {cpu['cores']} "
            f"saturated cores; a host at 200 Mbit/s: {cpu['host_bytes_s'] / 1e6:.1f} MB/s"
        )
        print(f"calibrated on {netlab.name}: max |error| {cal['max_abs_error']:.1%}; {cal['relative_error']}")
        print(f"  bound by: {cal['bound_by']}; network schedule alone: {cal['network_only_error']}")
    elif not args.no_calibrate:
        print(f"no {netlab}; run bench/push_netlab.py first, or pass --no-calibrate")
    fast = RESULTS / "push_netlab_2000mbit.json"
    if not args.no_calibrate and fast.exists():  # each fleet host's rate, from links that do not trickle
        _, fleet = fit_shared_cores(json.loads(fast.read_text()))
        link = replace(link, cpu_bytes_s=fleet["host_bytes_s"])
        out["fleet_host"] = {"source": fast.name, **fleet}
        print(
            f"fleet host rate from {fast.name}: {fleet['host_bytes_s'] / 1e6:.0f} MB/s "
            f"(recv {fleet['per_copy_s']['recv']} s, send {fleet['per_copy_s']['send']} s per copy)"
        )
    out["predictions"] = predict(link)
    for row in out["predictions"]:
        r = row["ratio_1000_over_1"]
        print(
            f"{row['gbit']:>3} Gb/s {row['payload']:>9}: 1000/1 relay k1 {r['relay_k1']}x, k2 {r['relay_k2']}x, "
            f"striped2 {r['relay_striped2']}x, striped4 {r['relay_striped4']}x, ring {r['nccl_ring']}x, "
            f"nccl double tree {r['nccl_double_tree']}x; "
            f"1000 replicas k2 {row['replicas'][1000]['relay_k2']:.3f}s, "
            f"striped2 {row['replicas'][1000]['relay_striped2']:.3f}s"
        )
    command = "python bench/push_sim.py" + (" --no-calibrate" if args.no_calibrate else "")
    write_result("push_sim", command, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
