"""A discrete-event model of an adapter push: star, relay tree, and NCCL's ring and trees.

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
- star (push.fanout = 0): the proxy forwards each chunk to all N replicas as it arrives, so
  N copies share its one uplink (a tree of depth 1);
- relay (cut-through tree of fan-out k, k=1 a chain): the proxy is the root; every hop
  forwards chunk j as soon as it has it; done when the last replica has its last chunk, has
  verified it (`verify_bytes_s`), and the stage/commit round trip has come back to the root;
- NCCL ring broadcast: a chain over all ranks with pipelined chunks; NCCL double binary
  tree: two trees each carrying half the chunks, every rank interior in at most one, so every
  uplink carries one copy and depth is ~log2 N (the bandwidth-optimal log-depth scheme,
  modelled here for comparison: rollwire's relay is a single k-ary tree).
All schedules are computed exactly per chunk with a max-plus scan (numpy), not sampled.

Run:
  .venv/bin/python bench/push_sim.py            # calibrate on bench/results/push_netlab.json, predict
  .venv/bin/python bench/push_sim.py --no-calibrate
Writes bench/results/push_sim.json.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace

import numpy as np
from common import RESULTS, write_result

MiB = 1 << 20
GBIT = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True)
class Link:
    """One host's network link and per-hop costs."""

    rate_bytes_s: float  # nominal link rate
    latency_s: float = 50e-6  # one way
    efficiency: float = 0.94  # TCP/IP + HTTP/2 + gRPC framing: 200 Mbit/s tbf measured 23.5 MB/s
    hop_s: float = 200e-6  # per chunk a forwarding host spends (receive, hash, queue, write)
    cpu_bytes_s: float = 1.5e9  # bytes/s one host can receive, hash and forward
    verify_bytes_s: float = 2e9  # tensor checks at the end (finiteness ~2 GB/s measured)
    commit_s: float = 2e-3  # applying a staged version

    @property
    def bytes_s(self) -> float:
        return min(self.rate_bytes_s * self.efficiency, self.cpu_bytes_s)


def _send(ready: np.ndarray, copies: int, link: Link, chunk_sizes: np.ndarray) -> list[np.ndarray]:
    """Arrival times at each of `copies` children of chunks that became ready at `ready`.

    One uplink sends chunk j to child 0, 1, ..., copies-1, then chunk j+1; a slot starts when
    both the uplink is free and the chunk is ready: finish[s] = max(finish[s-1], ready[s]) + t[s],
    solved as a cumulative max over (ready - prefix time)."""
    t = np.repeat(chunk_sizes / link.bytes_s, copies)
    start = np.repeat(ready + link.hop_s, copies)
    prefix = np.cumsum(t)
    finish = prefix + np.maximum.accumulate(start - (prefix - t))
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


def double_tree_time(size: float, n: int, link: Link, chunk: int = MiB) -> float:
    """Two binary trees, each carrying half the chunks, every node interior in at most one
    (NCCL's double binary tree; not built in rollwire, shown as the log-depth bound)."""
    depth = max(1, math.ceil(math.log2(n + 1)))
    per_chunk = 2 * chunk / link.bytes_s + link.latency_s + link.hop_s
    return size / link.bytes_s + depth * per_chunk + size / link.verify_bytes_s + depth * link.latency_s


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


def _predict(mode: str, size: float, n: int, link: Link, fanout: int, chunk: int) -> float:
    if mode == "star":
        return star_time(size, n, link, chunk)
    return relay_time(size, n, fanout, link, chunk)


def calibrate(data: dict) -> dict:
    """Fit efficiency, per-chunk hop cost and per-host rate on the netlab medians (grid search,
    least relative squared error) and report the model's error at every measured point."""
    link, size, points = _netlab_points(data)
    fanout, chunk = int(data.get("fanout", 1)), int(data.get("chunk_bytes", MiB))
    best = None
    for eff in np.linspace(0.80, 1.0, 21):
        for hop in (50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3):
            for cpu in (0.1e9, 0.2e9, 0.4e9, 0.8e9, 1.6e9):
                trial = replace(link, efficiency=float(eff), hop_s=hop, cpu_bytes_s=cpu)
                err = [
                    (_predict(m, size, n, trial, fanout, chunk) - t) / t
                    for m, per in points.items()
                    for n, t in per.items()
                ]
                score = float(np.mean(np.square(err)))
                if best is None or score < best[0]:
                    best = (score, trial)
    assert best is not None
    fitted = best[1]
    errors = {
        m: {n: round((_predict(m, size, n, fitted, fanout, chunk) - t) / t, 3) for n, t in per.items()}
        for m, per in points.items()
    }
    worst = max(abs(e) for per in errors.values() for e in per.values())
    return {"link": asdict(fitted), "relative_error": errors, "max_abs_error": worst, "fanout": fanout}


# ------------------------------------------------------------------ predictions


def predict(link_template: Link, fanouts=(1, 2, 4), replicas=(1, 2, 4, 8, 16, 64, 256, 1000)) -> list[dict]:
    rows = []
    for gbit in (10, 100):
        link = replace(link_template, rate_bytes_s=gbit * GBIT, latency_s=50e-6)
        payloads = {f"{m} r16": lora_bytes(**SHAPES[m]) for m in ("0.5B", "7B", "70B")}
        payloads |= {f"{m} full": FULL_BYTES[m] for m in ("0.5B", "7B", "70B")}
        for what, size in payloads.items():
            chunk = MiB if size < 2e9 else 8 * MiB  # big payloads: fewer, larger chunks
            row = {"gbit": gbit, "payload": what, "bytes": int(size), "chunk": chunk, "replicas": {}}
            for n in replicas:
                cell = {
                    "star": star_time(size, n, link, chunk) if n <= 64 else None,
                    "nccl_ring": nccl_ring_time(size, n, link, chunk),
                    "double_tree": double_tree_time(size, n, link, chunk),
                }
                for k in fanouts:
                    cell[f"relay_k{k}"] = relay_time(size, n, k, link, chunk)
                row["replicas"][n] = {key: (round(v, 4) if v is not None else None) for key, v in cell.items()}
            one = row["replicas"][1]
            top = row["replicas"][replicas[-1]]
            row["ratio_1000_over_1"] = {
                key: round(top[key] / one[key], 2) for key in top if top[key] is not None and one.get(key)
            }
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--no-calibrate", action="store_true", help="use the default per-hop costs")
    args = parser.parse_args()
    link = Link(rate_bytes_s=10 * GBIT)
    out: dict = {"anchors": ANCHORS}
    netlab = RESULTS / "push_netlab.json"
    if not args.no_calibrate and netlab.exists():
        cal = calibrate(json.loads(netlab.read_text()))
        out["calibration"] = cal
        link = Link(**cal["link"])
        print(f"calibrated on {netlab.name}: max |error| {cal['max_abs_error']:.1%}; {cal['relative_error']}")
    elif not args.no_calibrate:
        print(f"no {netlab}; run bench/push_netlab.py first, or pass --no-calibrate")
    out["predictions"] = predict(link)
    for row in out["predictions"]:
        r = row["ratio_1000_over_1"]
        print(
            f"{row['gbit']:>3} Gb/s {row['payload']:>9}: 1000/1 relay k1 {r['relay_k1']}x, k2 {r['relay_k2']}x, "
            f"ring {r['nccl_ring']}x, double tree {r['double_tree']}x; "
            f"1000 replicas k2 {row['replicas'][1000]['relay_k2']:.3f}s"
        )
    write_result("push_sim", "python bench/push_sim.py", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
