"""Scaling: throughput with 1, 2 and 4 scripted replicas behind one proxy, and where it saturates.

Scripted replicas emit 100 tokens/s per sample (groups of n=8, 32 new tokens). Everything,
the load generator included, shares this machine's 2 cores, so the CPU seconds of each
process are read (psutil) and reported per 1,000 tokens: that is what moves to other
machines on a cluster, while the proxy's share is what one proxy process must carry.
  replicas    N = 1, 2, 4 with 8 groups in flight per replica (ideal 6,400 tokens/s each)
  saturation  N = 4 with 8 ... 128 groups in flight: offered vs achieved tokens/s and the
              proxy's CPU use; the proxy saturates where achieved stops following offered
              while its CPU nears one core (one asyncio event loop).
Run: .venv/bin/python bench/scaling.py [--repeats 3] [--seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os

from common import (
    closed_loop,
    cpu_seconds,
    percentile,
    scripted_model,
    spread,
    start_proxy,
    start_scripted,
    stop_all,
    write_result,
)

N, TOKENS, RATE, PER_REPLICA = 8, 32, 100.0, 8
REPLICAS = (1, 2, 4)
SATURATION_WORKERS = (8, 16, 32, 64, 128)


def ideal_tokens_per_s(workers: int) -> float:
    """A closed loop of `workers` groups at RATE with no overhead at all."""
    return workers * N * TOKENS / ((TOKENS - 1) / RATE)


def measure(proxy, replicas, workers: int, seconds: float) -> dict[str, float]:
    pids = {"proxy": [proxy.proc.pid], "replicas": [r.proc.pid for r in replicas], "client": [os.getpid()]}
    before = {k: sum(map(cpu_seconds, v)) for k, v in pids.items()}
    run = asyncio.run(closed_loop(proxy.target, workers, 0, N, TOKENS, duration_s=seconds))
    cpu = {k: sum(map(cpu_seconds, v)) - before[k] for k, v in pids.items()}
    per_k = 1000 / run["tokens"]
    return {
        "tokens_per_s": run["tokens"] / run["wall_s"],
        "p50_s": percentile(run["latencies"], 50),
        "p99_s": percentile(run["latencies"], 99),
        "proxy_cpu_util": cpu["proxy"] / run["wall_s"],
        "proxy_cpu_s_per_1k_tokens": cpu["proxy"] * per_k,
        "replicas_cpu_s_per_1k_tokens": cpu["replicas"] * per_k,
        "client_cpu_s_per_1k_tokens": cpu["client"] * per_k,
    }


def repeat(proxy, replicas, workers: int, args) -> dict:
    asyncio.run(closed_loop(proxy.target, workers, 1, N, TOKENS))  # warm-up
    runs = [measure(proxy, replicas, workers, args.seconds) for _ in range(args.repeats)]
    row: dict = {k: spread([r[k] for r in runs]) for k in runs[0]}
    row["workers"], row["ideal_tokens_per_s"] = workers, ideal_tokens_per_s(workers)
    row["efficiency"] = spread([r["tokens_per_s"] / row["ideal_tokens_per_s"] for r in runs])
    print(
        f"  {len(replicas)} replicas, {workers:3d} groups: {row['tokens_per_s']['median']:8.0f} tok/s "
        f"(ideal {row['ideal_tokens_per_s']:.0f}), proxy CPU {row['proxy_cpu_util']['median']:.2f} cores, "
        f"{row['proxy_cpu_s_per_1k_tokens']['median'] * 1e3:.1f} ms/1k tokens",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="length of one measurement")
    args = ap.parse_args()
    model = scripted_model()
    replicas = start_scripted(model, max(REPLICAS), "scaling", f"scripted.tokens_per_s={RATE}")
    by_replicas, saturation = {}, {}
    try:
        for count in REPLICAS:
            proxy = start_proxy(
                replicas[:count],
                f"scaling-proxy-{count}",
                f"routing.max_in_flight_per_replica={max(SATURATION_WORKERS)}",
            )
            try:
                by_replicas[str(count)] = repeat(proxy, replicas[:count], PER_REPLICA * count, args)
                if count == max(REPLICAS):
                    for workers in SATURATION_WORKERS:
                        saturation[str(workers)] = repeat(proxy, replicas, workers, args)
            finally:
                proxy.stop()
    finally:
        stop_all(replicas)
    write_result(
        "scaling",
        ".venv/bin/python bench/scaling.py",
        {
            "workload": {
                "n": N,
                "new_tokens": TOKENS,
                "tokens_per_s_per_sample": RATE,
                "groups_per_replica": PER_REPLICA,
                "seconds_per_measurement": args.seconds,
            },
            "replicas": by_replicas,
            "saturation": saturation,
        },
    )


if __name__ == "__main__":
    main()
