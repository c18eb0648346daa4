"""Weight push on netlab: a LoRA adapter through the proxy to N replicas, each a host behind its own link.

The proxy and every replica run in their own network namespace (tests/support/netlab.py) behind a
link shaped to --rate Mbit/s in each direction; the pusher (this process) is outside, on a
link of the same rate. Replicas are scripted engines serving a config-only Qwen2.5-1.5B-shaped
folder, and the payload is a synthetic rank-16 adapter on all linear layers (bf16, 36.9 MB),
so every byte is received, hashed and checked as in production (as in bench/weight_push.py).
A push is timed from the push call until every replica serves the version: the proxy's
reply, then a 1-token Generate pinned to the version on each replica directly.

  star     the proxy sends every replica its own copy (push.fanout=0): N copies share the
           proxy's uplink, so time grows ~ (1 + N) x link time
  relay    the proxy is the root of a relay tree of replicas (push.fanout=K): every replica
           forwards each chunk to its children as it arrives
  striped  the push dealt over --stripes relay trees (push.stripes=S), chunk j down tree j mod S,
           each replica inner in at most one tree: every uplink carries about one copy
  link     one TCP copy of the same payload over one shaped path in the same lab (outside to
           a host): the floor every push is compared with (`*_over_link`)

Repeats alternate: every repeat runs each N (forward, then backward on the next repeat) and
each mode, with a fresh proxy each time (warmed by a rank-1 push first), so drift on a shared
machine spreads over all figures. Writes bench/results/push_netlab.json (--quick:
push_netlab_quick.json, N = 1, 2, one repeat; another --rate R: push_netlab_Rmbit.json).
Each push also records the CPU seconds of the proxy and replicas and how busy the machine
was (`machine_busy`): every emulated host shares this machine's cores, so past some rate a
push measures the cores, not the links.
With --path grpc bulk, every server listens for bulk bytes (bulk.enabled) and each proxy takes
one push per path in turn (the bulk path's figures under "MODE+bulk"; rollwire.push.bulk).
Needs root (network namespaces): run .venv/bin/python bench/push_netlab.py [--mode star relay striped]
[--replicas 1 2 4 8] [--repeats 2] [--rate 200] [--fanout auto] [--path grpc bulk] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import QWEN25, WORK, config_only_model, spread, write_result
from support import netlab  # tests/support, on the path through common
from weight_push import Pusher, lora_shapes, safetensors_bytes

from rollwire.common.fingerprint import model_fingerprint
from rollwire.common.writer import MAX_CHUNK
from rollwire.demo.stack import Service, routing, start

MODEL, RANK, GiB = "1.5B", 16, 1 << 30
LOGS = WORK / "netlab"

REPLICA_SETTINGS = ("engine=scripted", "scripted.tokens_per_s=0", f"limits.max_adapter_bytes={2 * GiB}")
PROXY_SETTINGS = (
    f"spool.max_adapter_bytes={2 * GiB}",
    "spool.keep_versions=1",
    "health.push_timeout_s=600",
    "grace_seconds=1",
)


def mode_settings(mode: str, args: argparse.Namespace) -> list[str]:
    """The proxy settings (`--set key=value`) that select a broadcast mode: the one place the
    modes differ. Replicas are shared by every mode, so they take no mode settings."""
    if mode == "star":
        return ["push.fanout=0", "push.stripes=1"]
    if mode == "relay":
        return [f"push.fanout={args.fanout}", "push.stripes=1"]
    if mode == "striped":
        return [f"push.stripes={args.stripes}"]
    raise ValueError(f"unknown mode {mode!r}")


MODES = ("star", "relay", "striped")


def start_on(host: netlab.Host, name: str, args: list[str]) -> Service:
    """`rollwire <args>` on `host`, listening on its address, logging to LOGS/<name>.log; returned
    once it serves (the lab kills it at teardown if `stop` did not)."""
    args = [*args, "--host", host.ip, "--port", "0", "--metrics-port", "0"]
    return start(args, LOGS, name, popen=host.popen, host=host.ip)


def start_replicas(hosts: list[netlab.Host], model: Path, bulk: bool = False) -> list[Service]:
    """One scripted replica per host, started at once (listening for bulk bytes too when `bulk`)."""
    settings = [a for s in (*REPLICA_SETTINGS, *(("bulk.enabled=true",) if bulk else ())) for a in ("--set", s)]
    with ThreadPoolExecutor(len(hosts)) as pool:
        args = ["generator", "--model", str(model), *settings]
        return list(pool.map(lambda h: start_on(h, f"replica-{h.name}", args), hosts))


def start_proxy(host: netlab.Host, replicas: list[Service], settings: list[str]) -> Service:
    """A proxy on `host` in front of `replicas`, returned once it routes to every one."""
    args = ["proxy", *(a for r in replicas for a in ("--generator", r.target))]
    args += [a for s in (*PROXY_SETTINGS, *settings) for a in ("--set", s)]
    return routing(start_on(host, "proxy", args), replicas, timeout=60)


def cpu_ticks(pids: list[int]) -> int:
    """User + system clock ticks the processes `pids` have used (utime, stime of /proc/PID/stat)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total


def machine_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of every CPU since boot, from /proc/stat's first line; softirq
    counts as busy: that is where the emulated links' packets are shaped and bridged."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]) - idle, sum(values[:8])


def timed_push(pusher: Pusher, services: list[Service], payload: bytes, version: int, rank: int = RANK) -> dict:
    """`pusher.push` plus what it cost: CPU seconds of the proxy (`services[0]`) and the
    replicas (the rest), and how busy
    the whole machine was. A push whose machine_busy is near 1.0 is bound by this machine's
    cores (every emulated host shares them), not by the links."""
    hz = os.sysconf("SC_CLK_TCK")
    proxy, replicas = [services[0].proc.pid], [s.proc.pid for s in services[1:]]
    p0, r0, (busy0, all0) = cpu_ticks(proxy), cpu_ticks(replicas), machine_ticks()
    times = pusher.push("lora", version, payload, rank)
    p1, r1, (busy1, all1) = cpu_ticks(proxy), cpu_ticks(replicas), machine_ticks()
    return {
        **times,
        "proxy_cpu_s": (p1 - p0) / hz,
        "replicas_cpu_s": (r1 - r0) / hz,
        "services_cpu_s": (p1 - p0 + r1 - r0) / hz,
        "machine_busy": (busy1 - busy0) / max(1, all1 - all0),
    }


def link_time(lab: netlab.Netlab, host: netlab.Host, size: int, repeats: int) -> dict:
    """One TCP copy of `size` bytes from the outside to `host` (outside uplink, host downlink)."""
    netlab.copy_time(lab.outside, host, 1 << 20)  # warm: interpreter, ARP, page cache
    return spread([netlab.copy_time(lab.outside, host, size) for _ in range(repeats)])


def run(args: argparse.Namespace) -> dict:
    model = config_only_model(f"qwen2.5-{MODEL.lower()}", QWEN25[MODEL])
    config = json.loads((model / "config.json").read_text())
    payload = safetensors_bytes(lora_shapes(config, args.rank))
    warm = safetensors_bytes(lora_shapes(config, 1))
    fingerprint = model_fingerprint(model, config_only=True)
    version = {"lora": 0, "warmup": 0}  # newest per name: the replicas outlive every proxy
    runs: list[dict] = []
    with netlab.Netlab(rate_mbit=args.rate, delay_ms=args.delay) as lab:
        proxy_host = lab.add_host("proxy")
        hosts = [lab.add_host(f"r{i}") for i in range(max(args.replicas))]
        link = link_time(lab, proxy_host, len(payload), 3)
        print(f"link: {len(payload) / 1e6:.1f} MB in {link['median']:.3f} s over {args.rate:g} Mbit/s", flush=True)
        bulk = "bulk" in args.path
        replicas = start_replicas(hosts, model, bulk)
        for rep in range(args.repeats):
            for n in args.replicas if rep % 2 == 0 else args.replicas[::-1]:
                for mode in args.mode:
                    settings = [*mode_settings(mode, args), *(["bulk.enabled=true"] if bulk else [])]
                    proxy = start_proxy(proxy_host, replicas[:n], settings)
                    pushers = {path: Pusher(proxy, replicas[:n], fingerprint, path == "bulk") for path in args.path}
                    try:
                        for path in args.path if rep % 2 == 0 else args.path[::-1]:
                            version["warmup"] += 1
                            pushers[path].push("warmup", version["warmup"], warm, 1)
                            version["lora"] += 1
                            services = [proxy, *replicas[:n]]
                            times = timed_push(pushers[path], services, payload, version["lora"], args.rank)
                            label = mode if path == "grpc" else f"{mode}+bulk"
                            runs.append({"mode": label, "n": n, "repeat": rep, **times})
                    finally:
                        for pusher in pushers.values():
                            pusher.close()
                        proxy.stop()
                    for times in runs[-len(args.path) :]:
                        print(
                            f"repeat {rep} {times['mode']:5s} N={n}: served {times['served_s']:.3f} s "
                            f"(reply {times['reply_s']:.3f} s) = {times['served_s'] / link['median']:.2f} x link; "
                            f"CPU s: proxy {times['proxy_cpu_s']:.2f}, replicas {times['replicas_cpu_s']:.2f}; machine {times['machine_busy']:.0%} busy",
                            flush=True,
                        )
    return summarise(args, runs, link, len(payload))


def labels(args: argparse.Namespace) -> list[str]:
    """Each mode, and "MODE+bulk" for its pushes by the bulk path."""
    return [mode if path == "grpc" else f"{mode}+bulk" for mode in args.mode for path in args.path]


def summarise(args: argparse.Namespace, runs: list[dict], link: dict, size: int) -> dict:
    modes: dict = {}
    for mode in labels(args):
        mine = [r for r in runs if r["mode"] == mode]
        per_n = {str(n): [r for r in mine if r["n"] == n] for n in args.replicas}
        modes[mode] = {
            "settings": mode_settings(mode.removesuffix("+bulk"), args),
            "push_s": {n: spread([r["served_s"] for r in rs]) for n, rs in per_n.items()},
            "reply_s": {n: spread([r["reply_s"] for r in rs]) for n, rs in per_n.items()},
            "services_cpu_s": {n: statistics.median(r["services_cpu_s"] for r in rs) for n, rs in per_n.items()},
            "machine_busy": {n: statistics.median(r["machine_busy"] for r in rs) for n, rs in per_n.items()},
            "over_link": {n: statistics.median(r["served_s"] for r in rs) / link["median"] for n, rs in per_n.items()},
        }
    out: dict = {
        "model": f"Qwen2.5-{MODEL} (config only, scripted replicas)",
        "rank": args.rank,
        "payload_bytes": size,
        "chunk_bytes": MAX_CHUNK,
        "rate_mbit": args.rate,
        "link_delay_ms": args.delay,
        "delay_ms": 2 * args.delay,  # one way between two hosts: each crosses its own link
        "replicas": args.replicas,
        "repeats": args.repeats,
        "link_time_s": link["median"],
        "link": link,
        "link_MB_per_s": size / link["median"] / 1e6,
        "modes": modes,
        "runs": runs,
    }
    if "relay" in args.mode:
        out["fanout" if str(args.fanout).isdigit() else "fanout_setting"] = (
            int(args.fanout) if str(args.fanout).isdigit() else args.fanout
        )
    if "striped" in args.mode:
        out["stripes"] = args.stripes
    if 1 in args.replicas:  # the acceptance's figure is at 8 (relay_8_over_1); the largest N beside it
        for n in {n for n in (8, max(args.replicas)) if n > 1 and n in args.replicas}:
            for mode in labels(args):
                push = modes[mode]["push_s"]
                out[f"{mode}_{n}_over_1"] = push[str(n)]["median"] / push["1"]["median"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mode", nargs="+", default=["star"], choices=MODES)
    ap.add_argument("--replicas", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rate", type=float, default=200, help="every link's rate, Mbit/s each direction")
    ap.add_argument("--delay", type=float, default=0, help="every link's added delay, ms each direction (sch_netem)")
    ap.add_argument("--fanout", default="auto", help="relay mode: children per node (1 = chain) or auto")
    ap.add_argument("--stripes", type=int, default=2, help="striped mode: trees the push is dealt over")
    ap.add_argument("--rank", type=int, default=RANK, help="the adapter's rank (16: 37 MB; 128: 296 MB)")
    ap.add_argument("--path", nargs="+", default=["grpc"], choices=["grpc", "bulk"], help="how the bytes travel")
    ap.add_argument("--quick", action="store_true", help="smoke: N = 1, 2 and one repeat")
    args = ap.parse_args()
    if args.quick:
        args.replicas, args.repeats = [1, 2], 1
    ok, why = netlab.available()
    if not ok:
        sys.exit(f"push_netlab needs netlab: {why}")
    load_before = os.getloadavg()[0]
    data = run(args)
    data["load_avg_1m"] = {"before": load_before, "after": os.getloadavg()[0]}  # others' work on this machine
    for mode, row in data["modes"].items():
        cells = ", ".join(f"N={n} {s['median']:.2f}s" for n, s in row["push_s"].items())
        print(f"{mode}: {cells}; link {data['link_time_s']:.2f}s")
    name = "push_netlab_quick" if args.quick else "push_netlab"
    if args.rate != 200:
        name += f"_{args.rate:g}mbit"  # the acceptance's figures are at 200 Mbit/s; others beside them
    if "bulk" in args.path:
        name += "_bulk"
    if args.rank != RANK:
        name += f"_r{args.rank}"
    write_result(name, " ".join([".venv/bin/python bench/push_netlab.py", *sys.argv[1:]]), data)


if __name__ == "__main__":
    main()
